"""What the controller knows of a job, all of it from its agents' reports: each node's
workers (their start times on the controller's clock), tiers and replicas, whether it is
lost, and the workers it was ordered to kill; the nodes spares took while they were lost; and
the job's detections, global commits and the steps every node's node-local tiers hold."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashckpt.proto import controller_pb2 as pb

from .commits import Coverage
from .common_steps import CommonSteps


@dataclass
class Seen:
    """A worker as last reported, its start time on the controller's clock."""

    worker: pb.Worker
    started: float


@dataclass
class Node:
    agent_id: str
    last_seen: float
    workers: dict[int, Seen] = field(default_factory=dict)  # pid -> worker
    tiers: list[str] = field(default_factory=list)  # the tiers it reported, by URL
    ranks: frozenset[int] = frozenset()
    world_size: int = 0
    lost: bool = False
    kill: set[int] = field(default_factory=set)  # pids ordered killed, not yet gone
    handled: set[int] = field(default_factory=set)  # pids of failures already seen
    peer_address: str = ""  # where its agent holds other nodes' replicas
    failure_domain: str = ""
    replicas: list = field(default_factory=list)  # pb.Replica it holds
    ran: bool = False  # this agent has reported a running worker
    spare: bool = False  # a spare node (``flashckpt-run --spare``): runs nothing, takes a node
    taking: str = ""  # a spare told to take this lost node's ranks
    joining: str = ""  # a spare told to join the job's restart as this lost node
    lost_silent_s: float = 0.0  # (taking) how long that node had been silent when found lost

    def running(self) -> bool:
        return any(s.worker.alive and s.worker.phase != "closed" for s in self.workers.values())


@dataclass
class Taken:
    """A lost node a spare took: from then on the node's name is the spare's. The lost node's
    own agent (``agent_id``), or a new agent of that node (its keeper's) that reports one of
    its workers, is refused under that name."""

    spare: str
    agent_id: str  # the lost node's agent when it was found lost
    workers: dict[int, float]  # the lost node's workers then: pid -> start (controller's clock)
    refused: set[str] = field(default_factory=set)  # agents refused (each recorded once)

    def refuses(self, report: pb.NodeReport, now: float) -> bool:
        """Whether ``report`` comes from the lost node itself, not from the spare's agent."""
        if report.agent_id == self.agent_id:
            return True
        for w in report.workers:  # the same process: its pid (another host's may be equal)
            started = self.workers.get(w.pid)  # and when it started
            if started is not None and abs(started - (now - w.age_s)) < _SAME_START:
                return True
        return False


_SAME_START = 1.0  # two reports of one worker's start differ by their delays, far less


def short_of_world(nodes: dict[str, Node]) -> bool:
    """Whether workers of the job run while some ranks of their world were never reported
    by any node: they run on a node whose agent has not reported them yet. The world is the
    running nodes' (a node lost in an earlier, larger round does not count)."""
    world = max((n.world_size for n in nodes.values() if n.running()), default=0)
    ranks = {s.worker.rank for n in nodes.values() for s in n.workers.values()}
    return len({r for r in ranks if r < world}) < world


@dataclass
class JobState:
    nodes: dict[str, Node] = field(default_factory=dict)
    # Workers that started before this failed with the round it ended: their deaths are its
    # consequences (killed by us, by the launcher, or by a broken collective), not new failures.
    round_failed_at: float = float("-inf")
    detections: list[tuple[float, pb.Detection]] = field(default_factory=list)
    commits: dict[str, tuple[int, int]] = field(default_factory=dict)  # url -> (gen, step)
    coverage: dict[str, Coverage] = field(default_factory=dict)  # url -> what nodes hold
    common: CommonSteps = field(default_factory=CommonSteps)  # steps on every node's NVMe
    # Lost nodes taken by a spare, by name; forgotten when the job restarts whole.
    taken: dict[str, Taken] = field(default_factory=dict)
    # Since when no node was heard (the controller's own network cut?), and when one was
    # heard again: nothing is judged lost meanwhile (``Controller._deaf``).
    deaf_since: float | None = None
    heard_again: float | None = None
