"""``flashckpt``: look at and check snapshots in shared memory and in storage tiers.

flashckpt list   --job J [--tier URL ...]      steps held in memory and committed per tier
flashckpt verify --job J --tier URL [--step N] re-read a committed step, checking every chunk
"""

from __future__ import annotations

import argparse
import sys

from . import config, tier_io
from .checksum import verify_entry
from .errors import FlashCkptError
from .slot import Slot
from .slots import N_SLOTS, ranks_in, slot_path
from .sources import run_with_tier


def _list(args: argparse.Namespace) -> int:
    shm = config.shm_dir(args.shm_dir)
    print(f"memory ({shm / args.job}):")
    for rank in ranks_in(shm, args.job):
        for i in range(N_SLOTS):
            try:
                slot = Slot.open_readonly(slot_path(shm, args.job, rank, i))
            except OSError:
                continue
            h = slot.header()
            state = (
                f"READY step {h.step}" + (" sealed" if h.sealed else "")
                if h.readable
                else h.state.name
            )
            print(f"  rank {rank} slot {i}: {state} ({h.data_len / 2**20:.1f} MiB)")
            slot.close()
    for url in args.tier:
        steps = run_with_tier(url, lambda t: tier_io.list_steps(t, args.job))
        print(f"{url}:")
        for step, c in sorted(steps.items()):
            what = (
                "uncommitted"
                if c is None
                else f"ranks {sorted(c.ranks)} of {c.world_size}"
                + (" committed" if c.complete else " partial")
            )
            print(f"  step {step}: {what}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    async def go(tier) -> int:
        listing = await tier_io.list_steps(tier, args.job)
        done = sorted(s for s, c in listing.items() if c is not None and c.complete)
        step = args.step if args.step is not None else (done[-1] if done else None)
        if step not in listing or listing[step] is None:
            print(
                f"step {step} is not committed in {args.tier[0]} (committed: {done})",
                file=sys.stderr,
            )
            return 2
        for rank in sorted(listing[step].ranks):
            manifest, data = await tier_io.read_rank(tier, args.job, step, rank)
            view = memoryview(data.numpy())
            for entry in manifest.entries:
                verify_entry(
                    view, entry, manifest.chunk_size, f"{args.tier[0]} step {step} rank {rank}"
                )
            print(
                f"step {step} rank {rank}: {len(manifest.entries)} entries, {manifest.n_chunks} chunks OK"
            )
        return 0

    return run_with_tier(args.tier[0], go)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="flashckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="steps in shared memory and in tiers")
    ls.add_argument("--job", required=True)
    ls.add_argument("--tier", action="append", default=[], metavar="URL")
    ls.add_argument("--shm-dir", default=None)
    ls.set_defaults(fn=_list)
    vf = sub.add_parser("verify", help="check every chunk of a committed step against its checksum")
    vf.add_argument("--job", required=True)
    vf.add_argument("--tier", action="append", required=True, metavar="URL")
    vf.add_argument("--step", type=int, default=None)
    vf.set_defaults(fn=_verify)
    args = p.parse_args(argv)
    try:
        config.validate_name("job", args.job)
        sys.exit(args.fn(args))
    except FlashCkptError as exc:
        print(f"flashckpt: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
