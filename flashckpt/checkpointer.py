"""``Checkpointer``: the two-line integration. Save every step to shared memory; restore at start."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from . import config, group, preempt_mark
from .errors import CheckpointNotFoundError, ConfigError, FlashCkptError, SharedMemoryError
from .faults import heartbeat
from .faults.agent_client import AgentClient, socket_path
from .faults.events import EventLog
from .faults.heartbeat import Heartbeat, Phase
from .format.lineage import Lineage
from .format.manifest import DEFAULT_CHUNK_SIZE, Manifest, encode_entries
from .format.slot import Slot, required_capacity
from .restore.agreement import restore_agreed
from .restore.sources import MemorySource, TierSource
from .safe_paths import write_atomic
from .snapshot import device
from .snapshot.copy_plan import CopyPlans
from .snapshot.device_copy import DeviceCopier, PendingCopy
from .snapshot.flatten import Layout, paused_gc
from .snapshot.host_memory import EveryFew
from .snapshot.replicas import ReplicaFinder
from .snapshot.sealer import Sealer
from .snapshot.slot_prep import SlotPreparer
from .snapshot.slots import N_SLOTS, N_STEADY, SlotPair, closed_marker_path, header_or_none
from .snapshot.steady import StateWalker, Walked

log = logging.getLogger(__name__)

_MANIFEST_HEADROOM = 1 << 20
_STAGED_CLOSE_WAIT_S = 30.0  # how long close() waits for a staged snapshot to be committed


class Checkpointer:
    """Flash checkpoints of one rank's state.

    ``save(step, state)`` copies the state into a shared-memory slot and returns without
    touching storage; ``restore(state)`` loads the newest intact snapshot back in place.
    Arguments win over ``FLASHCKPT_*`` environment variables, which win over defaults.
    """

    def __init__(
        self,
        *tiers: str,
        job: str | None = None,
        rank: int | None = None,
        shm_dir: str | None = None,
        run_dir: str | None = None,
        overlap: bool | None = None,
        close_timeout: float | None = None,
        allow_pickle: bool = False,
        verify: bool = True,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        replicated: bool | Collection[str] | None = None,
    ) -> None:
        """``replicated``: which top-level keys of the state every rank holds the same (stored
        once per replica group); None finds DDP's, False stores every rank's copy."""
        from .storage_tiers.registry import check_installed

        for t in tiers:
            check_installed(t)  # validated now: a typo or a missing package fails at start
        # A multi-node job's replicas in other nodes' memory come first after this node's own
        # (FLASHCKPT_PEER_REPLICAS, set by flashckpt-run): a lost node restores from them.
        given = [t for t in tiers if not t.startswith("peer:")]
        peers = [t for t in tiers if t.startswith("peer:")] or config.peer_urls(
            config.peer_replicas()
        )
        tiers = (*peers, *given)
        self.tiers = list(tiers)  # as given: options ride in the query string
        self.job = config.resolve_job(job)
        self.rank = config.resolve_rank(rank)
        self.shm_dir = config.shm_dir(shm_dir)
        self.run_dir = config.run_dir(run_dir, create=bool(tiers))  # only an agent uses it
        if tiers:
            socket_path(self.run_dir, self.job)  # one past the unix limit fails now
            config.check_agent_settings()  # the agent this trainer may start reads them
        self.close_timeout = config.setting_float("close_timeout", close_timeout, 300.0)
        config.list_retry_s()  # read at a restore: a bad value fails here, where the job starts
        if peers:
            from .storage_tiers.peer import peer_timeout

            peer_timeout()
        self.overlap = config.setting_bool("overlap", overlap, True)
        self.allow_pickle = config.check_flag("allow_pickle", allow_pickle)
        self.verify = config.check_flag("verify", verify)
        odd = isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
        if odd or chunk_size <= 0 or chunk_size % 64:
            raise ConfigError(f"chunk_size must be a positive multiple of 64, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.skipped = 0  # snapshots dropped: a reader held the only slot they could go to
        self._capped_skips = EveryFew(log, 30.0)  # their warning, at the host-memory cap

        self._replicas = ReplicaFinder(replicated)
        self._pair = SlotPair(self.shm_dir, self.job, self.rank)
        self._layout: Layout | None = None
        self._entries_json: tuple[Layout | None, str] = (None, "")  # of the layout saved last
        self._first_device: tuple[Layout | None, int | None] = (None, None)  # ... its device leaf
        self._sealer = Sealer()
        self._rt = device.runtime()
        self._prep = SlotPreparer(self._pair, self._rt)
        self._plans = CopyPlans(self._rt.is_device_tensor)  # the slots' views, per layout
        self._walker = StateWalker(chunk_size)  # the state's walk, compiled once it is steady
        self._restore_walker = StateWalker(chunk_size)  # the same, of what restores go into
        self._pending: Future | None = None  # a device snapshot still being copied
        self._staged: StagedSnapshot | None = None  # copied, its step not yet known (stage)
        self._background = ThreadPoolExecutor(1, thread_name_prefix="flashckpt")
        # Made now: in overlapped mode it watches optimizer steps from the first one on.
        self._copier = DeviceCopier(self._rt, self.overlap)
        self._lock = threading.RLock()
        self._closed = False
        self._agent: AgentClient | None = None
        self._last_saved: int | None = None
        self._lineage: Lineage | None = None  # the branch saves go to; set by restore()
        self._incarnation = 0  # the run of the job saves belong to; set by restore()
        self._heartbeat: Heartbeat | None = None  # made once the rank is claimed
        self._no_heartbeat = False
        self._events = EventLog.from_env()  # set by flashckpt-run
        self._save_stall = 0.0  # seconds save() blocked, over all saves
        self._saves = 0
        self._restored_from: str | None = None
        self._stepping_again = False  # a step was restored: the next save() says it trains again

    # ---- public API ------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot ``state`` as ``step``. Returns once the snapshot no longer depends on the
        caller (CPU tensors) or once the device copies are queued (CUDA, overlapped mode)."""
        config.check_step(step)
        self._stepped(step)
        self._save_as(step, state)

    def stage(self, state: Mapping[str, Any]) -> StagedSnapshot:
        """Copy ``state`` into a slot as ``save`` does, before its step is known: nothing
        reads it until ``commit(step)`` on what this returns makes it that step's snapshot
        (DCP's ``async_save`` learns the step after its staging). One staged snapshot at a
        time: a later ``save``, ``stage`` or ``restore`` drops one not committed yet;
        ``close()`` waits up to 30 s for its commit first."""
        staged = StagedSnapshot(self)
        self._save_as(None, state, staged)
        return staged

    def _stepped(self, step: int) -> None:
        if self._stepping_again:  # the first step after a restore is done: training again
            self._stepping_again = False
            if self._events is not None:
                self._events.record("stepped", rank=self.rank, step=step)

    def _save_as(self, step: int | None, state: Mapping[str, Any],
                 staged: StagedSnapshot | None = None) -> None:  # fmt: skip
        began = time.perf_counter()
        # No collection until what the save made is freed again (its frame is gone): at
        # thousands of tensors a collection set off midway would find all of it alive. The
        # snapshot's checksums start after that too: the sealer's thread would otherwise take
        # the interpreter lock in turns with the freeing of thousands of tensors.
        with self._lock, paused_gc():
            after: list[Callable[[], None]] = []
            try:
                self._drop_staged("a later save")
                self._save(step, state, began, after, staged)
            finally:  # a published snapshot is sealed and told of whatever failed after it
                for then in after:
                    then()

    def _save(self, step: int | None, state: Mapping[str, Any], began: float,
              after: list[Callable[[], None]], staged: StagedSnapshot | None) -> None:  # fmt: skip
        """Snapshot ``state`` as ``step``; as ``staged`` where the step is None (its manifest
        is sized for the longest step, and written once the step is known)."""
        self._check_open()
        keys, replicas = self._replicas(state)
        walked = self._walker.walk(state, keys, self._layout)
        layout = self._layout = walked.layout
        if self._entries_json[0] is not layout:
            self._entries_json = (layout, encode_entries(layout.entries))
        manifest = Manifest(
            self.job, self.rank, config.MAX_STEP if step is None else step, walked.tree,
            layout.entries, layout.data_len,
            chunk_size=self.chunk_size, created_at=time.time(), world_size=group.world_size(),
            lineage=self._lineage or Lineage(),
            replicas=replicas if layout.replicated else None,
            incarnation=self._incarnation,
        )  # fmt: skip
        if staged is None:
            raw = manifest.to_json(self._entries_json[1], walked.tree_json)
            raw_len = len(raw)
        else:
            raw, raw_len = b"", manifest.json_size(self._entries_json[1], walked.tree_json)
            staged.manifest, staged.texts = manifest, (self._entries_json[1], walked.tree_json)
            staged.layout, staged.steady = layout, walked.steady
        self._connect_agent()
        need = required_capacity(layout.data_len, raw_len, layout.n_chunks)
        self._settle()
        self._pair.claim()
        beat = self._beat()
        if beat is not None:
            beat.phase(Phase.SAVE, step)
        capacity = need + max(_MANIFEST_HEADROOM, raw_len)
        self._prep.ready_target(need, capacity)
        try:
            self._snapshot(step, state, walked, manifest, raw, (need, capacity), after, staged)
        finally:  # other slots (a spare too, once needed) once the copy is queued
            self._prep.the_rest_in_background(capacity, self._device_of(walked.tensors))
        if beat is not None:
            beat.progress(step)
        self._save_stall += time.perf_counter() - began
        self._saves += 1

    def _snapshot(self, step: int | None, state: Mapping[str, Any], walked: Walked,
                  manifest: Manifest, raw: bytes, size: tuple[int, int],
                  after: list[Callable[[], None]], staged: StagedSnapshot | None) -> None:  # fmt: skip
        """Copy ``state`` into a free slot and publish it (CUDA: once its copies land); or,
        ``staged``, hand the slot to it once the copies land, unpublished."""
        need, capacity = size
        in_use = self._pair.in_use
        slot = self._pair.acquire_for_write(need)
        if slot is None and self._pair.in_use > in_use:
            # Persistence lags: readers hold the older slots and the newest snapshot is kept.
            # A spare slot is readied now, once, and from then on it turns with the rest.
            try:
                self._prep.ready_spare(capacity)
                slot = self._pair.acquire_for_write(need)
            except SharedMemoryError as exc:  # no room for a spare: skip while it lags
                self._pair.in_use = in_use
                log.warning("no spare slot for rank %d: %s", self.rank, exc)
        if slot is None and self._pair.capped:
            slot = self._newest_if_stored(step, need)
            if slot is None:
                return
        if slot is None:
            self.skipped += 1
            log.warning(
                "step %s not snapshotted: readers (the agent storing steps) hold rank %d's "
                "slots but the newest, which is never overwritten", _named(step), self.rank,
            )  # fmt: skip
            return
        self._sealer.cancel(slot)
        try:
            slot.begin_write()
            plan = self._plans.plan(slot, walked.layout, walked.tensors)
            pending = None
            if plan.on_device:  # queued first: the host copies below run while they do
                deferred = self._copier.deferrable(state.values())
                pending = self._copier.copy(plan.device_pairs(walked.tensors), deferred)
            plan.host_copy(walked.tensors)
            if pending is not None and self.overlap and staged is None:
                self._pending = self._background.submit(
                    self._publish_after, pending, slot, manifest, raw
                )
                return
            if pending is not None:
                pending.wait()
            if staged is not None:  # readable once committed; sealing goes on meanwhile
                staged.slot, self._staged = slot, staged
                self._sealer.release()
                return
            self._publish(slot, manifest, raw, after)
        except BaseException:
            self._abandon(slot)
            raise

    def _newest_if_stored(self, step: int | None, need: int) -> Slot | None:
        """The one slot the host-memory cap leaves this rank, to write ``step`` over the
        snapshot it holds, once every tier holds that one; else None, the save skipped."""
        ready = self._pair.ready()
        held = header_or_none(ready[0]) if ready else None
        stored = held is None or self._stored_everywhere((held.generation, held.step))
        slot = self._pair.acquire_newest(need) if stored else None
        if slot is None:
            self.skipped += 1
            why = ("the agent is reading it" if stored else
                   f"not every tier holds step {held.step} yet" if self._agent else
                   "the job names no tier to store it in")  # fmt: skip
            self._capped_skips.warn(
                "step %s not snapshotted: the node's host-memory cap (FLASHCKPT_HOST_MEMORY) "
                "leaves rank %d one slot, and %s; raise the cap for two slots a rank",
                _named(step), self.rank, why,
            )  # fmt: skip
        return slot

    def _stored_everywhere(self, key: tuple[int, int]) -> bool:
        if not self.tiers or self._agent is None:
            return False
        try:
            tiers = self._agent.tier_status(timeout=2)
        except Exception as exc:  # the agent away: nothing is known stored
            log.debug("tier status: %s", exc)
            return False
        return bool(tiers) and all(
            (t.last_committed_generation, t.last_committed_step) >= key for t in tiers
        )

    def restore(
        self, state: Mapping[str, Any], step: int | None = None, *,
        allow_pickle: bool | None = None, strict: bool = True,
        key_map: Callable[[str], str | None] | None = None,
    ) -> Any:  # fmt: skip
        """Load the newest intact snapshot (or ``step``) into ``state`` in place.

        Returns the step restored, or None if there is none (then ``step`` was not asked).
        ``strict=False`` loads what matches, leaves the rest as it is and returns
        ``(step, unmatched)``, the list of what did not match (path, kind, detail).
        ``key_map`` renames the snapshot's dict keys before matching (None drops a key), e.g.
        ``lambda k: k.removeprefix("module.")``. Also readies this rank's slots in the
        background, so the first ``save()`` that follows costs no more than a steady one.
        """
        if allow_pickle is not None:
            config.check_flag("allow_pickle", allow_pickle)
        allow = self.allow_pickle if allow_pickle is None else allow_pickle
        with self._lock, self._released_on_error(), paused_gc():
            self._check_open()
            walked = self._restore_walker.walk(state, self._replicas(state)[0], self._layout)
            layout = self._layout = walked.layout
            if self._entries_json[0] is not layout:
                self._entries_json = (layout, encode_entries(layout.entries))
            raw_len = Manifest(self.job, self.rank, 0, walked.tree, layout.entries,
                               layout.data_len).json_size(self._entries_json[1], walked.tree_json)  # fmt: skip
            capacity = required_capacity(layout.data_len, raw_len, layout.n_chunks) + max(
                _MANIFEST_HEADROOM, raw_len
            )
            self._drop_staged("restore()")  # staged from the state before: never its step
            self._settle()
            self._pair.claim()
            beat = self._beat()
            if beat is not None:
                beat.phase(Phase.RESTORE)
            began = time.monotonic()
            self._prep.wait()  # a slot being grown in the background holds its snapshot still
            self._pair.check_space(capacity)
            self._pair.open_existing()
            self._connect_agent()
            unmatched: list = []
            opts = {"key_map": key_map, "walked": walked,
                    **({} if strict else {"unmatched": unmatched})}  # fmt: skip
            with self._sealer.paused():  # a restore right after a save has the cores
                restored = self._restore(state, step, allow, opts)
            if beat is not None:  # the first step after a restore gets the start-up budget
                beat.phase(Phase.STARTUP, restored)
            if self._events is not None:
                self._events.record("restored", rank=self.rank, step=restored,
                                    seconds=time.monotonic() - began, source=self._restored_from)  # fmt: skip
            self._stepping_again = True  # its first save says it trains (again, or at all)
            # Ready the slots off the training step, the one the first save() goes to first.
            self._prep.the_rest_in_background(capacity, self._device_of(walked.tensors))
            # Freed before the collector runs again: what the walk made (a state_dict() per
            # Stateful, thousands of dicts) would set off a collection of every object.
            del walked, opts
        if restored is None and step is not None:
            raise CheckpointNotFoundError(
                f"step {step} of job {self.job!r} rank {self.rank} is neither in shared memory "
                f"({self.shm_dir}) nor committed in {self._shown_tiers() or 'any tier'}; call restore() "
                "without a step for the newest one"
            )
        return restored if strict else (restored, unmatched)

    def preempted(self) -> bool:
        """Whether the scheduler asked the job to go (``flashckpt-run`` got SIGTERM, or the
        signal or file of ``FLASHCKPT_PREEMPT_SIGNAL`` / ``FLASHCKPT_PREEMPT_FILE``): stop
        at this step boundary, after ``save()``, and ``close()``, which waits until the
        tiers hold the last step. Under a process group every rank gets the same answer (one
        small collective: call it at the same point on every rank), so all stop at the same
        step. Outside ``flashckpt-run`` it is always False."""
        asked = preempt_mark.read(self.run_dir, self.job) is not None
        if group.world_size() > 1:
            asked = any(group.gather(asked))
        return asked

    def wait(
        self, step: int | None = None, tier: str | None = None, timeout: float | None = None
    ) -> int:
        """Block until a snapshot (the newest, or ``step`` or later) is in shared memory, or,
        with ``tier``, committed in that tier. Works from any process of the job that names
        the same job and rank. Returns the step; TimeoutError after ``timeout`` seconds."""
        with self._waiting(timeout):
            if tier is not None:
                return self._wait_tier(tier, step, timeout)
            return self._wait_in_memory(step, timeout)

    def _wait_in_memory(self, step: int | None, timeout: float | None) -> int:
        with self._lock:
            self._check_open()
            self._settle()

        def in_memory() -> set[int]:
            with self._lock:
                self._pair.open_existing()  # another process may create the slots meanwhile
                held = {
                    (h.generation, h.step) for s in self._pair.ready() if (h := header_or_none(s))
                }
            gen = self.generation if self._lineage else max((g for g, _ in held), default=0)
            return {s for g, s in held if g == gen}

        return self._wait_until(in_memory, step, timeout, f"shared memory ({self.shm_dir})", 0.005)

    def close(self) -> None:
        """Finish the snapshot in flight, wait for the tiers to commit the last step, stop
        background work and free this rank's slots (or leave them to the agent if a tier is
        still behind after ``close_timeout`` seconds)."""
        staged = self._staged
        if staged is not None:  # dcp.async_save's background commits it in a moment
            staged.settled.wait(min(self.close_timeout, _STAGED_CLOSE_WAIT_S))
        with self._lock:
            if self._closed:
                return
            remove = True
            try:
                with self._waiting(self.close_timeout):  # close_timeout bounds it: no hang
                    self._drop_staged("close()")
                    self._settle()
                    self._prep.wait(raise_errors=False)  # every slot sized before deciding
                    if self._last_saved is None:
                        # Nothing of ours in the slots: free them only if they hold no snapshot
                        # (e.g. ones restore() readied), never another trainer's.
                        remove = self._holds_nothing()
                    else:
                        remove = self._persisted_everywhere()
            finally:
                self._closed = True
                self._background.shutdown(wait=True)
                self._copier.close()
                self._prep.close()
                self._sealer.close()
                if not remove and self._last_saved is not None:
                    marker = closed_marker_path(self.shm_dir, self.job, self.rank)
                    write_atomic(marker, f"{self._last_saved} {self.generation}".encode())
                self._close_heartbeat()
                self._plans.clear()  # its views into the slots go first
                self._pair.close(remove=remove)
                if self._agent is not None:
                    self._agent.close()

    def fence(self) -> None:
        """Make the device wait, before any work queued after this call, for the copies of
        the snapshot in flight (overlapped mode). ``optimizer.step()`` does this by itself;
        call it before writing in place, outside an optimizer step, to a tensor the last
        ``save()`` holds (``p.data.clamp_()``, a hand-written update, work on another stream).
        Returns at once: the wait is queued on the device, not done on the CPU."""
        self._copier.fence()

    def overlap_with_step(self, *objects: Any) -> None:
        """Declare tensors that only an optimizer step writes besides the optimizers' own
        parameters and state (a framework that updates its own copy of the parameters after
        the optimizer steps, as DeepSpeed's ZeRO does): modules (their parameters) or tensors.
        Their copies then overlap forward and backward too."""
        for obj in objects:
            tensors = obj.parameters() if isinstance(obj, torch.nn.Module) else [obj]
            self._copier.also_step_written(tensors)

    def _device_of(self, tensors: list[torch.Tensor]) -> Any:
        """The device of the state's first device tensor, or None for a host state."""
        layout = self._layout
        if self._first_device[0] is not layout or layout is None:
            first = next((i for i, t in enumerate(tensors) if self._rt.is_device_tensor(t)), None)
            self._first_device = (layout, first)
        first = self._first_device[1]
        return None if first is None else self._rt.device_of(tensors[first])

    def _beat(self) -> Heartbeat | None:
        """This rank's heartbeat page, made on first use once the rank is claimed."""
        if self._heartbeat is None and not self._no_heartbeat:
            self._heartbeat = heartbeat.open_for_rank(self.shm_dir, self.job, self.rank)
            self._no_heartbeat = self._heartbeat is None
        return self._heartbeat

    def _waiting(self, budget_s: float | None) -> contextlib.AbstractContextManager:
        """The wait phase of this rank's heartbeat page for a block, a wait and not a hang. A
        process with no page (one that only waits, naming the rank) touches none."""
        beat = self._heartbeat
        return beat.waiting(budget_s) if beat is not None else contextlib.nullcontext()

    def _close_heartbeat(self) -> None:
        beat, self._heartbeat = self._heartbeat, None
        if beat is None:
            return
        if self._events is not None:
            self._events.record("closed", rank=self.rank, last_saved=self._last_saved,
                                save_stall_s=self._save_stall, saves=self._saves,
                                step_s=beat.typical_step_s())  # fmt: skip
        beat.close()

    def _holds_nothing(self) -> bool:
        try:
            self._pair.open_existing()
        except (FlashCkptError, OSError):  # not ours to look at (or gone): leave it alone
            return False
        return not self._pair.ready()

    @property
    def generation(self) -> int:
        """The branch of the job's history this Checkpointer saves into (0 until a restore
        goes back to an older step than the newest held)."""
        return (self._lineage or Lineage()).generation

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------
    @contextlib.contextmanager
    def _released_on_error(self) -> Iterator[None]:
        """A restore that fails gives the rank's claim back, so a new Checkpointer (in this
        process too) can take the rank; this one claims it again on its next call."""
        try:
            yield
        except BaseException:
            self._pair.release()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise FlashCkptError("this Checkpointer is closed; create a new one")

    def _commit(self, staged: StagedSnapshot, step: int) -> None:
        """Publish ``staged`` as ``step`` (see ``stage``)."""
        config.check_step(step)
        with self._lock:
            if self._staged is not staged:
                raise FlashCkptError(
                    f"step {step} of rank {self.rank} was staged but not snapshotted: "
                    f"{staged.dropped_by or 'the Checkpointer was closed'} came first; wait "
                    "for one save (e.g. dcp.async_save's future) before the next"
                )
            self._staged = None
            slot, manifest = staged.slot, dataclasses.replace(staged.manifest, step=step)
            self._stepped(step)
            after: list[Callable[[], None]] = []
            try:
                self._publish(slot, manifest, manifest.to_json(*staged.texts), after)
            except BaseException:
                self._abandon(slot)
                raise
            finally:
                staged.settled.set()
                for then in after:
                    then()

    def _drop_staged(self, by: str) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.dropped_by = by
            staged.settled.set()
            log.warning("rank %d: a staged snapshot never committed is dropped by %s", self.rank,
                        by)  # fmt: skip
            self._abandon(staged.slot)

    def _settle(self) -> None:
        """Wait for the CUDA snapshot in flight; re-raise its error."""
        fut, self._pending = self._pending, None
        if fut is not None:
            fut.result()

    def _publish(self, slot: Slot, manifest: Manifest, raw: bytes,
                 after: list[Callable[[], None]] | None = None) -> None:  # fmt: skip
        """Make the snapshot readable, then have it checksummed and the agent told; those two
        go to ``after`` when given (the caller runs them once its own work is done)."""
        slot.publish(manifest.step, manifest.data_len, raw, manifest.n_chunks, manifest.generation)
        seq = slot.seq()
        self._pair.written(slot)
        slot.unlock()
        self._sealer.release()
        self._last_saved = manifest.step

        def seal_and_tell() -> None:
            self._sealer.submit(slot, seq, manifest)
            if self._agent is not None:
                self._agent.notify(
                    self.rank, manifest.step, world_size=manifest.world_size or 0,
                    local_world_size=config.local_world_size(), generation=manifest.generation,
                )  # fmt: skip

        if after is None:
            seal_and_tell()
        else:
            after.append(seal_and_tell)

    def _publish_after(
        self, pending: PendingCopy, slot: Slot, manifest: Manifest, raw: bytes
    ) -> None:
        """Publish once the overlapped copies have landed, unless the snapshot is torn."""
        try:
            # This thread's own device: without one, waiting would make a context on GPU 0.
            self._rt.use_device(next(iter(pending.done)))
            pending.wait()
        except BaseException:
            self._abandon(slot)
            raise
        if pending.torn is None:
            self._publish(slot, manifest, raw)
            return
        self._abandon(slot)
        self.skipped += 1
        log.warning("step %d of rank %d dropped: %s, so the copy may hold either value; the "
                    "step before it stays the newest. Call Checkpointer.fence() before such "
                    "writes (see the README)", manifest.step, self.rank, pending.torn)  # fmt: skip

    def _abandon(self, slot: Slot) -> None:
        """A write that failed leaves the slot WRITING (never readable) and unlocked."""
        self._pair.written(slot)
        slot.unlock()
        self._sealer.release()

    def _restore(self, state: Mapping[str, Any], step: int | None, allow: bool,
                 opts: dict) -> int | None:  # fmt: skip
        """Restore the newest step every rank can get, each rank from its fastest source, and
        set the branch the next saves go to."""
        sources = [MemorySource(self._pair, self.verify, self._prep.pinner.pinned)]
        sources += [TierSource(url, self.job, self.rank, self.verify, together=True)
                    for url in self.tiers]  # fmt: skip
        got = restore_agreed(state, sources, step, allow, opts, self.job)
        for name, when, why in got.skipped:
            if self._events is not None:
                self._events.record("restore_source_skipped", rank=self.rank, source=name,
                                    at=when, why=why)  # fmt: skip
        if got.source is not None:
            log.info("restored step %d of rank %d from %s", got.step, self.rank, got.source)
            self._restored_from = got.source
        if got.step != got.newest_held and got.newest_held >= 0:  # went back: a new branch
            log.info("job %s rank %d: restored step %s of %d held; later saves start "
                     "generation %d", self.job, self.rank, got.step, got.newest_held,
                     got.lineage.generation)  # fmt: skip
        self._lineage = got.lineage
        self._incarnation = got.incarnation
        return got.step

    def _connect_agent(self) -> None:
        if self.tiers and self._agent is None:
            self._agent = AgentClient.connect(self.job, self.run_dir, self.shm_dir)
            stored_to = self._agent.register(
                self.rank, group.world_size(), self.tiers, self.shm_dir, config.local_world_size()
            )
            self._pair.max_in_use = min(N_SLOTS, N_STEADY + max(1, len(stored_to)))

    def _wait_tier(self, tier: str, step: int | None, timeout: float | None) -> int:
        from .storage_tiers import parse_spec
        from .storage_tiers.registry import redact

        same = [t for t in self.tiers if parse_spec(t).url == parse_spec(tier).url]
        if not same:
            raise ConfigError(
                f"tier {redact(tier)!r} is not one of this Checkpointer's tiers "
                f"{self._shown_tiers()}"
            )
        want = step if step is not None else self._last_saved
        source = TierSource(same[0], self.job, self.rank, verify=False)
        whole = parse_spec(tier).scope.value == "shared"  # there: committed for every rank
        return self._wait_until(
            lambda: source.steps(self._lineage, whole), want, timeout, source.name, 0.1
        )

    def _shown_tiers(self) -> list[str]:
        """The tier URLs fit for messages: credentials shown as ***."""
        from .storage_tiers.registry import redact

        return [redact(t) for t in self.tiers]

    def _wait_until(self, steps: Callable[[], set[int]], want: int | None, timeout: float | None,
                    where: str, interval: float) -> int:  # fmt: skip
        """Poll ``steps()`` until it holds ``want`` or later (any step if None); the newest."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            newest = max(steps(), default=None)
            if newest is not None and (want is None or newest >= want):
                return newest
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"step {'(any)' if want is None else want} of job {self.job!r} rank {self.rank} "
                    f"is not in {where} after {timeout}s (newest there: {newest}); for a tier, the "
                    f"agent's log in {self.run_dir} says why"
                )
            time.sleep(interval)

    def _persisted_everywhere(self) -> bool:
        """Wait (up to close_timeout) until every tier committed the last step or is failing."""
        if not self.tiers or self._last_saved is None or self._agent is None:
            return True
        shape = {"world_size": group.world_size(), "local_world_size": config.local_world_size()}
        return self._agent.wait_persisted(
            self.rank, self._last_saved, self.generation, self.close_timeout, **shape
        )


def _named(step: int | None) -> str:
    return "(staged)" if step is None else str(step)


class StagedSnapshot:
    """A snapshot copied by ``Checkpointer.stage``, unreadable until ``commit(step)``."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._checkpointer = checkpointer
        self.slot: Slot | None = None  # None: the save was skipped (see Checkpointer.skipped)
        self.manifest: Manifest | None = None
        self.texts: tuple[str, str] = ("", "")  # the manifest's entries and tree, as JSON
        self.layout: Layout | None = None  # one object while the state keeps its structure
        # The state had the structure of the one this Checkpointer walked before it (the same
        # containers, keys and tensor shapes; only scalars may differ).
        self.steady = False
        self.dropped_by: str | None = None
        self.settled = threading.Event()  # committed or dropped

    def commit(self, step: int) -> None:
        """Make the snapshot ``step``'s: readable, checksummed and told to the agent as a
        ``save(step, ...)`` is. A skipped save commits nothing. FlashCkptError when a later
        save, or ``close()``, dropped it first."""
        if self.slot is not None or self.dropped_by is not None:
            self._checkpointer._commit(self, step)

    def drop(self) -> None:
        """Give the slot back unpublished (a save whose step turned out not to be wanted)."""
        ck = self._checkpointer
        with ck._lock:
            if ck._staged is self:
                ck._staged, self.dropped_by = None, "drop()"
                self.settled.set()
                ck._abandon(self.slot)
