"""What the doors that keep a pointer to a step in a framework's checkpoint directory (the
Accelerate, HF Trainer and Lightning integrations) share about the steps those pointers name."""

from __future__ import annotations

import logging

from .checkpointer import Checkpointer

log = logging.getLogger(__name__)


def wait_named_step_stored(ckpt: Checkpointer, named: int | None) -> None:
    """Wait until step ``named``, which a directory's pointer names, is in the first tier.
    The agent stores the newest step it finds in memory: a step saved soon after another would
    otherwise leave the other's directory naming a step no tier ever held. Usually long done."""
    if named is None or not ckpt.tiers:
        return
    try:
        ckpt.wait(named, tier=ckpt.tiers[0], timeout=ckpt.close_timeout)
    except TimeoutError:
        log.warning("step %d is not in %s after %.0fs; the directory naming it loads only "
                    "while this node's memory holds it", named, ckpt._shown_tiers()[0],
                    ckpt.close_timeout)  # fmt: skip
