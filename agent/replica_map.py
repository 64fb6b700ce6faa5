"""The controller's view of peer replicas: where each node's replica goes, where to read it,
and which copies holders may give back.

Placement is ``peer_placement.assign`` over the nodes as reported, computed once per change of
membership (a thousand nodes take about 0.1 s) and kept. What each node holds is indexed by
source as its reports arrive, so an answer costs a few lookups however large the job.

A holder's copy of a source's replica expires (the holder is told in its report's answer) when
it is not needed any more:

- **moved**: the holder is none of the source's chosen holders at the hops its peer tiers use,
  and one of those holders, not lost, reports a replica of the source at least as new;
- **left**: the source is lost (or, once the controller has run a node timeout, unlisted),
  and a tier has committed a newer step for every rank of the job: no restore reads it again.

Nothing else is expired: the newest copy of a node's state is never given back.

A holder asks (``Holders``) whether a node that writes to it is declared lost: a lost node's
puts and deletes are refused until it reports again.
"""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlsplit

from flashckpt.proto import controller_pb2 as pb
from flashckpt.storage_tiers.peer_placement import PeerNode, assign, holder

from .job_view import Node

Key = tuple[int, int]  # (generation, step)


def peer_hops(tier_urls: list[str]) -> tuple[int, set[str]]:
    """(highest hop, named holders) of the ``peer://`` tiers among a node's reported tiers."""
    hops, named = 0, set()
    for url in tier_urls:
        parts = urlsplit(url)
        if parts.scheme != "peer":
            continue
        if parts.netloc not in ("", "auto"):
            named.add(parts.netloc)
            continue
        try:
            hops = max(hops, int(parse_qs(parts.query).get("hop", ["1"])[0]))
        except ValueError:
            hops = max(hops, 1)
    return hops, named


class ReplicaMap:
    """One job's placement and index of held replicas (see the module doc)."""

    def __init__(self, node_timeout: float):
        self.node_timeout, self.started = node_timeout, time.monotonic()
        self._signature: tuple = ()
        self._assigned: dict[str, list[str]] = {}
        self.held: dict[str, dict[str, Key]] = {}  # source -> holder -> newest step it holds

    # ---- what the holders report ----------------------------------------------------------
    def update(self, holder_name: str, replicas: list[pb.Replica]) -> None:
        """``holder_name`` now holds exactly ``replicas``."""
        newest: dict[str, Key] = {}
        for r in replicas:
            key = (r.generation, r.step)
            if key > newest.get(r.source, (-1, -1)):
                newest[r.source] = key
        for source, holders in list(self.held.items()):
            if holders.pop(holder_name, None) is not None and not holders:
                del self.held[source]
        for source, key in newest.items():
            self.held.setdefault(source, {})[holder_name] = key

    # ---- placement --------------------------------------------------------------------
    def assigned(self, nodes: dict[str, Node]) -> dict[str, list[str]]:
        hops = max([peer_hops(n.tiers)[0] for n in nodes.values()] + [1])
        signature = (hops, tuple((name, bool(n.peer_address), n.failure_domain, n.lost)
                                 for name, n in sorted(nodes.items())))  # fmt: skip
        if signature != self._signature:
            self._assigned = assign(_peers(nodes), hops)
            self._signature = signature
        return self._assigned

    def holders(self, nodes: dict[str, Node], request: pb.HoldersRequest) -> pb.HoldersReply:
        me = request.node
        reported = bool(self.held.get(me))
        lost = me in nodes and nodes[me].lost  # its holders take no write from it
        if request.named:
            n = nodes.get(request.named)
            found = pb.PeerHolder(node=request.named, address=n.peer_address if n else "")
            return pb.HoldersReply(assigned=found, read_from=found, reported=reported, lost=lost)
        if me in nodes:
            mine = self.assigned(nodes).get(me, [])
        else:  # a node started again wiped, before its agent reports: placed as a source
            mine = [h.name for hop in range(1, request.hop + 1)
                    if (h := holder(_peers(nodes), me, hop, request.failure_domain))]  # fmt: skip
        here = mine[request.hop - 1] if 0 < request.hop <= len(mine) else ""
        others = set(mine) - {here}  # the node's holders at its other hops
        held = {h: k for h, k in self.held.get(me, {}).items()
                if h not in others and h in nodes and not nodes[h].lost
                and nodes[h].peer_address}  # fmt: skip
        read = here
        if held and held.get(here, (-1, -1)) < max(held.values()):
            read = max(held, key=lambda h: held[h])  # a holder it moved from has a newer step

        def at(name: str) -> pb.PeerHolder:
            return pb.PeerHolder(node=name, address=nodes[name].peer_address if name else "")

        return pb.HoldersReply(assigned=at(here), read_from=at(read), reported=reported,
                               lost=lost)  # fmt: skip

    # ---- what may be given back -------------------------------------------------------------
    def expired(self, nodes: dict[str, Node], holder_name: str,
                commits: dict[str, Key], now: float | None = None) -> list[str]:  # fmt: skip
        """The sources whose replica ``holder_name`` may delete (see the module doc)."""
        now = time.monotonic() if now is None else now
        newest_commit = max(commits.values(), default=(-1, -1))
        assigned = None
        out = []
        for source, holders in sorted(self.held.items()):
            mine = holders.get(holder_name)
            if mine is None:
                continue
            node = nodes.get(source)
            if node is None or node.lost:
                gone = node is not None or now - self.started >= self.node_timeout
                if gone and newest_commit > mine:
                    out.append(source)
                continue
            hops, named = peer_hops(node.tiers)
            if not hops and not named:
                continue  # it has not reported its tiers yet
            assigned = self.assigned(nodes) if assigned is None else assigned
            chosen = set(assigned.get(source, [])[:hops]) | named
            if holder_name in chosen:
                continue
            live = [h for h in chosen if h != holder_name and h in nodes and not nodes[h].lost]
            if any(holders.get(h, (-1, -1)) >= mine for h in live):
                out.append(source)
        return out


def _peers(nodes: dict[str, Node]) -> list[PeerNode]:
    return [PeerNode(name, n.peer_address, n.failure_domain, n.lost)
            for name, n in nodes.items()]  # fmt: skip
