"""Which step a restore loads: the newest one every rank can get, each rank from its fastest
source, and the branch of the job's history the saves that follow go to.

Every rank follows the branch of the newest generation any rank holds (steps of a branch
abandoned by a rollback are never candidates), tries the newest step every rank holds, and
falls back to the next older one together with the others when any rank's copies of it are
all bad. Going back from the newest step held starts a new branch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import group
from ..errors import PartlyRestoredError, TierUnavailableError
from ..format.lineage import Lineage, newest
from . import entry_copy
from .sources import claim_run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    step: int | None  # None: no step every rank can get
    lineage: Lineage  # the branch the next saves go to
    source: str | None  # the name of the source it came from
    newest_held: int  # the newest step any rank holds (-1: none)
    incarnation: int = 0  # the run of the job this restore starts (recorded in what it saves)
    skipped: tuple[tuple[str, str, str], ...] = ()  # optional sources passed by: (name, when, why)


def restore_agreed(state: Mapping[str, Any], sources: list, step: int | None, allow: bool,
                   opts: dict, job: str) -> Restored:  # fmt: skip
    """Load into ``state`` the newest step every rank can get (or ``step``) from the first
    of ``sources`` (fastest first) holding an intact copy."""
    # A shared tier is listed once, by rank 0, when every rank names the same shared tiers
    # (else each rank lists its own: a collective only some ranks entered would hang).
    together = tuple(src.url for src in sources if getattr(src, "together", False))
    if len(set(group.gather(together))) > 1:
        for src in sources:
            if getattr(src, "together", False):
                src.together = False
    held = [src.snapshots() for src in sources]
    known = {k: lin for h in held for k, lin in h.items()}
    lineage = newest(group.gather(newest(list(known.values()))))  # type: ignore[arg-type]
    mine = {s: (g, s) for g, s in known if lineage.holds(g, s)}
    heads: list[int] = group.gather(max(mine, default=-1))  # type: ignore[assignment]
    newest_held = max(heads)
    newest_gen = max(group.gather(max((g for g, _ in known), default=0)))  # type: ignore[type-var]
    # Every agreeing restore starts a new run of the job, newer than any a source shows and
    # than any claimed in a shared tier (claimed below): what it saves never completes a step
    # together with writers of an earlier run, and theirs above the newest step seen here
    # never count again (``fence``).
    runs = max((getattr(src, "incarnation", 0) for src in sources), default=0)
    newest_seen = max((s for _, s in known), default=-1)
    # Claimed where the tiers were listed: a restore of a named step goes on without a tier
    # that could not be (its claim waits for the next restore; until then its writes are
    # fenced by the run numbers it shows).
    claims = [src.url for src in sources
              if getattr(src, "claims", False) and not getattr(src, "unlisted", "")]  # fmt: skip
    runs, newest_seen, claimed = map(
        max, zip(*group.gather((runs, newest_seen, bool(claims))), strict=True)
    )
    incarnation = runs + 1
    unlisted = [(src.name, src.unlisted) for src in sources if getattr(src, "unlisted", "")]
    blind = [names for names in group.gather(unlisted) if names]
    if step is None and blind:
        # The tier may hold newer steps, or a newer branch: restoring an older step from
        # another source (or starting over) would continue an older branch, and retention
        # would then delete what the tier holds. Every rank stops here together, before
        # anything is loaded.
        name, why = blind[0][0]
        raise TierUnavailableError(
            f"job {job}: tier {name} could not be listed ({why}), so the job's steps there "
            "were not seen; make it reachable and restart, leave it out of the tiers to "
            "restore without it, or name the step to restore (restore(step=N))"
        )
    # An optional source some rank skipped may hold newer steps of this branch than any seen.
    skipped = any(group.gather(any(getattr(src, "skipped", "") for src in sources)))
    writes = entry_copy.writes()
    restored, source = _load_agreed(state, sources, held, mine, step, allow, opts, job)
    if restored is None and any(group.gather(entry_copy.writes() != writes)):
        asked = "no step was restored" if step is None else f"step {step} was not restored"
        raise PartlyRestoredError(
            f"job {job}: {asked}, and the state holds part of a copy that failed "
            "part way (found corrupt, or rewritten while it was read: see the warnings "
            "above), so it holds neither its old values nor a step; restore again from "
            "another tier or step, or build the state afresh before training on"
        )
    if restored is None and step is None and newest_held < 0:
        _warn_starting_over(job, [src.name for src in sources if getattr(src, "empty", False)])
    if step is None and restored is not None and restored < newest_held:
        _warn_going_back(job, restored, newest_held, heads)
    if (restored != newest_held and newest_held >= 0) or skipped:
        # Going back (asked for, or past corrupt copies) starts a new branch: the steps saved
        # from here on are stored apart from the abandoned ones, and preferred. So does a
        # restore that skipped a source: were it to come back holding a newer step of the
        # old branch, a later restore would jump to that step and drop the work in between.
        lineage = lineage.branch(newest_gen + 1, -1 if restored is None else restored)
        if skipped:
            log.warning("job %s: a source was skipped (see above), so the steps saved from "
                        "here on start generation %d, after step %s: a newer step of the old "
                        "branch the skipped source may hold is never restored", job,
                        lineage.generation, restored)  # fmt: skip
    if claimed:  # on every rank, or on none: a collective
        incarnation = group.from_first(
            lambda: claim_run(claims, job, incarnation, newest_seen)  # type: ignore[arg-type]
        )
    failures = tuple((src.name, when, why) for src in sources
                     for when, why in getattr(src, "failures", ()))  # fmt: skip
    return Restored(restored, lineage, source, newest_held, incarnation, failures)


def _warn_starting_over(job: str, empty: list[str]) -> None:
    """A job that finds no step starts at step 0: say which tiers held nothing of it, as an
    unmounted file system, a wrong path or a misspelt job name looks just like a new job."""
    if empty:
        log.warning(
            "job %s: no step to restore, starting over; nothing of the job is in %s. If this "
            "job ran before, stop it: a tier may be unmounted or misnamed, or the job name "
            "changed (directory tiers take create=0 to make a missing directory an error)",
            job, ", ".join(empty),
        )  # fmt: skip


def _warn_going_back(job: str, restored: int, newest_held: int, heads: list[int]) -> None:
    """Say why a restore goes back past a step some ranks hold, when it is because other
    ranks hold no copy of it (not because its copies are bad)."""
    lacking = [rank for rank, head in enumerate(heads) if head < newest_held]
    if not lacking:
        return  # every rank held it: its copies were bad, as the warnings before say
    log.warning(
        "job %s: restoring step %d, the newest every rank holds, not step %d: ranks %s hold no "
        "copy of it. Later saves start a new branch and steps after %d are abandoned. If the "
        "job was restarted with more ranks than saved step %d, restart with as many as saved "
        "it; a new rank restores only DDP replicas or DTensor shards of a step",
        job, restored, newest_held, lacking, restored, newest_held,
    )  # fmt: skip


def _load_agreed(state: Mapping[str, Any], sources: list, held: list[dict],
                 mine: dict[int, tuple[int, int]], step: int | None, allow: bool, opts: dict,
                 job: str) -> tuple[int | None, str | None]:  # fmt: skip
    """Load the newest step of ``mine`` every rank can get (or ``step``); it and its source."""
    candidates = set(mine)
    group.warn_if_some_hold_none(bool(candidates), job, asked=step)
    while True:
        choice = group.newest_common(candidates) if step is None else step
        if choice is None:
            return None, None
        key, found, error = mine.get(choice), None, None
        try:  # a bad copy makes load() False; anything raised is an error of the caller's
            for src, keys in zip(sources, held, strict=True):
                if key in keys and src.load(state, key, allow, **opts):
                    found = src.name
                    break
        except Exception as exc:  # raised below on every rank together, not here alone
            error = exc
        if group.all_true(found is not None, error):
            return choice, found
        if step is not None:
            return None, None
        candidates.discard(choice)
