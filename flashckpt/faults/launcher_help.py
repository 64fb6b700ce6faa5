"""``flashckpt-run --help``: the launcher's own flag and settings, then torchrun's options.

``flashckpt-run`` takes torchrun's arguments, so torchrun's parser prints its help; without
this, ``--spare`` and every ``FLASHCKPT_*`` setting the launcher reads would be invisible from
the command line. A ``--help`` after the training script is the script's own, and passes.
"""

from __future__ import annotations

import contextlib
import io
import sys

HELP_FLAGS = ("-h", "--help")

OWN = """\
flashckpt-run: torchrun with fault tolerance (hang detection, a controller per job, in-process
recovery, spare nodes). It takes torchrun's arguments (below) and one of its own:

  --spare            this node is a spare: it joins no rendezvous, keeps warm standbys, and
                     takes a lost node's ranks in-process (needs in-process recovery; also
                     FLASHCKPT_SPARE=1). Before the training script.

Settings (environment variables; every one is in the configuration reference,
docs/CONFIG.md):

  FLASHCKPT_JOB                 the job's name (default: --rdzv-id, else from the command)
  FLASHCKPT_NODE                this node's name (default: the host name)
  FLASHCKPT_RUN_DIR             event log, agent socket and pid files (/tmp/flashckpt-run)
  FLASHCKPT_SHM_DIR             where the snapshots live in memory (/dev/shm/flashckpt)
  FLASHCKPT_RESTART_POLICY      restart (every worker restarts) or in-process
  FLASHCKPT_CONTROLLER          the job's controller, host:port (default: the rendezvous
                                host, its port + 1; served by the launcher that can bind it)
  FLASHCKPT_CONTROLLER_TOKEN_FILE  a file holding the token every node presents
  FLASHCKPT_NODE_TIMEOUT        seconds a node's agent may be silent before it is lost (5)
  FLASHCKPT_HANG_FLOOR, _FACTOR, _CEILING, _STARTUP, _SAVE, _RESTORE
                                the hang detector's budgets (seconds; factor: x slowest step)
  FLASHCKPT_RECOVERY_DEADLINE   seconds for an in-process round to form (30)
  FLASHCKPT_RECOVERY_BUDGET     in-process recoveries allowed, COUNT/STEPS (3/100)
  FLASHCKPT_RECOVERY_STORE      the in-process recovery store, host:port
  FLASHCKPT_STANDBY             warm standby processes a node keeps (in-process)
  FLASHCKPT_PEER_REPLICAS       keep each node's snapshot in a peer's memory (on for >1 node)

torchrun's options:
"""


def wants_help(argv: list[str]) -> bool:
    """Whether ``argv`` asks flashckpt-run for its help: ``-h``/``--help`` before the
    training script (after it, the flag is the script's)."""
    at = [i for i, a in enumerate(argv) if a in HELP_FLAGS]
    if not at:
        return False
    from torch.distributed import run as torchrun

    rest = [a for a in argv if a not in HELP_FLAGS]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            script = torchrun.parse_args(rest).training_script
    except SystemExit:  # no script at all: the help is the launcher's
        return True
    end = argv.index(script) if script in argv else len(argv)
    return at[0] < end


def print_help() -> None:
    """The launcher's own help, then torchrun's; exits 0."""
    from torch.distributed import run as torchrun

    sys.stdout.write(OWN)
    sys.stdout.flush()
    torchrun.get_args_parser().print_help()
    sys.exit(0)
