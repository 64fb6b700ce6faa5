"""What a Slurm allocation tells ``flashckpt-run``: ``python -m flashckpt.faults.slurm env``.

Under ``srun`` every node's task sees the allocation in ``SLURM_*`` variables. A launch line
needs four things from them, printed as shell ``export`` lines for ``eval``:

- ``FLASHCKPT_RDZV_HOST``: the first node of ``SLURM_JOB_NODELIST``, where the rendezvous,
  the controller and the in-process recovery store are served. Slurm gives the list
  compressed (``gpu[001-004,010],login-b7``): ``scontrol show hostnames`` expands it where
  Slurm's commands are installed, else it is expanded here;
- ``FLASHCKPT_NNODES``: ``SLURM_JOB_NUM_NODES`` (or ``SLURM_NNODES``);
- ``FLASHCKPT_JOB``: ``FLASHCKPT_JOB`` if set, else ``SLURM_JOB_NAME`` made a valid job name.
  Not the job id: a job requeued (``sbatch --requeue``, or after a node failure) keeps its
  name, and its snapshots are found by the name;
- ``FLASHCKPT_NODE``: ``SLURMD_NODENAME``, the node's name in the allocation.

With ``FLASHCKPT_SPARES=K`` the last K nodes of the allocation (by ``SLURM_NODEID``) are the
job's spare nodes: ``FLASHCKPT_NNODES`` counts the others, and a spare gets
``FLASHCKPT_SPARE=1`` (``flashckpt-run --spare``: it takes a lost node's ranks in-process).

With ``FLASHCKPT_CONTROL_NODE=1`` the first node of the allocation trains nothing: it serves the
job's control plane (etcd for the rendezvous, the controller with the recovery store) in a job
step of its own, so that no training node's loss takes it. That node gets
``FLASHCKPT_CONTROL=1``; every node gets ``FLASHCKPT_CONTROL_HOST`` (the first host), and
``FLASHCKPT_NNODES`` counts the training nodes alone. A node's place in the allocation is then
its name's (``SLURMD_NODENAME``) in the node list, else ``SLURM_NODEID``: the control plane and
the training run as two job steps, whose node ids each count from 0. Without it, the first
node trains and hosts the rendezvous and the controller, and its loss ends the job.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping

from .. import config
from ..errors import ConfigError

MAX_HOSTS = 1 << 20
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand(nodelist: str) -> list[str]:
    """The host names of a compressed Slurm node list, in order: ``a[01-03,7]b,c`` is
    a01b, a02b, a03b, a7b, c; several bracket groups in one name multiply out. Zero padding
    follows the range's first number. ConfigError naming the list on anything else."""
    hosts: list[str] = []
    for name in _split_top(nodelist):
        hosts += _expand_one(name, nodelist)
        if len(hosts) > MAX_HOSTS:
            raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r} names more than {MAX_HOSTS} hosts")
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r} names no host")
    return hosts


def _split_top(nodelist: str) -> list[str]:
    """``nodelist`` cut at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r}: a ']' without its '['")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r}: a '[' without its ']'")
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(name: str, whole: str) -> list[str]:
    at = name.find("[")
    if at < 0:
        return [name]
    end = name.index("]", at)
    head, body, tail = name[:at], name[at + 1 : end], name[end + 1 :]
    out = []
    for piece in body.split(","):
        m = _RANGE.fullmatch(piece.strip())
        if m is None:
            raise ConfigError(f"SLURM_JOB_NODELIST {whole!r}: {piece!r} is not N or N-M")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi, width = int(lo_text), int(hi_text), len(lo_text)
        if hi < lo or hi - lo >= MAX_HOSTS:
            raise ConfigError(f"SLURM_JOB_NODELIST {whole!r}: the range {piece!r} is empty "
                              "or too long")  # fmt: skip
        out += [f"{head}{n:0{width}d}" for n in range(lo, hi + 1)]
    return [h + rest for h in out for rest in _expand_one(tail, whole)]


def all_hosts(nodelist: str) -> list[str]:
    """The hosts of ``nodelist``: ``scontrol show hostnames`` where it is installed (Slurm's
    own reading), else ``expand``."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()  # fmt: skip
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass  # not usable here: the list is expanded the same way below
    return expand(nodelist)


def first_host(nodelist: str) -> str:
    return all_hosts(nodelist)[0]


def job_name(env: Mapping[str, str]) -> str:
    """``FLASHCKPT_JOB``, else ``SLURM_JOB_NAME`` with what a job name cannot hold made
    ``-`` (Slurm allows spaces and slashes)."""
    if env.get("FLASHCKPT_JOB"):
        return config.validate_name("job", env["FLASHCKPT_JOB"], "FLASHCKPT_JOB")
    raw = env.get("SLURM_JOB_NAME", "")
    name = re.sub(r"[^A-Za-z0-9._-]", "-", raw).lstrip("._-")[:128]
    if not name:
        raise ConfigError(
            f"SLURM_JOB_NAME {raw!r} gives no job name: name the job (sbatch --job-name=...) "
            "or set FLASHCKPT_JOB"
        )
    return name


def settings(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a node's launch line takes from the allocation (see the module doc)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("no SLURM_JOB_NODELIST: run this under srun, inside an allocation")
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or str(len(expand(nodelist)))
    control = _control_node(env)
    spares = _spares(env, int(nnodes) - control)
    first = first_host(nodelist)
    place = _place(env, nodelist) if control else int(env.get("SLURM_NODEID") or 0)
    out = {"FLASHCKPT_RDZV_HOST": first,
           "FLASHCKPT_NNODES": str(int(nnodes) - control - spares),
           "FLASHCKPT_JOB": job_name(env)}  # fmt: skip
    if env.get("SLURMD_NODENAME"):
        out["FLASHCKPT_NODE"] = env["SLURMD_NODENAME"]
    if control:
        out["FLASHCKPT_CONTROL_HOST"] = first
        if place == 0:
            out["FLASHCKPT_CONTROL"] = "1"
    if spares and place >= int(nnodes) - spares:
        out["FLASHCKPT_SPARE"] = "1"
    return out


def _place(env: Mapping[str, str], nodelist: str) -> int:
    """This node's place in the allocation: its name's in the node list, else SLURM_NODEID."""
    name = env.get("SLURMD_NODENAME", "")
    if name:
        hosts = all_hosts(nodelist)
        if name in hosts:
            return hosts.index(name)
    nodeid = env.get("SLURM_NODEID", "")
    if not nodeid.isdigit():
        raise ConfigError(f"SLURMD_NODENAME {name!r} is not in SLURM_JOB_NODELIST {nodelist!r} and "
                          "there is no SLURM_NODEID: run this under srun, one task a node")  # fmt: skip
    return int(nodeid)


def _control_node(env: Mapping[str, str]) -> int:
    """``FLASHCKPT_CONTROL_NODE``: 1 if the allocation's first node serves the control plane."""
    text = env.get("FLASHCKPT_CONTROL_NODE", "0").strip() or "0"
    if text not in ("0", "1"):
        raise ConfigError(f"FLASHCKPT_CONTROL_NODE={text!r}: set it to 1 (the allocation's first "
                          "node serves the control plane and trains nothing) or 0")  # fmt: skip
    if text == "1" and not (env.get("SLURMD_NODENAME") or env.get("SLURM_NODEID", "").isdigit()):
        raise ConfigError("FLASHCKPT_CONTROL_NODE needs SLURMD_NODENAME or SLURM_NODEID (which "
                          "node this is): run this under srun, one task a node")  # fmt: skip
    return int(text)


def _spares(env: Mapping[str, str], nodes: int) -> int:
    """``FLASHCKPT_SPARES``: how many of the allocation's last nodes are spares (0 by default)."""
    text = env.get("FLASHCKPT_SPARES", "0").strip() or "0"
    if not text.isdigit() or int(text) >= nodes:
        raise ConfigError(f"FLASHCKPT_SPARES={text!r} is not a count of spare nodes below the "
                          f"allocation's {nodes} training nodes: set it to 0..{nodes - 1}")  # fmt: skip
    if int(text) and not env.get("SLURM_NODEID", "").isdigit():
        raise ConfigError("FLASHCKPT_SPARES needs SLURM_NODEID (which node this is): run this "
                          "under srun, one task a node")  # fmt: skip
    return int(text)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["env"]:
        sys.stderr.write("usage: python -m flashckpt.faults.slurm env\n")
        return 2
    try:
        found = settings(os.environ)
    except ConfigError as exc:
        sys.stderr.write(f"flashckpt slurm: {exc}\n")
        return 1
    for key, value in found.items():
        sys.stdout.write(f"export {key}={shlex.quote(value)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
