"""``Checkpointer``: the two-line integration. Save every step to shared memory; restore at start."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from . import config, cuda, group
from .agent_client import AgentClient
from .errors import CheckpointNotFoundError, ConfigError, FlashCkptError
from .flatten import Layout, Leaf, copy_into, flatten, plan_layout
from .manifest import DEFAULT_CHUNK_SIZE, Entry, Manifest
from .sealer import Sealer
from .slot import HEADER_SIZE, Slot, required_capacity
from .slots import SlotPair
from .sources import MemorySource, TierSource

log = logging.getLogger(__name__)

_MANIFEST_HEADROOM = 1 << 20


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
    ) -> None:
        from .storage_tiers import parse_spec

        for t in tiers:
            parse_spec(t)  # validated now: a typo fails at start, not in the agent
        self.tiers = list(tiers)  # as given: options ride in the query string
        self.job = config.resolve_job(job)
        self.rank = config.resolve_rank(rank)
        self.shm_dir = config.shm_dir(shm_dir)
        self.run_dir = config.run_dir(run_dir)
        self.close_timeout = float(config.setting("close_timeout", close_timeout, 300))
        self.overlap = str(config.setting("overlap", overlap, True)).lower() not in (
            "0",
            "false",
            "no",
        )
        self.allow_pickle = allow_pickle
        self.verify = verify
        if chunk_size <= 0 or chunk_size % 64:
            raise ConfigError(f"chunk_size must be a positive multiple of 64, got {chunk_size}")
        self.chunk_size = chunk_size
        self.skipped = 0  # snapshots dropped because every slot was held by a reader

        self._pair = SlotPair(self.shm_dir, self.job, self.rank)
        self._layout: Layout | None = None
        self._sealer = Sealer()
        self._prep: Future | None = None
        self._pending: Future | None = None  # a CUDA snapshot still being copied
        self._background = ThreadPoolExecutor(1, thread_name_prefix="flashckpt")
        self._copier: cuda.DeviceCopier | None = None
        self._pinned: dict[int, torch.Tensor] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._agent: AgentClient | None = None
        self._last_saved: int | None = None

    # ---- public API ------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot ``state`` as ``step``. Returns once the snapshot no longer depends on the
        caller (CPU tensors) or once the device copies are queued (CUDA, overlapped mode)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        with self._lock:
            self._check_open()
            tree, leaves = flatten(state)
            layout = self._layout = plan_layout(leaves, self.chunk_size, self._layout)
            manifest = Manifest(
                self.job, self.rank, step, tree, layout.entries, layout.data_len,
                chunk_size=self.chunk_size, created_at=time.time(), world_size=group.world_size(),
            )  # fmt: skip
            raw = manifest.to_json()
            self._connect_agent()
            need = required_capacity(layout.data_len, len(raw), layout.n_chunks)
            self._settle()
            self._pair.claim()
            if any(s is None or s.capacity < need for s in self._pair.slots):
                self._prepare(need + max(_MANIFEST_HEADROOM, len(raw)), leaves)
            slot = self._pair.acquire_for_write()
            if slot is None:
                self.skipped += 1
                log.warning(
                    "step %d not snapshotted: both slots of rank %d are being read", step, self.rank
                )
                return
            self._sealer.cancel(slot)
            try:
                slot.begin_write()
                pairs = [
                    (_dst(slot, e, lf), lf.tensor)
                    for e, lf in zip(layout.entries, leaves, strict=True)
                ]
                on_device = [(d, s) for d, s in pairs if s.is_cuda]
                for dst, src in pairs:
                    if not src.is_cuda:
                        copy_into(dst, src)
                if on_device:
                    done = self._device_copier().copy(
                        on_device, cuda.optimizer_owned(state.values())
                    )
                    if self.overlap:
                        self._pending = self._background.submit(
                            self._publish_after, done, slot, manifest, raw
                        )
                        return
                self._publish(slot, manifest, raw)
            except BaseException:
                self._abandon(slot)
                raise

    def restore(
        self, state: Mapping[str, Any], step: int | None = None, *, allow_pickle: bool | None = None
    ) -> int | None:
        """Load the newest intact snapshot (or ``step``) into ``state`` in place.

        Returns the step restored, or None if there is none (then ``step`` was not asked).
        Also readies this rank's slots in the background, so the first ``save()`` that follows
        costs no more than a steady one.
        """
        allow = self.allow_pickle if allow_pickle is None else allow_pickle
        with self._lock:
            self._check_open()
            tree, leaves = flatten(state)
            layout = self._layout = plan_layout(leaves, self.chunk_size, self._layout)
            raw = Manifest(self.job, self.rank, 0, tree, layout.entries, layout.data_len).to_json()
            capacity = required_capacity(layout.data_len, len(raw), layout.n_chunks) + max(
                _MANIFEST_HEADROOM, len(raw)
            )
            self._settle()
            self._pair.claim()
            self._pair.check_space(capacity)
            self._pair.open_existing()
            self._connect_agent()
            restored = self._restore(state, step, allow)
            self._prep = self._background.submit(self._prepare, capacity, leaves)
        if restored is None and step is not None:
            raise CheckpointNotFoundError(
                f"step {step} of job {self.job!r} rank {self.rank} is neither in shared memory "
                f"({self.shm_dir}) nor committed in {self.tiers or 'any tier'}; call restore() "
                "without a step for the newest one"
            )
        return restored

    def wait(
        self, step: int | None = None, tier: str | None = None, timeout: float | None = None
    ) -> int:
        """Block until a snapshot (the newest, or ``step`` or later) is in shared memory, or,
        with ``tier``, committed in that tier. Works from any process of the job that names
        the same job and rank. Returns the step; TimeoutError after ``timeout`` seconds."""
        if tier is not None:
            return self._wait_tier(tier, step, timeout)
        with self._lock:
            self._check_open()
            self._settle()

        def in_memory() -> set[int]:
            with self._lock:
                self._pair.open_existing()  # another process may create the slots meanwhile
                return {s.header().step for s in self._pair.ready()}

        return self._wait_until(in_memory, step, timeout, f"shared memory ({self.shm_dir})", 0.005)

    def close(self) -> None:
        """Finish the snapshot in flight, wait for the tiers to commit the last step, stop
        background work and free this rank's slots (or leave them to the agent if a tier is
        still behind after ``close_timeout`` seconds)."""
        with self._lock:
            if self._closed:
                return
            remove = True
            try:
                self._settle()
                remove = self._persisted_everywhere()
            finally:
                self._closed = True
                self._background.shutdown(wait=True)
                self._sealer.close()
                if self._copier is not None:
                    self._copier.close()
                for slot in self._pair.slots:
                    if slot is not None:
                        self._unpin(slot)
                if not remove:
                    (self._pair.dir / f"rank-{self.rank}.closed").write_text(str(self._last_saved))
                self._pair.close(remove=remove)
                if self._agent is not None:
                    self._agent.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise FlashCkptError("this Checkpointer is closed; create a new one")

    def _settle(self) -> None:
        """Wait for background preparation and the CUDA snapshot in flight; re-raise errors."""
        for attr in ("_prep", "_pending"):
            fut = getattr(self, attr)
            if fut is not None:
                setattr(self, attr, None)
                fut.result()

    def _prepare(self, capacity: int, leaves: list[Leaf]) -> None:
        for slot in self._pair.slots:
            if slot is not None and slot.capacity < capacity:
                self._unpin(slot)
        self._pair.prepare(capacity)
        if any(lf.tensor.is_cuda for lf in leaves):
            for slot in self._pair.slots:
                self._pin(slot)

    def _pin(self, slot: Slot | None) -> None:
        if slot is not None and id(slot) not in self._pinned and cuda.host_register(slot.buf):
            self._pinned[id(slot)] = slot.buf

    def _unpin(self, slot: Slot) -> None:
        buf = self._pinned.pop(id(slot), None)
        if buf is not None:
            cuda.host_unregister(buf)

    def _device_copier(self) -> cuda.DeviceCopier:
        if self._copier is None:
            self._copier = cuda.DeviceCopier(self.overlap)
        return self._copier

    def _publish(self, slot: Slot, manifest: Manifest, raw: bytes) -> None:
        slot.publish(manifest.step, manifest.data_len, raw, manifest.n_chunks)
        seq = slot.seq()
        slot.unlock()
        self._sealer.release()
        self._sealer.submit(slot, seq, manifest)
        self._last_saved = manifest.step
        if self._agent is not None:
            self._agent.notify(self.rank, manifest.step)

    def _publish_after(
        self, done: torch.cuda.Event, slot: Slot, manifest: Manifest, raw: bytes
    ) -> None:
        try:
            done.synchronize()
            self._publish(slot, manifest, raw)
        except BaseException:
            self._abandon(slot)
            raise

    def _abandon(self, slot: Slot) -> None:
        """A write that failed leaves the slot WRITING (never readable) and unlocked."""
        slot.unlock()
        self._sealer.release()

    def _restore(self, state: Mapping[str, Any], step: int | None, allow: bool) -> int | None:
        """Restore the newest step every rank can get; each rank from its fastest source."""
        sources = [MemorySource(self._pair, self.verify)]
        sources += [TierSource(url, self.job, self.rank, self.verify) for url in self.tiers]
        held = [src.steps() for src in sources]
        candidates = set().union(*held)
        while True:
            choice = group.newest_common(candidates) if step is None else step
            if choice is None:
                return None
            ok = False
            for src, steps in zip(sources, held, strict=True):
                if choice in steps and src.load(state, choice, allow):
                    log.info("restored step %d of rank %d from %s", choice, self.rank, src.name)
                    ok = True
                    break
            if group.all_true(ok):
                return choice
            if step is not None:
                return None
            candidates.discard(choice)

    def _connect_agent(self) -> None:
        if self.tiers and self._agent is None:
            self._agent = AgentClient.connect(self.job, self.run_dir, self.shm_dir)
            self._agent.register(
                self.rank, group.world_size(), self.tiers, self.shm_dir, config.local_world_size()
            )

    def _wait_tier(self, tier: str, step: int | None, timeout: float | None) -> int:
        from .storage_tiers import parse_spec

        same = [t for t in self.tiers if parse_spec(t).url == parse_spec(tier).url]
        if not same:
            raise ConfigError(f"tier {tier!r} is not one of this Checkpointer's tiers {self.tiers}")
        url = same[0]
        want = step if step is not None else self._last_saved
        source = TierSource(url, self.job, self.rank, verify=False)
        return self._wait_until(source.steps, want, timeout, url, 0.1)

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
        step = self._last_saved
        if not self._agent.notify(self.rank, step, final=True):  # through any throttle
            return False
        deadline = time.monotonic() + self.close_timeout
        while time.monotonic() < deadline:
            try:
                status = self._agent.tier_status()
            except Exception as exc:
                log.warning(
                    "the agent does not answer (%s); step %d stays in shared memory", exc, step
                )
                return False
            behind = [t for t in status if t.last_committed_step < step]
            if all(t.last_error for t in behind):  # every tier has it, or is failing
                for t in behind:
                    log.error("step %d is not persisted in %s: %s", step, t.url, t.last_error)
                return not behind
            time.sleep(0.05)
        log.warning("tiers still persisting step %d after %.0fs; the agent finishes and frees the slots",
                    step, self.close_timeout)  # fmt: skip
        return False


def _dst(slot: Slot, entry: Entry, leaf: Leaf) -> torch.Tensor:
    """The slot bytes of ``entry``, viewed with the leaf's dtype and shape."""
    start = HEADER_SIZE + entry.offset
    raw = slot.buf[start : start + entry.nbytes]
    return raw.view(leaf.tensor.dtype).view(leaf.tensor.shape)
