"""``flashckpt``: look at and check snapshots in shared memory and in storage tiers.

flashckpt list   --job J [--tier URL ...]      steps held in memory and committed per tier,
                                               and what the job's controller (if one runs
                                               for it on this node) says: nodes, detections,
                                               steps committed for every rank
flashckpt verify --job J --tier URL [--step N] re-read a committed step as a restore would:
                                               every manifest, size and chunk; exit 1 on any
                                               problem, each one reported
flashckpt report EVENTS.jsonl [...] [--json]   effective training time from the event logs
                                               of flashckpt-run (one per node): failures,
                                               detect, restart, restore, recomputed steps
"""

from __future__ import annotations

import argparse
import sys

from . import config, control, tier_io
from .checksum import bad_chunks
from .errors import FlashCkptError, SharedMemoryError
from .slot import Slot
from .slots import N_SLOTS, ranks_in, slot_path
from .sources import run_with_tier
from .storage_tiers.registry import redact


def _list(args: argparse.Namespace) -> int:
    shm = config.shm_dir(args.shm_dir, create=False)
    print(f"memory ({shm / args.job}):")
    for rank in ranks_in(shm, args.job):
        for i in range(N_SLOTS):
            path = slot_path(shm, args.job, rank, i)
            try:
                slot = Slot.open_readonly(path)
            except FileNotFoundError:
                continue
            except OSError as exc:  # not a slot (any more), or unreadable: say so, go on
                print(f"  rank {rank} slot {i}: corrupt ({exc})")
                continue
            try:
                h = slot.header()
            except SharedMemoryError as exc:
                print(f"  rank {rank} slot {i}: corrupt ({exc})")
                continue
            finally:
                slot.close()
            state = (
                f"READY step {h.step}" + (" sealed" if h.sealed else "")
                if h.readable
                else h.state.name
            )
            print(f"  rank {rank} slot {i}: {state} ({h.data_len / 2**20:.1f} MiB)")
    failed = False
    for url in args.tier:
        print(f"{redact(url)}:")
        try:
            steps = run_with_tier(url, lambda t: tier_io.list_steps(t, args.job))
        except (FlashCkptError, OSError) as exc:
            print(f"  cannot be listed: {exc}")
            failed = True
            continue
        for (gen, step), c in sorted(steps.items(), key=lambda kc: (kc[0][1], kc[0][0])):
            branch = f" (generation {gen})" if gen else ""
            print(f"  step {step}{branch}: {_commit_state(c)}")
    _controller(args)
    return 1 if failed else 0


def _controller(args: argparse.Namespace) -> None:
    endpoint = control.Endpoint.load(config.run_dir(args.run_dir, create=False), args.job)
    if endpoint is None:
        return
    try:
        status = control.job_status(endpoint, args.job)
    except Exception as exc:  # a controller that is gone is worth a line, not a failure
        print(f"controller {endpoint.address}: does not answer ({exc.__class__.__name__})")
        return
    print(f"controller {endpoint.address} (policy {status.policy}):")
    for n in status.nodes:
        ranks = sorted(w.rank for w in n.workers if w.alive and w.phase != "closed")
        state = "LOST" if n.lost else f"seen {n.last_seen_s:.1f}s ago"
        print(f"  node {n.node}: {state}, running ranks {ranks}")
    for d in status.detections:
        who = f"rank {d.rank} on {d.node}" if d.rank >= 0 else f"node {d.node}"
        print(f"  {d.kind.replace('_', ' ')}: {who}, {d.age_s:.0f}s ago ({d.action})")
    for g in status.commits:
        branch = f" (generation {g.generation})" if g.generation else ""
        print(f"  {g.url}: step {g.step}{branch} committed for every rank")


def _commit_state(c: tier_io.CommittedStep | None) -> str:
    if c is None:
        return "uncommitted"
    what = f"ranks {sorted(c.ranks)} of {c.world_size}" + (
        " committed" if c.complete else " partial"
    )
    if c.problems:
        what += f", corrupt: {len(c.problems)} commit marker(s) unreadable: " + "; ".join(
            c.problems
        )
    return what


async def _verify_rank(tier, url: str, job: str, key: tuple[int, int], rank: int) -> list[str]:
    """Everything wrong with one rank's copy of ``key``: what a restore would refuse."""
    gen, step = key
    try:
        manifest, data = await tier_io.read_rank(tier, job, step, rank, gen)
    except FlashCkptError as exc:
        return [str(exc)]
    view = memoryview(data.numpy())
    where = f"{url} step {step} rank {rank}"
    problems = [
        str(e)
        for entry in manifest.entries
        for e in bad_chunks(view, entry, manifest.chunk_size, where)
    ]
    if not problems:
        print(
            f"step {step} rank {rank}: {len(manifest.entries)} entries, {manifest.n_chunks} chunks OK"
        )
    return problems


def _verify(args: argparse.Namespace) -> int:
    url = args.tier[0]
    shown = redact(url)  # no credentials in what is printed

    async def go(tier) -> int:
        listing = await tier_io.list_steps(tier, args.job)
        lineage = tier_io.head(listing)  # the branch a restore would take
        ours = {s: (g, s) for g, s in listing if lineage.holds(g, s)}
        done = sorted(tier_io.in_lineage(listing, lineage))
        step = args.step if args.step is not None else (done[-1] if done else None)
        key = ours.get(step) if step is not None else None
        c = listing.get(key) if key is not None else None
        if c is None or not (c.ranks or c.problems):
            print(f"step {step} is not committed in {shown} (committed: {done})", file=sys.stderr)
            return 2
        problems = list(c.problems)
        if not c.complete:
            problems.append(
                f"{shown} step {step}: only ranks {sorted(c.ranks)} of {c.world_size} are "
                "committed; a restore cannot use this step"
            )
        for rank in sorted(c.ranks):
            problems += await _verify_rank(tier, shown, args.job, key, rank)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"step {step} in {shown}: {len(problems)} problem(s) found", file=sys.stderr)
        return 1 if problems else 0

    return run_with_tier(url, go)


def _report(args: argparse.Namespace) -> int:
    import json

    from .events import read_events
    from .report import render, summarize

    events = [e for path in args.events for e in read_events(path)]
    if not events:
        print(f"flashckpt: no events in {', '.join(args.events)}", file=sys.stderr)
        return 1
    report = summarize(events)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="flashckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="steps in shared memory and in tiers")
    ls.add_argument("--job", required=True)
    ls.add_argument("--tier", action="append", default=[], metavar="URL")
    ls.add_argument("--shm-dir", default=None)
    ls.add_argument("--run-dir", default=None, help="where the job's controller endpoint is")
    ls.set_defaults(fn=_list)
    vf = sub.add_parser("verify", help="check every chunk of a committed step against its checksum")
    vf.add_argument("--job", required=True)
    vf.add_argument("--tier", action="append", required=True, metavar="URL")
    vf.add_argument("--step", type=int, default=None)
    vf.set_defaults(fn=_verify)
    rp = sub.add_parser("report", help="effective training time from flashckpt-run event logs")
    rp.add_argument("events", nargs="+", metavar="EVENTS.jsonl",
                    help="event logs, one per node (<run_dir>/<job>.events.jsonl)")  # fmt: skip
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.set_defaults(fn=_report)
    args = p.parse_args(argv)
    try:
        if hasattr(args, "job"):
            config.validate_name("job", args.job)
        sys.exit(args.fn(args))
    except (FlashCkptError, OSError) as exc:  # a tier that cannot be reached, a bad argument
        print(f"flashckpt: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
