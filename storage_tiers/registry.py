"""Tier URLs to tier objects: a registry keyed by URL scheme, imported lazily.

``file:///mnt/nvme/ckpt?keep_last=3`` -> LocalTier, ``pfs:///lustre/ckpt`` -> ParallelFsTier,
``s3://bucket/prefix`` -> S3Tier. Other packages add schemes through the ``flashckpt.tiers``
entry-point group (``scheme = "package.module:TierClass"``) or :func:`register_tier`. Any
other scheme fsspec knows (``gs://``, ``az://``, ``hdfs://``...) is an FsspecTier, and so is
``fsspec+<protocol>://`` for every protocol.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qsl

from flashckpt.errors import ConfigError

from .base import MIN_TEMP_GRACE_S, TEMP_GRACE_S, Scope, Tier, TierSpec

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "flashckpt.tiers"

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", re.DOTALL)
T = TypeVar("T")


@dataclass(frozen=True)
class TierEntry:
    """Where a scheme's tier class lives and what it needs."""

    target: str  # "package.module:Class", imported only when the scheme is opened
    default_scope: Scope
    install_hint: str | None = None  # shown when the import fails
    path_like: bool = False  # location is a filesystem path: resolved to an absolute one
    options: frozenset[str] | None = frozenset()  # its own query options; None: any
    raw_location: bool = False  # the location as written (its leading "/" kept)
    requires: tuple[str, ...] = ()  # packages it imports (checked before it is opened)


# Options of the directory tiers: the octal modes of the files and directories they create,
# as (default, bits the owner must keep, an example). Others never get write access.
MODE_OPTIONS: dict[str, tuple[int, int, str]] = {
    "mode": (0o600, 0o600, "0640"), "dir_mode": (0o700, 0o700, "0750"),
}  # fmt: skip
# ``create=0``: the tier's root directory must exist (a mount point's directory), never made.
DIRECTORY_OPTIONS = frozenset([*MODE_OPTIONS, "create"])

_REGISTRY: dict[str, TierEntry] = {
    "file": TierEntry(
        "flashckpt.storage_tiers.local:LocalTier",
        Scope.NODE,
        path_like=True,
        options=DIRECTORY_OPTIONS,
    ),
    "pfs": TierEntry(
        "flashckpt.storage_tiers.parallel_fs:ParallelFsTier",
        Scope.SHARED,
        path_like=True,
        options=DIRECTORY_OPTIONS,
    ),
    "peer": TierEntry(
        "flashckpt.storage_tiers.peer:PeerTier",
        Scope.NODE,
        options=frozenset(["hop"]),
        raw_location=True,
    ),
    "s3": TierEntry(
        "flashckpt.storage_tiers.s3:S3Tier",
        Scope.SHARED,
        install_hint="pip install 'flashckpt[s3]'",
        requires=("s3fs",),
        options=frozenset(
            [
                "endpoint_url",
                "key",
                "secret",
                "token",
                "anon",
                "region",
                "part_size",
                "max_concurrency",
                "retry_attempts",
                "retry_backoff_s",
                "retry_max_backoff_s",
                "conditional_writes",
            ]
        ),
    ),
}

# Options every tier takes: the agent's policy for it (retention, throttle, rank fan-out), each
# a number >= 0 (0 or absent: off, or the default). duty: the share of the time the agent may
# spend storing into the tier (after a round of t seconds it waits t x (1/duty - 1)). temp_grace_s: how old another node's
# temporaries must be before they count as a crashed upload's (absent: TEMP_GRACE_S).
# outage_retry_s: how long at most a failing tier waits before it is tried again (absent: 10).
POLICY_OPTIONS: dict[str, Callable[[str], float]] = {
    "keep_last": int, "keep_every": int, "every_steps": int, "every_seconds": float,
    "duty": float,
    "rank_concurrency": int, "retire_abandoned": int, "temp_grace_s": float,
    "outage_retry_s": float,
}  # fmt: skip

SECRET_OPTIONS = frozenset(["key", "secret", "token"])
"""Query options whose values are credentials: :func:`redact` hides them, with any option
whose name says it holds one (fsspec filesystems take ``account_key``, ``sas_token``,
``password``, ``client_secret``, ``connection_string``...)."""
_SECRET_NAME = re.compile(
    r"secret|token|passw|credential|account_key|access_key|api_key|private_key|sas|"
    r"connection_string|signature"
)

FSSPEC = TierEntry(
    "flashckpt.storage_tiers.fsspec_tier:FsspecTier", Scope.SHARED, options=None,
    raw_location=True,
)  # fmt: skip
"""Any fsspec protocol without a tier of its own, and every ``fsspec+<protocol>://``."""


def is_secret(name: str) -> bool:
    """Whether the tier option ``name`` holds a credential."""
    low = name.strip().lower()
    return low in SECRET_OPTIONS or bool(_SECRET_NAME.search(low))


_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def register_tier(
    scheme: str,
    target: str,
    default_scope: Scope = Scope.NODE,
    install_hint: str | None = None,
    path_like: bool = False,
) -> None:
    """Add or replace a scheme at run time (entry points do the same for installed packages)."""
    _REGISTRY[scheme.lower()] = TierEntry(target, default_scope, install_hint, path_like)


def known_schemes() -> list[str]:
    """Built-in, registered and entry-point schemes, sorted."""
    return sorted(
        set(_REGISTRY) | {ep.name.lower() for ep in entry_points(group=ENTRY_POINT_GROUP)}
    )


def _entry(scheme: str) -> TierEntry:
    if scheme in _REGISTRY:
        return _REGISTRY[scheme]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() == scheme:
            # A third-party class may declare ``default_scope``; otherwise assume node-only,
            # so nothing counts on other nodes reading a tier they may not see.
            cls = _load(scheme, TierEntry(ep.value, Scope.NODE))
            scope = getattr(cls, "default_scope", Scope.NODE)
            own = getattr(cls, "options", None)  # a third-party tier may list its options
            return TierEntry(
                ep.value, Scope(scope), getattr(cls, "install_hint", None),
                options=None if own is None else frozenset(own),
            )  # fmt: skip
    if scheme.startswith("fsspec+") or _fsspec_knows(scheme):
        return FSSPEC
    raise ConfigError(
        f"unknown tier scheme {scheme!r}: expected one of {', '.join(known_schemes())} "
        "(e.g. file:///mnt/nvme/ckpt, s3://bucket/prefix); fix the URL or install the package "
        f"that provides {scheme!r} tiers (entry-point group {ENTRY_POINT_GROUP!r})"
    )


def _load(scheme: str, entry: TierEntry) -> type[Tier]:
    module_name, _, attr = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = entry.install_hint or f"install the package that provides {module_name}"
        raise ImportError(
            f"the {scheme}:// tier needs {module_name}, which cannot be imported ({exc}); "
            f"run: {hint}"
        ) from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(
            f"tier scheme {scheme!r} points at {entry.target!r}, expected a Tier subclass "
            f"there but found {cls!r}; fix the registration"
        )
    return cls


def redact(url: str) -> str:
    """``url`` fit to print: the values of credential options (``key=``, ``secret=``,
    ``token=``) and a ``user:password@`` before the location shown as ``***``. Never raises."""
    head, sep, query = str(url).partition("?")
    head = _USERINFO.sub(r"\1***@", head, count=1)
    if sep:
        parts = []
        for part in query.split("&"):
            name, eq, _ = part.partition("=")
            parts.append(f"{name}=***" if eq and is_secret(name) else part)
        query = "&".join(parts)
    return head + sep + query


def _option_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Scope):
        return value.value
    return str(value)


def _scope(text: str, default: Scope) -> Scope:
    if text == "":
        return default
    try:
        return Scope(text.strip().lower())
    except ValueError:
        raise ConfigError(
            f"tier option scope={text!r} is not valid: expected 'node' or 'shared'; fix the URL "
            "query or the scope argument"
        ) from None


def _split(url: str) -> tuple[str, str, str]:
    """``(scheme, location, query)``; a URL without a scheme is a ``file`` path."""
    match = _SCHEME.match(url)
    scheme, rest = (match.group(1).lower(), match.group(2)) if match else ("file", url)
    location, _, query = rest.partition("?")
    if match and location.startswith("//"):  # a plain path keeps its leading "//"
        location = location[2:]
    return scheme, location, query


_NOT_A_HOST = ("", "localhost", ".", "..", "~")
"""What may stand between ``file://`` and the next ``/``: nothing (``file:///dir``), this
machine, or the start of a path meant as one (``file://./ckpt``, ``file://~/ckpt``)."""


def _resolve_path(scheme: str, location: str, url: str) -> str:
    if url.strip().lower().startswith(f"{scheme}://"):
        host, slash, path = location.partition("/")
        if host.lower() not in _NOT_A_HOST:
            raise ConfigError(
                f"tier URL {redact(url)!r} names the host {host!r}, but {scheme}:// tiers are "
                f"directories of this machine; did you mean {scheme}:///{location}? (three "
                f"slashes: {scheme}:///abs/path; a relative one: {scheme}://./rel/path)"
            )
        if host.lower() == "localhost":
            location = slash + path
    if location == "":
        raise ConfigError(
            f"tier URL {redact(url)!r} names no directory: expected e.g. file:///mnt/ckpt"
        )
    return os.path.abspath(os.path.expanduser(location))


def parse_spec(url: str, **options: object) -> TierSpec:
    """Parse a tier URL; ``options`` override its query string (explicit arguments win)."""
    if not isinstance(url, str) or not url.strip():
        shown = redact(url) if isinstance(url, str) else url
        raise ConfigError(
            f"a tier URL must be a non-empty str like file:///mnt/ckpt, got {shown!r}"
        )
    scheme, location, query = _split(url.strip())
    entry = _entry(scheme)
    try:
        merged = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise ConfigError(
            f"tier URL {redact(url)!r} has a malformed query: expected key=value pairs joined "
            "by '&'"
        ) from None
    merged.update({k: _option_text(v) for k, v in options.items() if v is not None})
    scope = _scope(merged.pop("scope", ""), entry.default_scope)
    if entry.path_like:
        location = _resolve_path(scheme, location, url)
    elif entry.raw_location:
        location = location.rstrip("/") or location
        if location.strip("/") == "":
            raise ConfigError(
                f"tier URL {redact(url)!r} has no location: expected {scheme}://<where>, e.g. "
                "gs://bucket/prefix"
            )
    else:
        location = location.strip("/")
        if not location:
            raise ConfigError(
                f"tier URL {redact(url)!r} has no location: expected {scheme}://<where>, e.g. "
                "s3://bucket/prefix"
            )
    canonical = redact(f"{scheme}://{location}")  # printed everywhere: no credentials
    spec = TierSpec(url=canonical, scheme=scheme, location=location, scope=scope, options=merged)
    _check_options(spec, entry)
    return spec


def _check_options(spec: TierSpec, entry: TierEntry) -> None:
    """A misspelt option fails here, when the tier is named, rather than being ignored."""
    if entry.options is not None:
        known = {"scope", *POLICY_OPTIONS, *entry.options}
        unknown = sorted(set(spec.options) - known)
        if unknown:
            raise ConfigError(
                f"tier {spec.url}: unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(unknown)}; {spec.scheme}:// tiers take {', '.join(sorted(known))}"
            )
    for name, convert in POLICY_OPTIONS.items():
        if option(spec, name, 0, convert) < 0:
            raise ConfigError(f"tier {spec.url}: option {name}={spec.options[name]!r} must be >= 0")
    if option(spec, "duty", 0.0, float) > 1:
        raise ConfigError(f"tier {spec.url}: duty={spec.options['duty']!r} is a share of the "
                          "time: give a number in (0, 1]")  # fmt: skip
    floor = MIN_TEMP_GRACE_S
    if option(spec, "temp_grace_s", TEMP_GRACE_S, float) < floor:
        raise ConfigError(
            f"tier {spec.url}: temp_grace_s={spec.options['temp_grace_s']} is below the floor "
            f"of {floor:.0f} seconds: a younger leftover may be an upload still being written "
            "(by this node's next round or by another node) paused between two writes, and "
            "removing it would break that upload; give at least "
            f"{floor:.0f} (the default is {TEMP_GRACE_S:.0f})"
        )
    for name in MODE_OPTIONS:
        if name in spec.options:
            mode_option(spec, name)
    if "create" in spec.options:
        option(spec, "create", True, as_bool, "1 or 0")


def mode_option(spec: TierSpec, name: str) -> int:
    """The octal mode option ``name`` (``mode`` for files, ``dir_mode`` for directories)."""
    default, owner, example = MODE_OPTIONS[name]

    def parse(text: str) -> int:
        if not re.fullmatch(r"0?o?[0-7]{3}", text.strip()):
            raise ValueError(text)
        mode = int(text.strip().replace("o", "")[-3:], 8)
        if mode & owner != owner or mode & 0o002:
            raise ValueError(text)
        return mode

    expected = f"an octal mode such as {example} that keeps {owner:04o} for the owner and "
    return option(spec, name, default, parse, expected + "gives others no write access")


READ_ONLY_PROTOCOLS = frozenset(
    ["http", "https", "github", "gist", "tar", "zip", "libarchive", "data", "reference"]
)
"""fsspec protocols that can only be read (or cannot remove what they hold): a tier on one
is fine to read from, never to save to."""


def check_writable(url: str) -> None:
    """ConfigError when ``url`` names a tier that cannot be written (``http://`` and the other
    read-only fsspec filesystems), for where a tier is saved or restored to."""
    spec = parse_spec(url)
    if spec.scheme in ("file", "pfs"):
        _check_directory(spec)
    protocol = spec.scheme.removeprefix("fsspec+")
    if _entry(spec.scheme) is FSSPEC and protocol in READ_ONLY_PROTOCOLS:
        raise ConfigError(
            f"tier {spec.url} cannot be written: fsspec's {protocol}:// filesystem is read-only "
            "(it cannot store or remove objects); read from it (flashckpt ls, verify, restore, "
            "export, flashckpt.load) and save to a writable tier (file:///dir, pfs:///dir, "
            "s3://bucket/prefix...)"
        )


def _check_directory(spec: TierSpec) -> None:
    """ConfigError when a directory tier's root, or the nearest directory above it (the tier
    creates the rest), cannot be written by this process."""
    path = Path(spec.location).absolute()
    while not path.is_dir() and path != path.parent:  # a file in the way: the tier says so
        path = path.parent
    if not os.access(path, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise ConfigError(
            f"tier {spec.url} cannot be written: this user ({os.geteuid()}) cannot create files "
            f"in {path} (its mode, or a read-only mount); give the tier a directory this user "
            "can write, or mount it read-write"
        )


def check_installed(url: str) -> None:
    """ImportError naming what to install when ``url``'s tier needs a package that is missing,
    ConfigError when the tier cannot be written (a trainer's tiers are saved to); nothing is
    imported (a trainer only names tiers its agent opens)."""
    check_writable(url)
    spec = parse_spec(url)
    entry = _entry(spec.scheme)
    needed: list[tuple[str, str]] = []  # (module, what to run)
    if entry is FSSPEC:
        from fsspec.registry import known_implementations

        protocol = spec.scheme.removeprefix("fsspec+")
        cls = known_implementations.get(protocol, {}).get("class", "")
        top = cls.split(".")[0]
        if top and top != "fsspec":
            needed.append((top, f"pip install {top}"))
    else:
        needed += [(m, entry.install_hint or f"pip install {m}") for m in entry.requires]
    for module, hint in needed:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a missing parent package
            found = False
        if not found:
            raise ImportError(
                f"the {spec.scheme}:// tier {spec.url} needs {module}, which is not installed; "
                f"run: {hint}"
            )


def open_tier(url: str, storage_options: dict | None = None, **options: object) -> Tier:
    """Build the tier for ``url``; importing its module only now (s3fs only for s3://).
    ``storage_options`` go to an fsspec tier's filesystem as they are (any type)."""
    spec = parse_spec(url, **options)
    entry = _entry(spec.scheme)
    cls = _load(spec.scheme, entry)
    log.debug("opening %s tier %s (%s)", cls.__name__, spec.url, spec.scope.value)
    if storage_options:
        if entry is not FSSPEC:
            raise ConfigError(
                f"tier {spec.url}: storage_options are for fsspec tiers (gs://, fsspec+s3://...)"
                f"; pass {spec.scheme}:// options in the URL query"
            )
        return cls(spec, storage_options=storage_options)  # type: ignore[call-arg]
    return cls(spec)


def tier_class(url: str) -> type[Tier]:
    """The class ``open_tier(url)`` builds, imported but not made (class-level facts, such
    as whether the tier is ``optional`` to a restore)."""
    scheme = parse_spec(url).scheme
    return _load(scheme, _entry(scheme))


def _fsspec_knows(scheme: str) -> bool:
    try:
        import fsspec
    except ImportError:  # pragma: no cover - a core dependency
        return False
    return scheme in fsspec.available_protocols()


def option(
    spec: TierSpec,
    name: str,
    default: T,
    convert: Callable[[str], T],
    expected: str | None = None,
) -> T:
    """A typed tier option: ``convert(spec.options[name])`` or ``default`` when absent."""
    text = spec.options.get(name)
    if text is None or text == "":
        return default
    try:
        return convert(text)
    except ValueError:
        shown = "***" if is_secret(name) else repr(text)
        raise ConfigError(
            f"tier {spec.url}: option {name}={shown} is not valid: expected "
            f"{expected or f'a value like {default!r}'}; fix the URL query or argument"
        ) from None


def as_bool(text: str) -> bool:
    """``true/false``, ``1/0``, ``yes/no`` for boolean tier options."""
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)
