"""What every ``flashckpt`` subcommand shares: exit codes, output (text or ``--json``), secrets
kept out of both, progress on long work, and which job a command is about.

Exit codes: 0 nothing wrong, 1 a problem was found (a bad chunk, a missing step, a tier that
cannot be read), 2 the command line itself is wrong. A subcommand raises :class:`Problem` or
:class:`UsageError` with one line that says what to do; ``main`` prints it (with the traceback
only under ``--debug``) and exits with its code.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import sys
import time
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from .. import config
from ..errors import ConfigError
from ..storage_tiers.registry import SECRET_OPTIONS, redact

OK, PROBLEM, USAGE = 0, 1, 2
SHM = "shm"
"""The location that names this node's shared memory instead of a tier URL."""


class UsageError(Exception):
    """The command line is wrong: exit 2."""

    code = USAGE


class Problem(Exception):
    """Something was found wrong, or could not be done: exit 1."""

    code = PROBLEM


# ---- secrets -----------------------------------------------------------------------------

_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "signature")
_MIN_SECRET = 4  # shorter values are not credentials, and scrubbing them would garble output


def _secret_option(name: str) -> bool:
    name = name.strip().lower()
    return name in SECRET_OPTIONS or name.endswith("key") or any(w in name for w in _SECRET_WORDS)


class Secrets:
    """Credential values seen in the URLs of this command line; :meth:`scrub` masks them in
    any text about to be shown (messages of s3fs and botocore may quote them)."""

    def __init__(self) -> None:
        self.values: set[str] = set()

    def learn(self, url: str) -> None:
        _, _, query = str(url).partition("?")
        for name, value in parse_qsl(query, keep_blank_values=True):
            if _secret_option(name):
                self._add(value)
            elif "://" in value:
                self.learn_userinfo(value)  # endpoint_url=http://user:password@host
        self.learn_userinfo(str(url).partition("?")[0])

    def learn_argv(self, argv: list[str]) -> None:
        """Learn the secrets of every URL on a command line (``--opt=URL`` too), so they are
        masked even in argparse's own messages."""
        for arg in argv:
            if "://" in arg or "?" in arg:
                self.learn(arg.partition("=")[2] if arg.startswith("--") else arg)

    def learn_userinfo(self, url: str) -> None:
        try:
            parts = urlsplit(url)
        except ValueError:
            return
        if parts.password:
            self._add(unquote(parts.password))
        if parts.username and parts.password:
            self._add(unquote(parts.username))

    def _add(self, value: str) -> None:
        if len(value) >= _MIN_SECRET:
            self.values |= {value, quote(value, safe=""), quote(value)}

    def scrub(self, text: str) -> str:
        for value in sorted(self.values, key=len, reverse=True):
            text = text.replace(value, "***")
        return text


SECRETS = Secrets()


def shown(url: str) -> str:
    """A location as it may be printed: credentials masked."""
    return SECRETS.scrub(redact(url))


class ScrubbingFormatter(logging.Formatter):
    """Log lines of this process (and of the libraries under it) with credentials masked."""

    def format(self, record: logging.LogRecord) -> str:
        return SECRETS.scrub(super().format(record))


def setup_logging(debug: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ScrubbingFormatter("flashckpt: %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("flashckpt").setLevel(logging.DEBUG if debug else logging.WARNING)


# ---- output ------------------------------------------------------------------------------


class Output:
    """Human text on stdout (problems on stderr), or with ``--json`` one JSON document on
    stdout and nothing else there. Every line is scrubbed of credentials."""

    def __init__(self, as_json: bool):
        self.json = as_json

    def line(self, text: str = "") -> None:
        if not self.json:
            print(SECRETS.scrub(text), flush=True)

    def problem(self, text: str) -> None:
        """A problem found: stderr in text mode (the JSON document carries it otherwise)."""
        if not self.json:
            print(one_line(text), file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """A remark that is not a result: stderr, in both modes."""
        print(one_line(text), file=sys.stderr, flush=True)

    def document(self, doc: dict[str, Any]) -> None:
        if self.json:
            print(SECRETS.scrub(json.dumps(doc, indent=2, sort_keys=False)), flush=True)


def one_line(text: str) -> str:
    return SECRETS.scrub(" ".join(str(text).split()))


def describe_error(exc: BaseException) -> str:
    """An exception as one line a user can act on: an OSError straight from the system (not
    one flashckpt worded) says what its errno means and what to do, never a bare
    ``[Errno N]``; one without a message says what failed."""
    from ..errors import FlashCkptError
    from ..storage_tiers.os_errors import advice

    text = str(exc)
    if isinstance(exc, OSError) and not isinstance(exc, FlashCkptError):
        if exc.errno == errno.EADDRINUSE:
            text = f"{exc.strerror}; pick another port, or stop what listens on it"
        elif (said := advice(exc)) is not None:
            text = said
        elif exc.errno is not None and exc.strerror:
            on = f" on {exc.filename}" if exc.filename else ""
            text = f"{exc.strerror}{on}; check that path and its filesystem"
    if not text.strip():
        text = (f"an operation failed with {type(exc).__name__} and no explanation; run again "
                "with --debug to see where, and report it if the cause is not clear")  # fmt: skip
    return one_line(text)


# ---- progress ----------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr for work of ``total`` units, shown only when stdout is a
    terminal and the work has taken over ``delay`` seconds: tqdm if installed, else one line
    rewritten in place. ``add_total`` grows the work as it is discovered."""

    def __init__(self, desc: str, total: float = 0, unit: str = "B", delay: float = 1.0,
                 enabled: bool | None = None):  # fmt: skip
        self.desc, self.total, self.unit, self.delay = desc, total, unit, delay
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self.done = 0.0
        self.started = time.monotonic()
        self._bar = None
        self._shown = 0.0
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            scale = unit == "B"
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, delay=delay,
                             file=sys.stderr, leave=False, dynamic_ncols=True)  # fmt: skip

    def add_total(self, n: float) -> None:
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def update(self, n: float = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and now - self.started >= self.delay and now - self._shown >= 0.2:
            self._shown = now
            print(f"\r{self.text()}", end="", file=sys.stderr, flush=True)

    def text(self) -> str:
        if self.unit == "B":
            done, total = f"{human_bytes(self.done)}", f"{human_bytes(self.total)}"
        else:
            done, total = f"{self.done:g}", f"{self.total:g} {self.unit}"
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.desc}: {done} of {total}{pct}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- formatting --------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for limit, unit in ((120, "s"), (7200, "min"), (172800, "h")):
        if seconds < limit:
            scale = {"s": 1, "min": 60, "h": 3600}[unit]
            return f"{seconds / scale:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def ranks_text(ranks: list[int] | tuple[int, ...] | frozenset[int]) -> str:
    """``0-3,5`` for ranks 0, 1, 2, 3 and 5."""
    out: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out) or "none"


# ---- arguments ---------------------------------------------------------------------------


def add_job(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default=None,
                   help="the job (default: FLASHCKPT_JOB, else the only job stored there)")  # fmt: skip


def add_dirs(p: argparse.ArgumentParser, shm: bool = True, run: bool = False) -> None:
    if shm:
        p.add_argument("--shm-dir", default=None, metavar="DIR",
                       help="this node's shared-memory directory, what 'shm' names "
                            "(default: FLASHCKPT_SHM_DIR, else /dev/shm/flashckpt)")  # fmt: skip
    if run:
        p.add_argument("--run-dir", default=None, metavar="DIR",
                       help="where agents keep their socket, pid file and log "
                            "(default: FLASHCKPT_RUN_DIR, else /tmp/flashckpt-run)")  # fmt: skip


def locations(args: argparse.Namespace, at_least: int = 1) -> list[str]:
    """The locations named on the command line (positional URLs, then ``--tier`` ones), each
    checked to parse: a bad URL is a usage error."""
    from ..storage_tiers import parse_spec

    urls = [*(getattr(args, "url", None) or []), *(getattr(args, "tier", None) or [])]
    for url in urls:
        SECRETS.learn(url)
    if len(urls) < at_least:
        raise UsageError("name a location: a tier URL (file:///dir, pfs:///dir, s3://bucket/"
                         "prefix) or 'shm' for this node's shared memory")  # fmt: skip
    for url in urls:
        if url != SHM:
            try:
                parse_spec(url)
            except (ConfigError, ImportError) as exc:
                raise UsageError(describe_error(exc)) from exc
    return urls


def shm_dir(args: argparse.Namespace):
    return config.shm_dir(getattr(args, "shm_dir", None), create=False)


def run_dir(args: argparse.Namespace):
    return config.run_dir(getattr(args, "run_dir", None), create=False)


def chosen_job(args: argparse.Namespace) -> str | None:
    """``--job``, else FLASHCKPT_JOB, checked; None if neither names one."""
    job = getattr(args, "job", None)
    source = "--job"
    if job is None and os.environ.get("FLASHCKPT_JOB"):
        job, source = os.environ["FLASHCKPT_JOB"], "FLASHCKPT_JOB"
    if job is None:
        return None
    try:
        return config.validate_name("job", job, source)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def only_job(jobs: list[str], where: str) -> str:
    """The one job of ``jobs`` (those found at ``where``) when none was named."""
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        raise Problem(f"{where} holds no job; check the location, or name one with --job")
    raise UsageError(f"{where} holds {len(jobs)} jobs ({', '.join(sorted(jobs))}); pick one "
                     "with --job or FLASHCKPT_JOB")  # fmt: skip


_STEP_ARG = re.compile(r"[0-9]{1,19}")


def step_arg(text: str) -> int:
    """argparse type of ``--step``: a step number as the layout stores it."""
    if not _STEP_ARG.fullmatch(text.strip()) or int(text) > config.MAX_STEP:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (0 to 2**63-1)")
    return int(text)


def rank_arg(text: str) -> int:
    if not text.strip().isdigit() or int(text) > config.MAX_RANK:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank (0 to 2**31-1)")
    return int(text)
