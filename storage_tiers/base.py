"""The one interface every storage tier implements.

A tier stores objects under string keys (``"<job>/step-<N>/rank-<R>/data"``). ``put`` is
atomic: a reader sees the whole object or none of it (write-then-rename on POSIX tiers, a
completed multipart upload on S3), so a crash mid-write never leaves a partial object behind
a committed name. Higher layers build commit on that: a rank's manifest is put after its data,
and a step's commit marker after every rank's manifest.

``put(..., exclusive=True)`` only creates: where an object is under the key already it raises
ObjectExistsError and leaves that object as it is. Snapshots are written that way, so what one
writer committed is never rewritten in place by another (see ``format/fence.py``).
"""

from __future__ import annotations

import abc
import enum
import logging
import re
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)


class Scope(enum.Enum):
    """Who can read a tier: only its own node (local NVMe) or every node (PFS, S3)."""

    NODE = "node"
    SHARED = "shared"


@dataclass(frozen=True)
class RetryPolicy:
    """How a tier retries transient errors: attempts in all, exponential backoff with a cap."""

    attempts: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)


@dataclass(frozen=True)
class TierSpec:
    """A parsed tier URL: ``scheme://location?scope=node&keep_last=3&every_steps=10...``."""

    url: str
    scheme: str
    location: str
    scope: Scope
    options: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Leftover:
    """What a writer that died mid-``put`` left: a temporary file, an unfinished upload."""

    key: str  # the object it was being written for
    name: str  # the tier's own name for it (a temporary's path, an upload's id)
    size: int | None  # the bytes it holds, where the tier can tell
    modified: float  # when it was last written to (seconds since the epoch)


def _bytes(leftovers: list[Leftover]) -> str:
    known = [t.size for t in leftovers if t.size is not None]
    return f"{sum(known)} bytes" if len(known) == len(leftovers) else "size unknown"


class Tier(abc.ABC):
    """Async object store over one root. Keys use ``/`` and never start with it."""

    spec: TierSpec
    optional: ClassVar[bool] = False
    """Whether a restore goes on without this tier when it cannot be listed: True for a tier
    that can only add a newer copy of what the required tiers and memory hold (another
    node's memory); a required tier that cannot be listed stops the restore."""

    @property
    def scope(self) -> Scope:
        return self.spec.scope

    exclusive_atomic: ClassVar[bool] = True
    """Whether ``put(exclusive=True)`` is one atomic create-if-absent in the store (a link on
    a directory tier, a conditional write on S3); False where it can only look first, so two
    writers racing for one key may both think they created it (documented per tier)."""

    @abc.abstractmethod
    async def put(
        self, key: str, chunks: AsyncIterator[memoryview] | list[memoryview], size: int,
        exclusive: bool = False,
    ) -> None:  # fmt: skip
        """Store ``size`` bytes given as consecutive chunks under ``key``, atomically. With
        ``exclusive`` the put only creates: an object already under ``key`` is left as it is
        and ObjectExistsError raised, so a committed object is never rewritten in place."""

    @abc.abstractmethod
    async def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key``; CheckpointNotFoundError if it does not exist."""

    @abc.abstractmethod
    async def get_into(self, key: str, out: memoryview, start: int = 0) -> None:
        """Fill ``out`` with ``len(out)`` bytes of ``key`` from ``start`` (restore's fast path)."""

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Every committed key under ``prefix`` (recursive), sorted. Temporaries are hidden."""

    @abc.abstractmethod
    async def delete(self, prefix: str) -> None:
        """Remove ``prefix`` and everything under it; missing keys are not an error."""

    @abc.abstractmethod
    async def leftovers(self, prefix: str) -> list[Leftover]:
        """What writers that died mid-``put`` left under ``prefix``: temporary files,
        unfinished uploads; never a committed object."""

    @abc.abstractmethod
    async def remove_leftover(self, leftover: Leftover) -> None:
        """Remove one leftover, and the directories it leaves empty below the job's."""

    async def clean_temporaries(
        self, prefix: str, older_than_s: float, mine: Callable[[str], bool] | None = None,
        dry_run: bool = False,
    ) -> list[Leftover]:  # fmt: skip
        """Remove the leftovers under ``prefix`` older than ``older_than_s`` seconds (a live
        writer elsewhere may be filling younger ones), and at any age those whose key
        ``mine(key)`` claims for this writer; ``dry_run`` only lists them. Returns them."""
        found = await self.leftovers(prefix)
        claimed = [t for t in found if mine is not None and mine(t.key)]
        # Ages run on the store's clock, as its leftovers are dated: a node whose clock runs
        # ahead would take other nodes' live uploads for dead ones.
        now = await self.store_now() if len(claimed) < len(found) else 0.0
        doomed = [t for t in found if t in claimed or t.modified <= now - older_than_s]
        if not dry_run:
            for t in doomed:
                await self.remove_leftover(t)
        if doomed and not dry_run:
            log.info("%s: removed %d leftovers of crashed writes under %r (%s)", self.spec.url,
                     len(doomed), prefix, _bytes(doomed))  # fmt: skip
        return doomed

    async def store_now(self) -> float:
        """The time now on the clock the store dates its objects and leftovers by (seconds
        since the epoch), which is not this node's: nodes' clocks differ from it and from each
        other. The default, for a tier that leaves nothing over: this node's clock."""
        return time.time()

    async def check_location(self, create: bool = False) -> None:
        """Raise an error that says what to do when the tier's root cannot be used: missing (a
        directory; unless ``create``, for a tier about to be written), not a directory, or a
        store that cannot be reached. A store whose prefixes need no creating (an object
        store) passes with nothing under it: it is empty. The default checks nothing."""
        return None

    def describe(self) -> str | None:
        """What to call this tier in events and logs where its URL says too little (a peer's
        memory names the node); None: its URL, credentials hidden."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads."""


def size_error(key: str, size: int, got: int, more: bool = False) -> ValueError:
    """What ``put`` raises when the chunks do not hold the ``size`` bytes it was told."""
    held = f"more than {size}" if more else str(got)
    return ValueError(
        f"put {key!r}: expected {size} bytes but the chunks held {held}; nothing was stored "
        "(pass the real size)"
    )


TEMP_PREFIX = ".tmp-"
"""Names starting with this are a tier's in-flight temporaries: never listed, never a key."""

TEMP_GRACE_S = 3600.0
"""How old another writer's temporary must be before it counts as a crashed one's: a live
writer on another node may still be uploading into a shared tier."""

MIN_TEMP_GRACE_S = 60.0
"""The least ``temp_grace_s`` a tier takes: a live upload may pause this long between two
writes (a slow part, a retry's backoff), and a store's clock is read to the second."""

_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(.+)-[0-9a-f]+")


def temp_name(final: str) -> str:
    """A fresh temporary's name for the object named ``final`` (unique per writer)."""
    return f"{TEMP_PREFIX}{final}-{uuid.uuid4().hex[:12]}"


def temp_target(name: str) -> str | None:
    """The name of the object the temporary ``name`` was being written for; None if ``name``
    is not a temporary."""
    if not name.startswith(TEMP_PREFIX):
        return None
    match = _TEMP_NAME.fullmatch(name)
    return match.group(1) if match else name[len(TEMP_PREFIX) :]


def check_key(key: str, *, prefix: bool = False) -> str:
    """Refuse keys that could escape a tier's root; returns ``key`` without a trailing ``/``.

    A ``prefix`` may be empty (the whole tier) and may end with ``/``; a key may not.
    """
    if not isinstance(key, str):
        raise ConfigError(f"a tier key must be a str like 'job/step-1/data', got {key!r}")
    body = key[:-1] if prefix and key.endswith("/") else key
    if body == "" and prefix:
        return ""
    parts = body.split("/")
    if (
        body.startswith("/")
        or "\0" in body
        or any(p in ("", ".", "..") or p.startswith(TEMP_PREFIX) for p in parts)
    ):
        raise ConfigError(
            f"tier key {key!r} is not allowed: expected a relative path like 'job/step-1/data' "
            f"with no leading '/', no '.' or '..', no empty components and no component "
            f"starting with {TEMP_PREFIX!r}; fix the key"
        )
    return body


def check_delete_prefix(prefix: str, url: str) -> str:
    """A prefix ``delete`` may remove: valid and not empty (never the whole tier at once)."""
    body = check_key(prefix, prefix=True)
    if not body:
        raise ConfigError(
            f"tier {url}: delete needs a non-empty prefix like 'job/step-1', got {prefix!r}; "
            "refusing to delete the whole tier (delete each job's prefix instead)"
        )
    return body


async def iter_chunks(
    chunks: AsyncIterable[memoryview] | Iterable[memoryview],
) -> AsyncIterator[memoryview]:
    """Yield ``put``'s chunks as flat byte views, whether given as a list or an async iterator."""
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            yield _flat(chunk)
    else:
        for chunk in chunks:
            yield _flat(chunk)


def _flat(chunk: memoryview | bytes | bytearray) -> memoryview:
    view = memoryview(chunk)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
