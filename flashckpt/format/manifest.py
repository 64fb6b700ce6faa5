"""Manifest format v1: what one rank saved at one step (see docs/FORMAT.md).

The manifest is JSON. It holds the state's structure (``tree``) with every tensor replaced by
a reference to an ``entries`` record (dtype, shape, byte range in the rank's data, per-chunk
crc32c, DTensor shard metadata). Non-tensor leaves that JSON can hold keep their Python types;
others are pickled into the data and need ``allow_pickle=True`` to come back.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from ..errors import ManifestError
from . import dtypes
from .kept import Kept
from .lineage import Lineage
from .sealed import SealedEntries, bare_entries

FORMAT_VERSION = 4
"""Version 2 added replicated entries (``replicated``, ``stored_at``, ``replicas``), version 3
the job's ``incarnation``, version 4 an entry's own replica group (``replicas`` on an entry:
a Megatron block replicated across its own ranks); older manifests are read as ones without
them (incarnation 0)."""
DEFAULT_CHUNK_SIZE = 4 * 2**20

if TYPE_CHECKING:
    import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return dtypes.torch_dtypes()[name]
    except KeyError:
        import torch

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
    replicated: bool = False  # the same bytes on every rank of the manifest's ``replicas``
    stored_at: int | None = None  # a stored copy: the bytes are in this rank's data instead
    replicas: tuple[int, int, int] | None = None  # its own replica group, else the manifest's

    def n_chunks(self, chunk_size: int) -> int:
        return -(-self.nbytes // chunk_size)

    def to_doc(self) -> dict:
        """This entry as the JSON object the manifest stores."""
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.replicated:
            del doc["replicated"]
        if self.stored_at is None:
            del doc["stored_at"]
        if self.replicas is None:
            del doc["replicas"]
        if self.shard is not None:
            doc["shard"] = {f.name: getattr(self.shard, f.name) for f in fields(self.shard)}
        return doc

    def but(self, **changes: Any) -> Entry:
        """A copy with ``changes``: ``dataclasses.replace`` without its per-field setattr
        calls (a manifest of thousands of entries makes thousands of these per restore)."""
        new = object.__new__(Entry)
        fields_ = self.__dict__.copy()
        fields_.update(changes)
        object.__setattr__(new, "__dict__", fields_)
        return new

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
    lineage: Lineage = Lineage()  # the branch of the job's history this step belongs to
    # range(start, stop, step) of the ranks whose ``replicated`` entries are identical
    replicas: tuple[int, int, int] | None = None
    # Which run of the job wrote it: every agreeing restore starts a newer one (see
    # ``tier_io.CommittedStep``), so writers of an earlier run are told apart.
    incarnation: int = 0

    @property
    def generation(self) -> int:
        return self.lineage.generation

    @functools.cached_property
    def n_chunks(self) -> int:
        return _chunk_count(bare_entries(self.entries), self.chunk_size)

    @functools.cached_property
    def tree_json(self) -> str:
        """The tree's JSON as a save writes it ("" if it cannot be: a NaN read back), for a
        restore to see whether the live state holds the same structure and scalars."""
        try:
            return json.dumps(self.tree, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return ""

    @property
    def sealed(self) -> bool:
        if isinstance(self.entries, SealedEntries):
            return True  # a checksum for every chunk (``with_checksums`` counted them)
        return all(e.checksums is not None for e in self.entries if e.nbytes)

    def with_checksums(self, flat: tuple[int, ...] | list[int]) -> Manifest:
        """Attach a flat per-chunk checksum list (in entry order) to the entries."""
        if len(flat) != self.n_chunks:
            raise ManifestError(f"{len(flat)} checksums for {self.n_chunks} chunks")
        bare = tuple(bare_entries(self.entries))
        out = replace(self, entries=SealedEntries(bare, tuple(flat), self.chunk_size))
        for same in ("tree_json", "n_chunks"):  # the same tree and chunks: not made again
            if same in self.__dict__:
                out.__dict__[same] = self.__dict__[same]
        return out

    # ---- JSON ------------------------------------------------------------------------
    def to_json(self, entries_json: str | None = None, tree_json: str | None = None) -> bytes:
        """The manifest as stored. ``entries_json``: ``encode_entries(self.entries)`` made
        earlier (a save of an unchanged layout reuses it: at thousands of tensors encoding
        the entries costs more than copying small ones); ``tree_json``: the tree's JSON, made
        by the caller (then it stands for ``tree``)."""
        return "".join(self._json_parts(entries_json, tree_json)).encode()

    def json_size(self, entries_json: str | None = None, tree_json: str | None = None) -> int:
        """``len(self.to_json(entries_json, tree_json))``, without making the text (a
        megabyte at thousands of tensors, where only its size is wanted)."""
        return sum(len(p) if p.isascii() else len(p.encode()) for p in self._json_parts(
            entries_json, tree_json))  # fmt: skip

    def _json_parts(self, entries_json: str | None, tree_json: str | None) -> tuple[str, ...]:
        # Built by hand: dataclasses.asdict deep-copies the tree and costs milliseconds per
        # save for a real model's state; the tree is JSON-ready already.
        if tree_json is None:  # the tree last, as its own text: a reader checks it once
            tree_json = self.tree_json or None
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        del doc["entries"]
        doc["lineage"] = self.lineage.to_doc()
        if self.replicas is None:
            del doc["replicas"]
        if tree_json is not None:
            del doc["tree"]
        head = json.dumps(doc, separators=(",", ":"), allow_nan=False)
        if entries_json is None:
            entries_json = encode_entries(self.entries)
        tree = () if tree_json is None else (',"tree":', tree_json)
        return (head[:-1], *tree, ',"entries":', entries_json, "}")

    @classmethod
    def from_json(
        cls, raw: bytes | str, source: str = "manifest", require_checksums: bool = False
    ) -> Manifest:
        """Parse and check a manifest read back from memory or a tier (see ``_Checker``).

        ``require_checksums``: refuse entries stored without checksums (a tier copy always
        has them; a shared-memory manifest gets them from the slot once sealed).
        """
        raw = raw.encode() if isinstance(raw, str) else raw
        split = _split_entries(raw)
        if split is not None:
            doc, entries_raw, tree_raw = split
            doc["entries"] = None  # there, as JSON of its own
            checker = _Checker(source)
            try:
                manifest = checker.manifest(doc, require_checksums, entries_raw, tree_raw)
            except _NotLast:
                pass  # another writer's order (an older flashckpt's): parsed whole
            else:
                if tree_raw is not None:  # the tree's own text: no need to encode it again
                    manifest.__dict__["tree_json"] = tree_raw.decode()
                return manifest
        return _Checker(source).manifest(load_json(raw, source, "manifest"), require_checksums)


def encode_entries(entries: tuple[Entry, ...]) -> str:
    """The JSON of a manifest's entries (see ``Manifest.to_json``)."""
    return json.dumps([e.to_doc() for e in entries], separators=(",", ":"), allow_nan=False)


# Entries checked before, by their JSON and what their checks depend on: the manifests of
# one layout's saves differ in their step, time and tree's scalars, never in their entries,
# and at thousands of entries checking them is most of a parse.
_ENTRIES: Kept[tuple[Entry, ...]] = Kept(2)
_ENTRIES_KEY = b',"entries":'
_TREE_KEY = b',"tree":'
_TREES: Kept[tuple[Entry, ...]] = Kept(2)  # trees checked, with the entries they name
# Trees decoded, by their JSON: the saves of a state whose scalars did not move write the
# same tree, and decoding one of thousands of tensors makes thousands of objects. A manifest's
# tree is read, never changed, so manifests of the same tree text share it.
_TREE_DOCS: Kept[Any] = Kept(2)


class _NotLast(Exception):
    """What follows the last "entries" key is not one JSON value: they were not last."""


def _split_entries(raw: bytes) -> tuple[dict, bytes, bytes | None] | None:
    """The manifest without its entries, their JSON, and the tree's JSON where it is the
    last field before them, for a manifest written as flashckpt writes it (the tree, then
    the entries, last); None otherwise (then it is parsed whole). Sound for any input: the
    rest must parse as a JSON object without an "entries" key, and what follows the key as
    one JSON value (else ``_NotLast``), so the whole is that object with the entries added,
    whatever bytes came; the same holds for the tree (``_split_tree``)."""
    at = raw.rfind(_ENTRIES_KEY)
    if at <= 1 or not raw.endswith(b"}"):
        return None
    head = raw[:at]
    split = _split_tree(head)
    if split is not None:
        return split[0], raw[at + len(_ENTRIES_KEY) : -1], split[1]
    try:
        doc = json.loads(head + b"}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or "entries" in doc or not _REQUIRED - {"entries"} <= doc.keys():
        return None  # the entries are not last (an older flashckpt wrote them before these)
    return doc, raw[at + len(_ENTRIES_KEY) : -1], None


def _split_tree(head: bytes) -> tuple[dict, bytes] | None:
    """``head`` (a manifest cut before its entries) parsed, with its tree's own JSON, where
    the tree is its last field; None otherwise. A JSON string holds no bare quote, so the
    first ``,"tree":`` is a key; the text before it must close as an object holding every
    other required field and no tree or entries (so the key is the object's own, not a
    nested one's), and the text after it must be one JSON value."""
    at = head.find(_TREE_KEY)
    if at <= 1:
        return None
    tree_raw = head[at + len(_TREE_KEY) :]
    try:
        doc = json.loads(head[:at] + b"}")
        tree = _TREE_DOCS.get(tree_raw)
        if tree is None:
            tree = json.loads(tree_raw)
            _TREE_DOCS.put(tree_raw, tree)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or "tree" in doc or "entries" in doc:
        return None
    if not _REQUIRED - {"entries", "tree"} <= doc.keys():
        return None
    doc["tree"] = tree
    return doc, tree_raw


def _checked_tree(checker: _Checker, tree: Any, entries: tuple[Entry, ...], raw: bytes) -> None:
    """``checker.tree``, once per tree text and entries: the saves of a state whose scalars
    did not move write the same tree, and at thousands of tensors its check costs more than
    copying them. What passed is kept; a failure is never kept."""
    key = (raw, id(entries))
    if _TREES.get(key) is entries:
        return
    checker.tree(tree, entries)
    _TREES.put(key, entries)  # held: its id stays its own while the key lives


_COUNTS: Kept[tuple[Any, int]] = Kept(2)  # chunks of the entries last counted, held


def _chunk_count(entries: Any, chunk_size: int) -> int:
    """The chunks of ``entries``, counted once per entries tuple (each save of a layout and
    each manifest parsed from its JSON share its tuple)."""
    key = (id(entries), chunk_size)
    held = _COUNTS.get(key)
    if held is not None and held[0] is entries:
        return held[1]
    n = sum(e.n_chunks(chunk_size) for e in entries)
    if isinstance(entries, tuple):  # never changes: its id stays its own while held
        _COUNTS.put(key, (entries, n))
    return n


def _checked_entries(checker: _Checker, raw: bytes, data_len: int, chunk_size: int,
                     require_checksums: bool) -> tuple[Entry, ...]:  # fmt: skip
    key = (raw, data_len, chunk_size, require_checksums)
    found = _ENTRIES.get(key)
    if found is not None:
        return found
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise _NotLast from None
    entries = checker.entries(doc, data_len, chunk_size, require_checksums)
    _ENTRIES.put(key, entries)
    return entries


def load_json(raw: bytes | str, source: str, what: str) -> Any:
    """``json.loads`` for bytes read back: every failure (bad UTF-8, bad JSON, nesting deep
    enough to exhaust the parser's recursion) becomes a ManifestError naming ``source``."""
    try:
        return json.loads(raw)
    except (ValueError, TypeError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        kind = "nested too deeply" if isinstance(exc, RecursionError) else f"not valid JSON ({exc})"
        raise ManifestError(
            f"{source}: the {what} is {kind}; the copy is corrupt, "
            "restore from another tier or an older step"
        ) from None


# ---- checking a manifest read back -------------------------------------------------
# Everything a restore relies on is checked here, once, so nothing past this point can fail
# on a corrupt manifest with anything but a flashckpt error: every field's type and range,
# every entry's bytes inside data_len and consistent with its dtype and shape, the chunk
# numbering the checksums follow, and a tree whose every node decodes and whose depth is
# bounded (the restore walks it recursively).

MAX_TREE_DEPTH = 100
"""Containers nested deeper than this are refused; real states nest a handful of levels."""
MAX_NDIM = 64
_MAX_DIM = 2**63  # torch sizes are int64
_KINDS = ("tensor", "ndarray", "pickle")
_REQUIRED = {"format_version", "job", "rank", "step", "tree", "entries", "data_len"}
_OPTIONAL = {
    "chunk_size", "checksum_algorithm", "created_at", "world_size", "meta", "lineage", "replicas",
    "incarnation",
}  # fmt: skip
_BLANK = Entry("", "tensor", "uint8", (), 0, 0, 0)  # every field is set by ``but``
_ENTRY_REQUIRED = {"path", "kind", "dtype", "shape", "offset", "nbytes", "first_chunk"}
_ENTRY_OPTIONAL = {"checksums", "shard", "device", "replicated", "stored_at", "replicas"}
_SHARD_FIELDS = {"global_shape", "global_offset", "placements", "mesh_shape"}
_CONTAINERS = ("dict", "list", "tuple", "stateful")
_SCALAR_TAGS = ("float", "dtype", "device", "bytes")


def _show(value: Any) -> str:
    """``value`` for an error message: short, and never an error itself."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # nested too deeply; an int past repr's digit limit
        return f"a {type(value).__name__} that cannot be shown"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int to isinstance, never to a manifest


class _Checker:
    """Turns a decoded manifest document into a Manifest, or raises ManifestError."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str) -> ManifestError:
        return ManifestError(
            f"{self.source}: {what}; the copy is corrupt, restore from another tier or an "
            "older step"
        )

    def int_(self, value: Any, what: str, low: int = 0) -> int:
        if not _is_int(value) or value < low:
            raise self.fail(f"{what} must be an integer >= {low}, found {_show(value)}")
        return value

    def fields(self, doc: Any, what: str, required: set[str], optional: set[str]) -> dict:
        if not isinstance(doc, dict):
            raise self.fail(f"{what} must be a JSON object, found {_show(doc)}")
        missing, unknown = required - doc.keys(), doc.keys() - required - optional
        if missing or unknown:
            raise self.fail(
                f"{what} must have the fields {sorted(required)} (optionally "
                f"{sorted(optional)}); missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return doc

    def manifest(self, doc: Any, require_checksums: bool, entries_raw: bytes | None = None,
                 tree_raw: bytes | None = None) -> Manifest:  # fmt: skip
        """``entries_raw``, ``tree_raw``: the JSON of the entries and of the tree, cut off
        ``doc`` (``_split_entries``)."""
        if not isinstance(doc, dict) or "format_version" not in doc:
            raise ManifestError(
                f"{self.source} has no format_version; it is not a flashckpt manifest"
            )
        version = doc["format_version"]
        if _is_int(version) and version > FORMAT_VERSION:
            raise ManifestError(
                f"{self.source} has format_version {version!r}, newer than the {FORMAT_VERSION} "
                "this flashckpt reads; upgrade flashckpt to restore it"
            )
        self.int_(version, "format_version", 1)
        self.fields(doc, "the manifest", _REQUIRED, _OPTIONAL)
        if not isinstance(doc["job"], str):
            raise self.fail(f"job must be a string, found {_show(doc['job'])}")
        data_len = self.int_(doc["data_len"], "data_len")
        chunk_size = self.int_(doc.get("chunk_size", DEFAULT_CHUNK_SIZE), "chunk_size", 1)
        algorithm = doc.get("checksum_algorithm", "crc32c")
        if algorithm != "crc32c":
            raise self.fail(f"checksum_algorithm must be 'crc32c', found {_show(algorithm)}")
        created_at = doc.get("created_at", 0.0)
        if type(created_at) not in (int, float):
            raise self.fail(f"created_at must be a number, found {_show(created_at)}")
        world_size = doc.get("world_size")
        if world_size is not None:
            self.int_(world_size, "world_size", 1)
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise self.fail(f"meta must be a JSON object, found {_show(meta)}")
        if entries_raw is None:
            entries = self.entries(doc["entries"], data_len, chunk_size, require_checksums)
        else:
            entries = _checked_entries(self, entries_raw, data_len, chunk_size, require_checksums)
        if tree_raw is None:
            self.tree(doc["tree"], entries)
        else:
            _checked_tree(self, doc["tree"], entries, tree_raw)
        return Manifest(
            job=doc["job"], rank=self.int_(doc["rank"], "rank"),
            step=self.int_(doc["step"], "step"), tree=doc["tree"], entries=entries,
            data_len=data_len, chunk_size=chunk_size, format_version=version,
            checksum_algorithm=algorithm, created_at=created_at, world_size=world_size, meta=meta,
            lineage=Lineage.from_doc(doc.get("lineage"), self.source),
            replicas=self.replicas(doc.get("replicas")),
            incarnation=self.int_(doc.get("incarnation", 0), "incarnation"),
        )  # fmt: skip

    def entries(self, raw_entries: Any, data_len: int, chunk_size: int,
                require_checksums: bool) -> tuple[Entry, ...]:  # fmt: skip
        if not isinstance(raw_entries, list):
            raise self.fail(f"entries must be a list, found {_show(raw_entries)}")
        entries: list[Entry] = []
        chunks = 0
        for i, raw in enumerate(raw_entries):
            entry = self.entry(raw, f"entry {i}", data_len, chunk_size, chunks, require_checksums)
            chunks += entry.n_chunks(chunk_size)
            entries.append(entry)
        return tuple(entries)

    def replicas(self, doc: Any, what: str = "") -> tuple[int, int, int] | None:
        if doc is None:
            return None
        if not (isinstance(doc, list) and len(doc) == 3 and all(_is_int(v) for v in doc)
                and 0 <= doc[0] < doc[1] <= 2**31 and doc[2] >= 1):  # fmt: skip
            where = f"{what}: " if what else ""
            raise self.fail(
                f"{where}replicas must be [start, stop, step] of a range of ranks, "
                f"found {_show(doc)}"
            )
        return (doc[0], doc[1], doc[2])

    def shape(self, value: Any, what: str, low: int = 0) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > MAX_NDIM:
            raise self.fail(
                f"{what} must be a list of at most {MAX_NDIM} sizes, found {_show(value)}"
            )
        for d in value:
            if not _is_int(d) or not low <= d < _MAX_DIM:
                raise self.fail(
                    f"{what} must hold integers in [{low}, 2**63), found {_show(value)}"
                )
        return tuple(value)

    def entry(self, doc: Any, what: str, data_len: int, chunk_size: int, first_chunk: int,
              require_checksums: bool) -> Entry:  # fmt: skip
        self.fields(doc, what, _ENTRY_REQUIRED, _ENTRY_OPTIONAL)
        path = doc["path"]
        if not isinstance(path, str):
            raise self.fail(f"{what}: path must be a string, found {_show(path)}")
        what = f"{what} ({path[:80]!r})"
        kind, name = doc["kind"], doc["dtype"]
        if kind not in _KINDS:
            raise self.fail(f"{what}: kind must be one of {list(_KINDS)}, found {_show(kind)}")
        itemsize = dtypes.itemsize(name) if isinstance(name, str) else None
        if itemsize is None or name in dtypes.UNSUPPORTED:
            raise self.fail(f"{what}: dtype {_show(name)} is not a dtype flashckpt stores")
        shape = self.shape(doc["shape"], f"{what}: shape")
        offset = self.int_(doc["offset"], f"{what}: offset")
        nbytes = self.int_(doc["nbytes"], f"{what}: nbytes")
        if kind == "pickle" and (name != "uint8" or len(shape) != 1):
            raise self.fail(f"{what}: a pickle entry is 1-d uint8, found {name} {list(shape)}")
        if kind == "ndarray" and name not in dtypes.NUMPY:
            raise self.fail(f"{what}: an ndarray entry cannot have dtype {name}")
        if math.prod(shape) * itemsize != nbytes:
            raise self.fail(
                f"{what}: nbytes must be numel x itemsize = {math.prod(shape)} x {itemsize} for "
                f"shape {list(shape)} {name}, found {nbytes}"
            )
        replicated, stored_at = doc.get("replicated", False), doc.get("stored_at")
        if type(replicated) is not bool:
            raise self.fail(f"{what}: replicated must be true or false, found {_show(replicated)}")
        if stored_at is not None:  # its bytes are in another rank's data: none here
            if not (_is_int(stored_at) and 0 <= stored_at < 2**31) or not replicated or offset:
                raise self.fail(
                    f"{what}: stored_at must name a rank for a replicated entry at offset 0, "
                    f"found {_show(stored_at)} (replicated {replicated}, offset {offset})"
                )
        elif offset + nbytes > data_len or offset % itemsize:
            raise self.fail(
                f"{what}: bytes {offset}-{offset + nbytes} must lie inside the {data_len} bytes "
                f"of data, starting at a multiple of {itemsize}"
            )
        if doc["first_chunk"] != first_chunk or not _is_int(doc["first_chunk"]):
            raise self.fail(
                f"{what}: first_chunk must be {first_chunk} (the chunks of the entries before "
                f"it), found {_show(doc['first_chunk'])}"
            )
        n = -(-nbytes // chunk_size)
        sums = doc.get("checksums")
        if sums is None:
            if require_checksums and n:
                raise self.fail(
                    f"{what}: checksums are null; a stored copy must carry one crc32c per chunk"
                )
        elif (
            not isinstance(sums, list) or len(sums) != n
            or not all(_is_int(c) and 0 <= c < 2**32 for c in sums)
        ):  # fmt: skip
            raise self.fail(
                f"{what}: checksums must be a list of {n} crc32c values (one per chunk of "
                f"{chunk_size} bytes), found {_show(sums)}"
            )
        device = doc.get("device", "cpu")
        if not isinstance(device, str):
            raise self.fail(f"{what}: device must be a string, found {_show(device)}")
        group = doc.get("replicas")
        if group is not None:
            group = self.replicas(group, what)
            if not replicated:
                raise self.fail(f"{what}: replicas names a replica group, but replicated is false")
        return _BLANK.but(
            path=path, kind=kind, dtype=name, shape=shape, offset=offset, nbytes=nbytes,
            first_chunk=first_chunk, checksums=None if sums is None else tuple(sums),
            shard=self.shard(doc.get("shard"), what, len(shape)), device=device,
            replicated=replicated, stored_at=stored_at, replicas=group,
        )  # fmt: skip

    def shard(self, doc: Any, what: str, ndim: int) -> ShardInfo | None:
        if doc is None:
            return None
        what = f"{what}: shard"
        self.fields(doc, what, _SHARD_FIELDS, set())
        placements = doc["placements"]
        if not isinstance(placements, list) or not all(isinstance(p, str) for p in placements):
            raise self.fail(
                f"{what}: placements must be a list of strings, found {_show(placements)}"
            )
        info = ShardInfo(
            global_shape=self.shape(doc["global_shape"], f"{what}: global_shape"),
            global_offset=self.shape(doc["global_offset"], f"{what}: global_offset"),
            placements=tuple(placements),
            mesh_shape=self.shape(doc["mesh_shape"], f"{what}: mesh_shape", 1),
        )
        if not len(info.global_shape) == len(info.global_offset) == ndim:
            raise self.fail(
                f"{what}: global_shape and global_offset must have the entry's {ndim} dims, "
                f"found {list(info.global_shape)} and {list(info.global_offset)}"
            )
        return info

    def tree(self, root: Any, entries: list[Entry]) -> None:
        """Check every node, iteratively, so a deep tree is an error, not a RecursionError."""
        if not (isinstance(root, dict) and root.get("t") == "dict"):
            raise self.fail(f"tree must be a dict node, found {_show(root)}")
        stack: list[tuple[Any, int, bool]] = [(root, 0, False)]  # node, depth, is a dict key
        while stack:
            node, depth, is_key = stack.pop()
            if node is None or isinstance(node, (bool, int, float, str)):
                continue
            tag = node.get("t") if isinstance(node, dict) else None
            if tag in _CONTAINERS and depth >= MAX_TREE_DEPTH:
                raise self.fail(f"tree nests containers deeper than {MAX_TREE_DEPTH} levels")
            if is_key and tag not in ("tuple", *_SCALAR_TAGS):
                raise self.fail(f"tree: {_show(node)} cannot be a dict key")
            if tag in ("list", "tuple", "dict"):
                items = node.get("items")
                if not isinstance(items, list):
                    raise self.fail(
                        f"tree: a {tag} node needs a list of items, found {_show(node)}"
                    )
                if tag == "dict":
                    for item in items:
                        if not (isinstance(item, list) and len(item) == 2):
                            raise self.fail(
                                f"tree: dict items are [key, value], found {_show(item)}"
                            )
                        stack += [(item[0], depth + 1, True), (item[1], depth + 1, False)]
                else:
                    stack += [(item, depth + 1, is_key) for item in items]
            elif tag == "stateful" and "v" in node:
                stack.append((node["v"], depth + 1, False))
            elif tag in _KINDS:
                i = node.get("i")
                if not (_is_int(i) and 0 <= i < len(entries) and entries[i].kind == tag):
                    raise self.fail(
                        f"tree: {_show(node)} must name one of the {len(entries)} entries, "
                        f"of kind {tag}"
                    )
            elif tag in _SCALAR_TAGS:
                self.scalar(node)
            else:
                raise self.fail(f"tree: {_show(node)} is not a tree node")

    def scalar(self, node: dict) -> None:
        tag, value = node.get("t"), node.get("v")
        if tag in ("dtype", "device") and "torch" not in sys.modules:
            # A reader without torch (the node agent) checks the name's form; a restore,
            # which has torch, decodes it.
            if tag == "dtype":
                known = isinstance(value, str) and dtypes.itemsize(value) is not None
            else:
                known = isinstance(value, str) and 0 < len(value) <= 64
            if not known:
                raise self.fail(f"tree: {_show(node)} does not decode (no such {tag})")
            return
        try:
            decode_scalar(node)
        except (ManifestError, KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise self.fail(f"tree: {_show(node)} does not decode ({exc})") from None


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
    torch = sys.modules.get("torch")  # without torch loaded, no value is one of its types
    if torch is not None and isinstance(value, torch.dtype):
        return {"t": "dtype", "v": dtype_name(value)}
    if torch is not None and isinstance(value, torch.device):
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
        import torch

        return torch.device(node["v"])
    if tag == "bytes":
        return bytes.fromhex(node["v"])
    raise ManifestError(f"unknown tree node tag {tag!r}")
