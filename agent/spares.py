"""The controller's view of a job's spare nodes (``flashckpt-run --spare``): which are free to
take a lost node, which are gone, and whether the job is over (a spare then exits). Pure
decisions over the job's nodes; the controller delivers what they say."""

from __future__ import annotations

from .job_view import JobState


def forget_gone(job: JobState, now: float, timeout: float) -> None:
    """Drop spares silent for ``timeout``: gone, or they took a lost node and report under its
    name now."""
    for name in [k for k, n in job.nodes.items() if n.spare and now - n.last_seen > timeout]:
        del job.nodes[name]


def free(job: JobState, now: float, fresh_s: float) -> list[str]:
    """The spares free to take a lost node, in name order: heard within ``fresh_s`` (one lost
    with the nodes it would take must not be handed one) and taking none yet."""
    return sorted(k for k, n in job.nodes.items()
                  if n.spare and not n.taking and not n.joining
                  and now - n.last_seen <= fresh_s)  # fmt: skip


def job_over(job: JobState, now: float, timeout: float) -> bool:
    """Whether the job has run and ended, no node lost: every worker of every node closed its
    Checkpointer (a killed or crashed one has not; a restart's new ones run), or the job failed:
    every node's launcher is gone (its agent silent past ``timeout``) and none had a worker
    running when last heard (the controller that a launcher served is gone with it; a
    standalone one learns the end this way)."""
    nodes = [n for n in job.nodes.values() if not n.spare]
    if not any(n.ran for n in nodes) or any(n.lost for n in nodes):
        return False
    closed = all(s.worker.phase == "closed" for n in nodes for s in n.workers.values())
    gone = all(now - n.last_seen > timeout and not n.running() for n in nodes)
    return closed or gone
