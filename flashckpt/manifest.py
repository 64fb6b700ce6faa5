"""Manifest format v1: what one rank saved at one step (see docs/FORMAT.md).

The manifest is JSON. It holds the state's structure (``tree``) with every tensor replaced by
a reference to an ``entries`` record (dtype, shape, byte range in the rank's data, per-chunk
crc32c, DTensor shard metadata). Non-tensor leaves that JSON can hold keep their Python types;
others are pickled into the data and need ``allow_pickle=True`` to come back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from .errors import ManifestError

FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 4 * 2**20

# Every dtype torch can hand us, by its short name ("float32", "float8_e4m3fn", ...).
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_UNSUPPORTED_DTYPES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestError(
            f"dtype {name!r} is not known to this torch {torch.__version__}; "
            "restore with the torch version that saved it"
        ) from None


@dataclass(frozen=True)
class ShardInfo:
    """Where a DTensor's local shard sits in the global tensor."""

    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]


@dataclass(frozen=True)
class Entry:
    """One stored array: a tensor, a numpy array, or a pickled object's bytes."""

    path: str
    kind: str  # "tensor" | "ndarray" | "pickle"
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    first_chunk: int
    checksums: tuple[int, ...] | None = None
    shard: ShardInfo | None = None
    device: str = "cpu"

    def n_chunks(self, chunk_size: int) -> int:
        return -(-self.nbytes // chunk_size)

    def to_doc(self) -> dict:
        """This entry as the JSON object the manifest stores."""
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.shard is not None:
            doc["shard"] = {f.name: getattr(self.shard, f.name) for f in fields(self.shard)}
        return doc

    def chunk_ranges(self, chunk_size: int) -> list[tuple[int, int]]:
        """(start, end) byte ranges of this entry's chunks, in data coordinates."""
        return [
            (self.offset + i, self.offset + min(i + chunk_size, self.nbytes))
            for i in range(0, self.nbytes, chunk_size)
        ]


@dataclass(frozen=True)
class Manifest:
    job: str
    rank: int
    step: int
    tree: Any
    entries: tuple[Entry, ...]
    data_len: int
    chunk_size: int = DEFAULT_CHUNK_SIZE
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = "crc32c"
    created_at: float = 0.0
    world_size: int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def n_chunks(self) -> int:
        return sum(e.n_chunks(self.chunk_size) for e in self.entries)

    @property
    def sealed(self) -> bool:
        return all(e.checksums is not None for e in self.entries if e.nbytes)

    def with_checksums(self, flat: tuple[int, ...] | list[int]) -> Manifest:
        """Attach a flat per-chunk checksum list (in entry order) to the entries."""
        if len(flat) != self.n_chunks:
            raise ManifestError(f"{len(flat)} checksums for {self.n_chunks} chunks")
        entries = tuple(
            replace(
                e,
                checksums=tuple(flat[e.first_chunk : e.first_chunk + e.n_chunks(self.chunk_size)]),
            )
            for e in self.entries
        )
        return replace(self, entries=entries)

    # ---- JSON ------------------------------------------------------------------------
    def to_json(self) -> bytes:
        # Built by hand: dataclasses.asdict deep-copies the tree and costs milliseconds per
        # save for a real model's state; the tree is JSON-ready already.
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["entries"] = [e.to_doc() for e in self.entries]
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes | str, source: str = "manifest") -> Manifest:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{source} is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or "format_version" not in doc:
            raise ManifestError(f"{source} has no format_version; it is not a flashckpt manifest")
        version = doc["format_version"]
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ManifestError(
                f"{source} has format_version {version!r}, newer than the {FORMAT_VERSION} this "
                "flashckpt reads; upgrade flashckpt to restore it"
            )
        try:
            entries = tuple(
                Entry(
                    **{
                        **e,
                        "shape": tuple(e["shape"]),
                        "checksums": tuple(e["checksums"])
                        if e.get("checksums") is not None
                        else None,
                        "shard": _shard(e.get("shard")),
                    }
                )
                for e in doc.pop("entries")
            )
            return cls(**doc, entries=entries)
        except (TypeError, KeyError) as exc:
            raise ManifestError(f"{source} is malformed: {exc}") from exc


def _shard(doc: dict | None) -> ShardInfo | None:
    if doc is None:
        return None
    return ShardInfo(**{k: tuple(v) for k, v in doc.items()})


# ---- tree encoding for non-tensor leaves --------------------------------------------
# JSON-native scalars (str, int, finite float, bool, None) are stored as themselves; every
# other node is an object tagged with "t", so a raw JSON object never appears as a value.


def encode_scalar(value: Any) -> Any:
    """Encode a leaf JSON can hold with its type kept, or raise TypeError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # IntEnum and friends decay to int; subclasses are not kept
    if isinstance(value, float):
        return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"t": "device", "v": str(value)}
    if isinstance(value, bytes):
        return {"t": "bytes", "v": value.hex()}
    raise TypeError(type(value).__name__)


def decode_scalar(node: dict) -> Any:
    tag = node["t"]
    if tag == "float":
        return float(node["v"])
    if tag == "dtype":
        return dtype_from_name(node["v"])
    if tag == "device":
        return torch.device(node["v"])
    if tag == "bytes":
        return bytes.fromhex(node["v"])
    raise ManifestError(f"unknown tree node tag {tag!r}")
