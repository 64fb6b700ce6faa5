"""Where settings come from: explicit arguments > ``FLASHCKPT_*`` environment > defaults.

This is the one place that rule is applied; every other module asks here. Typed getters
(:func:`setting_int`, :func:`setting_float`, :func:`setting_bool`) turn a bad value into a
ConfigError naming the setting, the value and what is expected, and the directory settings
are created and checked private (see ``safe_paths``) before anything is kept in them.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from . import safe_paths
from .errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# torchrun's per-invocation rendezvous id (--standalone, or one node with no --rdzv-id): a uuid4
_RANDOM_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_LOCAL_RANK_ARG = re.compile(r"--local[-_]rank=[0-9]+")  # added per worker by the legacy launcher

DEFAULT_SHM_DIR = "/dev/shm/flashckpt"
DEFAULT_RUN_DIR = "/tmp/flashckpt-run"
MAX_RANK = 2**31 - 1  # ranks are int32 in torch.distributed and in the agent's protocol
MAX_STEP = 2**63 - 1  # the slot header stores the step as a signed 64-bit integer

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_said: set[str] = set()  # log lines said once per process


def validate_name(kind: str, value: str, source: str | None = None) -> str:
    """Job and tier names become path components: refuse anything that could escape."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value in (".", ".."):
        where = f" (from {source})" if source else ""
        raise ConfigError(
            f"{kind} name {value!r}{where} is not allowed: use 1-128 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return value


def _source(name: str, explicit: object) -> tuple[str, object]:
    """Where the value of setting ``name`` comes from, and the value (None: the default)."""
    if explicit is not None:
        return f"argument {name}", explicit
    env = f"FLASHCKPT_{name.upper()}"
    value = os.environ.get(env)
    return env, (value if value else None)


def setting(name: str, explicit: object = None, default: object = None) -> object:
    """``explicit`` if given, else ``FLASHCKPT_<NAME>`` if set, else ``default``."""
    value = _source(name, explicit)[1]
    return default if value is None else value


def _is_env(source: str) -> bool:
    """Environment variables are named in capitals, arguments as ``argument <name>``. Only the
    environment holds text to parse: an argument must already have the right type."""
    return source.isupper()


def _bad(source: str, value: object, expected: str) -> ConfigError:
    fix = f"fix or unset {source}" if _is_env(source) else "pass a valid value"
    return ConfigError(f"{source}={value!r} is not valid: expected {expected}; {fix}")


def parse_int(source: str, value: object, lo: int = 0, hi: int | None = None, why: str = "") -> int:
    """``value`` (an int, or the text of one from the environment) as an int in ``[lo, hi]``;
    ConfigError naming ``source``, the value and the range (and ``why``) otherwise."""
    expected = f"an integer from {lo} to {hi}" if hi is not None else f"an integer >= {lo}"
    expected += f" ({why})" if why else ""
    if isinstance(value, str) and _is_env(source):
        try:
            number = int(value.strip())
        except ValueError:
            raise _bad(source, value, expected) from None
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise _bad(source, value, expected)
    if number < lo or (hi is not None and number > hi):
        raise _bad(source, value, expected)
    return number


def _parse_float(source: str, value: object, lo: float, hi: float) -> float:
    expected = f"a number from {lo:g} to {hi:g}" if hi < math.inf else f"a number >= {lo:g}"
    try:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(value)
        if isinstance(value, str) and not _is_env(source):
            raise ValueError(value)
        number = float(value)
    except ValueError:
        raise _bad(source, value, expected) from None
    if math.isnan(number) or not lo <= number <= hi:
        raise _bad(source, value, expected)
    return number


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", re.IGNORECASE)


def parse_size(text: str | int, what: str = "a size") -> int:
    """Bytes of ``5GB``, ``500MB``, ``2GiB``, ``1048576``: decimal units for KB/MB/GB/TB and
    binary for KiB/MiB/GiB/TiB, as transformers reads ``max_shard_size``."""
    if isinstance(text, int):
        size = text
    else:
        m = _SIZE.fullmatch(text)
        if not m:
            raise ConfigError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB, 1048576)")
        unit = m.group(2).upper().removesuffix("B")
        base = 1024 if unit.endswith("I") else 1000
        size = int(float(m.group(1)) * base ** " KMGT".index(unit[:1] or " "))
    if size < 1:
        raise ConfigError(f"{what} must be at least one byte, not {text!r}")
    return size


def _parse_bool(source: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and _is_env(source) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise _bad(source, value, f"true or false ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")


def _typed(name: str, explicit: object, default: T, parse: Callable[[str, object], T]) -> T:
    source, value = _source(name, explicit)
    return default if value is None else parse(source, value)


def setting_int(
    name: str, explicit: object = None, default: int = 0, lo: int = 0, hi: int | None = None
) -> int:
    """An integer setting in ``[lo, hi]``, from the argument, ``FLASHCKPT_<NAME>`` or default."""
    return _typed(name, explicit, default, lambda s, v: parse_int(s, v, lo, hi))


def setting_float(
    name: str,
    explicit: object = None,
    default: float = 0.0,
    lo: float = 0.0,
    hi: float = math.inf,
) -> float:
    """A number setting in ``[lo, hi]``, from the argument, ``FLASHCKPT_<NAME>`` or default."""
    return _typed(name, explicit, default, lambda s, v: _parse_float(s, v, lo, hi))


def setting_bool(name: str, explicit: object = None, default: bool = False) -> bool:
    """A true/false setting; the environment takes 1/0, true/false, yes/no, on/off."""
    return _typed(name, explicit, default, _parse_bool)


AGENT_NUMBERS = ("give_up_after", "kill_grace", "exit_when_idle")
"""The number settings the node agent reads from the environment it is started with."""


def check_agent_settings() -> None:
    """Parse the settings the node agent will read: a bad one is a ConfigError where the
    job starts, not an agent that exits at start with the reason in its log only."""
    for name in AGENT_NUMBERS:
        setting_float(name, None, 0.0)
    peer_replicas()


def check_flag(name: str, value: object) -> bool:
    """An argument that must be a real bool (a string like "no" would be truthy)."""
    if not isinstance(value, bool):
        raise _bad(f"argument {name}", value, "True or False")
    return value


def check_step(step: object) -> int:
    """A step as the slot header and tier layout store it: an int from 0 to 2**63-1."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ConfigError(
            f"step must be a non-negative int of at most 2**63-1 (the slot header stores it as "
            f"a signed 64-bit integer), got {step!r}; pass the training step as an int"
        )
    return step


# ---- job and rank ----------------------------------------------------------------------------


def resolve_job(job: str | None, from_command: bool = True) -> str:
    """The job name: the argument, else FLASHCKPT_JOB, else torchrun's ``--rdzv-id``
    (TORCHELASTIC_RUN_ID) unless torchrun made it up for this one invocation, else a name
    derived from the command line (so a rerun of the same command resumes; not for a
    daemon, ``from_command=False``, whose command line says nothing of the job), else
    "default"."""
    if job is not None:
        return validate_name("job", job, "argument job")
    derived = False
    if os.environ.get("FLASHCKPT_JOB"):
        name, how = os.environ["FLASHCKPT_JOB"], "FLASHCKPT_JOB"
    elif _stable_run_id(os.environ.get("TORCHELASTIC_RUN_ID", "")):
        name, how = os.environ["TORCHELASTIC_RUN_ID"], "torchrun's --rdzv-id (TORCHELASTIC_RUN_ID)"
    else:
        derived = True
        name = (job_from_command(sys.argv) if from_command else None) or "default"
        how = "the command line" if name != "default" else "no script to derive it from"
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            how += f", not torchrun's id {os.environ['TORCHELASTIC_RUN_ID']!r} made for one run"
    validate_name("job", name, how)
    if derived:
        _once(
            logging.WARNING,
            "no FLASHCKPT_JOB is set: the job name is %r (from %s), the same for every rerun "
            "of this command; set FLASHCKPT_JOB to name the run",
            name,
            how,
        )
    else:
        _once(logging.INFO, "job name %r (from %s)", name, how)
    return name


def _stable_run_id(run_id: str) -> bool:
    """False for torchrun's placeholder and for the random id it makes per invocation."""
    return bool(run_id) and run_id != "none" and not _RANDOM_RUN_ID.fullmatch(run_id.lower())


def job_from_command(argv: list[str]) -> str | None:
    """``<script>-<8 hex>`` from the script's real path and its arguments; None without a
    script (``python -c``, an interactive session)."""
    script = argv[0] if argv else ""
    if script in ("", "-c", "-") or not os.path.isfile(script):
        return None
    path = Path(os.path.realpath(script))
    args = [a for a in argv[1:] if not _LOCAL_RANK_ARG.fullmatch(a)]
    stem = path.parent.name if path.stem == "__main__" else path.stem  # python -m package
    return derived_name(stem, [str(path), *args])


def derived_name(stem: str, key: list[str]) -> str:
    """``<stem>-<8 hex digits of a hash of key>``, a valid job name."""
    digest = hashlib.sha256("\0".join(key).encode("utf-8", "surrogateescape"))
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip("._-")[:64] or "job"
    return f"{stem}-{digest.hexdigest()[:8]}"


def _once(level: int, msg: str, *args: object) -> None:
    key = msg % args
    if key not in _said:
        _said.add(key)
        log.log(level, msg, *args)


def node_name() -> str:
    """This node's name in commit markers, events and the controller: FLASHCKPT_NODE, else
    the host name (characters outside ``[A-Za-z0-9._-]`` become ``-``)."""
    import socket

    raw = str(setting("node", None, socket.gethostname()))
    # ASCII alone: a commit marker's name is parsed with [A-Za-z0-9._-] (isalnum() would let
    # other scripts' letters through, and the node's markers would never be read back).
    return (
        "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "-" for c in raw)[:64]
        or "node"
    )


def peer_replicas(explicit: int | None = None) -> int:
    """How many other nodes keep this node's newest step in their memory
    (``FLASHCKPT_PEER_REPLICAS``; ``flashckpt-run`` sets 1 for a job of several nodes where
    it is unset; 0 turns replicas off)."""
    return setting_int("peer_replicas", explicit, 0, lo=0, hi=16)


PEER_DUTY = 0.25
"""The share of the time an agent spends sending a replica at most: a round of t seconds is
followed by 3t of rest, so replicas take a quarter of a core, never the trainers' share."""


def peer_urls(k: int) -> list[str]:
    """The ``peer://`` tiers of ``k`` replicas: each keeps one step, the newest complete."""
    return [f"peer://auto?hop={h}&keep_last=1&duty={PEER_DUTY}" for h in range(1, k + 1)]


LIST_RETRY_S = 10.0
"""How long a restore keeps trying a required tier whose listing fails with an error that
may pass (a connection, a timeout, throttling), by default."""


def list_retry_s() -> float:
    """``FLASHCKPT_LIST_RETRY_S``: the budget for retrying a required tier's listing at a
    restore (waits of 0.5, 1, 2, 4 s), after which the restore fails saying why."""
    return setting_float("list_retry_s", None, LIST_RETRY_S, lo=0.0, hi=3600.0)


def local_world_size() -> int:
    """Ranks of this job on this node as the launcher says (torchrun: LOCAL_WORLD_SIZE); 0 if unknown."""
    try:
        return max(0, int(os.environ.get("LOCAL_WORLD_SIZE") or 0))
    except ValueError:
        return 0


def resolve_rank(rank: int | None) -> int:
    """The argument, else the process group's rank, else RANK, else 0; an int below 2**31."""
    if rank is not None:
        return parse_int("argument rank", rank, 0, MAX_RANK, "a rank must fit in 32 bits")
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return parse_int("the process group's rank", dist.get_rank(), 0, MAX_RANK)
    except ConfigError:
        raise
    except Exception:  # a broken dist install must not stop checkpointing
        pass
    env = os.environ.get("RANK")
    return parse_int("RANK", env, 0, MAX_RANK, "a rank must fit in 32 bits") if env else 0


# ---- directories -----------------------------------------------------------------------------


def shm_dir(explicit: str | os.PathLike | None = None, create: bool = True) -> Path:
    """Where the slots live: created and checked (it may be a sticky tmpfs mount point; each
    job's own directory inside it is private)."""
    return _dir("shm_dir", explicit, DEFAULT_SHM_DIR, create, shared_parent=True)


REPLICAS_DIR = "_replicas"  # in shared memory: a name no job can take (see validate_name)


def replicas_dir(shm_dir: Path, job: str) -> Path:
    """Where a node holds ``job``'s replicas of other nodes."""
    return Path(shm_dir) / REPLICAS_DIR / job


def run_dir(explicit: str | os.PathLike | None = None, create: bool = True) -> Path:
    """Where the agent's socket, pid file and log live: created 0700 and checked private."""
    return _dir("run_dir", explicit, DEFAULT_RUN_DIR, create, shared_parent=False)


def _dir(name: str, explicit: object, default: str, create: bool, shared_parent: bool) -> Path:
    """An explicit directory that is not private is refused; the default one (a predictable
    name in a world-writable place) is replaced by a per-user one, ``<default>-<uid>``."""
    source, value = _source(name, explicit)
    if value is not None:
        path = Path(os.fspath(value))  # type: ignore[arg-type]
        return safe_paths.private_dir(path, source, shared_parent) if create else path
    first, second = Path(default), Path(f"{default}-{os.geteuid()}")
    if not create:
        usable = not os.path.lexists(first) or safe_paths.why_not_private(first) is None
        return first if usable else second
    why = safe_paths.make_private_dir(first)
    if why is None:
        return first
    _once(
        logging.WARNING,
        "the default %s %s cannot be used (%s); using %s instead",
        name,
        first,
        why,
        second,
    )
    why_second = safe_paths.make_private_dir(second)
    if why_second is not None:
        raise ConfigError(
            f"neither the default {name} {first} ({why}) nor the per-user {second} "
            f"({why_second}) is a directory only you can write; set {source} to one of yours"
        )
    return second
