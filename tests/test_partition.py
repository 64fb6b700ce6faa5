"""A host cut off the network while alive (issue 51): each simulated node runs in a host of its
own (``netns.Hosts``: a network namespace, its own stack and address, on one switch), so a
partition drops its traffic silently while its processes run on, and a heal lets the host
reach the job again after its spare took its ranks.

First that the hosts are real: a service bound to one host's loopback is out of the others'
reach, its switch address is not, and both faults (``partition``, ``unplug``) are silent (no
reset, no close: data sent meanwhile arrives after the heal)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
from faults import is_dead, poll
from test_launcher import explain, restores
from test_spare_nodes import INPROCESS, first_step_after, pids_of, spare_cluster

PORT = 7777
# Host 0: an echo service on its loopback address and on its switch address.
SERVER = f"""
import socket, threading
def serve(host):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, {PORT})); s.listen()
    while True:
        c, _ = s.accept()
        threading.Thread(target=echo, args=(c,), daemon=True).start()
def echo(c):
    while data := c.recv(64):
        c.sendall(data)
import sys
threading.Thread(target=serve, args=("127.0.0.1",), daemon=True).start()
threading.Thread(target=serve, args=(sys.argv[1],), daemon=True).start()
print("serving", flush=True)
sys.stdin.read()  # until the test closes it
"""
# Host 1: one command a line, one answer a line (JSON).
#   try HOST: a fresh connection to HOST:PORT -> "ok" / "refused" / "timeout" / "unreachable"
#   open HOST: keep one connection; send WORD: send WORD on it; read: what comes back on it in
#   1.5 s -> the text / "timeout" / "closed" / "reset"
CLIENT = f"""
import errno, json, socket, sys, time
kept = None
def answer(x): print(json.dumps(x), flush=True)
for line in sys.stdin:
    cmd, arg = (line.split() + [""])[:2]
    if cmd == "try":
        try:
            socket.create_connection((arg, {PORT}), timeout=1.5).close(); answer("ok")
        except ConnectionRefusedError: answer("refused")
        except TimeoutError: answer("timeout")
        except OSError as e: answer("unreachable" if e.errno in (101, 113) else repr(e))
    elif cmd == "open":
        kept = socket.create_connection((arg, {PORT}), timeout=1.5); answer("ok")
    elif cmd == "send":
        kept.sendall(arg.encode()); answer("sent")
    elif cmd == "read":
        kept.settimeout(1.5)
        try: got = kept.recv(64); answer(got.decode() if got else "closed")
        except TimeoutError: answer("timeout")
        except ConnectionResetError: answer("reset")
    elif cmd == "keep":  # the node channel's keepalive on the kept connection
        from flashckpt.node_channel import keep_alive
        keep_alive(kept); answer("kept")
    elif cmd == "await":  # block reading for up to ARG seconds: what ends it, and when
        kept.settimeout(float(arg)); began = time.monotonic()
        try: got = kept.recv(64); what = got.decode() if got else "closed"
        except OSError as exc: what = "dead" if exc.errno == errno.ETIMEDOUT else "timeout"
        answer([what, round(time.monotonic() - began, 2)])
"""


@pytest.fixture
def hosts(request):
    """Simulated hosts, removed whatever the test did (their processes killed)."""
    if why := netns.unavailable():
        pytest.skip(why)
    made: list[netns.Hosts] = []

    def make(count: int, networks: int = 1) -> netns.Hosts:
        made.append(netns.Hosts(count, networks))
        return made[-1]

    try:
        yield make
    finally:
        for h in made:
            h.close()


class Talk:
    """A process in a host that answers one line for each line it is sent."""

    def __init__(self, hosts: netns.Hosts, host: int, code: str, *args: str):
        self.proc = hosts.popen(host, [sys.executable, "-c", code, *args], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip

    def line(self) -> str:
        return self.proc.stdout.readline().strip()

    def ask(self, command: str):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.line())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def test_hosts_have_their_own_stacks_and_their_faults_are_silent(hosts):
    h = hosts(2)
    a0, lo = h.address(0), "127.0.0.1"
    server = Talk(h, 0, SERVER, a0)
    assert server.line() == "serving"
    client = Talk(h, 1, CLIENT)
    try:
        assert client.ask(f"try {lo}") == "refused"  # host 1's own loopback: nothing there
        assert client.ask(f"try {a0}") == "ok"  # host 0's service on its switch address
        assert client.ask(f"open {a0}") == "ok"
        assert client.ask("send one") == "sent" and client.ask("read") == "one"
        for cut in (h.partition, h.unplug):
            cut(0)
            assert client.ask(f"try {a0}") in ("timeout", "unreachable"), cut  # no answer
            assert client.ask("send two") == "sent"
            assert client.ask("read") == "timeout", cut  # held: no reset, no close
            h.heal(0)
            assert client.ask("send three") == "sent"
            got, deadline = "", time.monotonic() + 15  # TCP retransmits within seconds
            while got != "twothree" and time.monotonic() < deadline:
                more = client.ask("read")
                assert more not in ("closed", "reset"), (cut, got, more)
                got += "" if more == "timeout" else more
            assert got == "twothree", cut  # what was held, then what followed
            assert client.ask(f"try {a0}") == "ok", cut
        assert h.pids(1) == [client.proc.pid]
    finally:
        client.close()
        server.close()
    assert h.pids(0) == h.pids(1) == []


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "data-in-flight"])
def test_a_node_channel_connection_to_a_silent_host_fails_within_seconds(hosts, in_flight):
    """The node channel's connections (the recovery store's relays, peer transfers) carry
    TCP keepalive and a send deadline: when the host at the other end falls silent, a read
    blocked on the connection fails with ETIMEDOUT within about 6 s, idle or with data
    unacknowledged, instead of waiting two hours (idle) or fifteen minutes (retransmitting)."""
    h = hosts(2)
    server = Talk(h, 0, SERVER, h.address(0))
    assert server.line() == "serving"
    client = Talk(h, 1, CLIENT)
    try:
        assert client.ask(f"open {h.address(0)}") == "ok"
        assert client.ask("keep") == "kept"
        h.partition(0)
        if in_flight:
            assert client.ask("send lost") == "sent"
        what, took = client.ask("await 30")
        assert what == "dead", (what, took)
        assert took < 12, took
    finally:
        client.close()
        server.close()


def claims(events: list[list[dict]]) -> dict[tuple[int, int], set[int]]:
    """(round, rank) -> the pids that held it, over every node's log."""
    held: dict[tuple[int, int], set[int]] = {}
    for e in (e for node in events for e in node if e["kind"] == "rank_claimed"):
        held.setdefault((e["round"], e["rank"]), set()).add(e["pid"])
    return held


def landed_after(pfs: Path, job: str, since: float) -> dict[int, list[str]]:
    """Step -> node 1's files (its ranks' data and manifests, its commit marker) that the
    shared tier got after ``since``."""
    out: dict[int, list[str]] = {}
    for path in sorted((pfs / job).glob("step-*/**/*")):
        rel = path.relative_to(pfs / job)
        ours = re.search(r"/rank-[23]/|/commit-node1\.json$", "/" + str(rel))
        if path.is_file() and ours and path.stat().st_mtime > since:
            step = int(rel.parts[0].split("-")[1].split(".")[0])
            out.setdefault(step, []).append(str(rel))
    return out


def taken_and_fenced(run, pfs: Path, job: str) -> float:
    """Node 1 was found lost and the spare (node 2) took it; no round had two processes of
    one rank; node 1's agent committed nothing to the shared tier after it was found lost,
    and every file of node 1's ranks that landed there since is of a step the spare committed.
    When node 1 was found lost."""
    lost = [e for e in run.events[0] if e["kind"] == "node_lost"]
    assert (lost[0]["action"], lost[0]["spares"]) == ("replace", {"node1": "node2"}), lost
    found_lost = lost[0]["time"]
    two = {k: pids for k, pids in claims(run.events).items() if len(pids) > 1}
    assert not two, (two, explain(run))
    late = [e for e in run.events[1] if e["kind"] == "tier_committed" and e["scope"] == "shared"
            and e["time"] > found_lost]  # fmt: skip
    assert not late, late
    spares = {e["step"] for e in run.events[2] if e["kind"] == "tier_committed"
              and e["scope"] == "shared"}  # fmt: skip
    landed = landed_after(pfs, job, found_lost)
    assert set(landed) <= spares, ({s: f for s, f in landed.items() if s not in spares}, spares)
    return found_lost


def start_spare_first(cluster) -> None:
    """Node 0 (the rendezvous, the controller and the recovery store), the spare until its
    standbys are warm, then node 1, until its rank 2 paused after step 12 with the step in its
    peer's memory: the pause is cut short of node 1's hang timeout, however slow the start."""

    def until(what, timeout: float) -> None:
        if not poll(what, timeout, 0.05):
            cluster.close()
            raise AssertionError("\n".join(
                f"--- {log.name} ---\n{log.read_text()[-3000:]}"
                for log in sorted(cluster.tmp.glob(f"{cluster.name}-node*.log"))))  # fmt: skip

    cluster.start(0)
    until(lambda: (cluster.run_dirs[0] / f"{cluster.job}.controller").exists(), 60)
    cluster.start(2)
    until(lambda: any(e["kind"] == "spare_ready" for e in cluster.events(2)), 180)
    cluster.start(1)
    until(lambda: (cluster.marks / "paused").exists(), 180)


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)  # with the reference run, on a loaded machine
def test_a_host_partitioned_and_healed_after_its_spare_took_it_is_fenced(hosts, tmp_path,
                                                                         reference):  # fmt: skip
    """2 nodes x 2 gloo ranks and a spare node, each in a host of its own, in-process recovery,
    the shared tier persisting every step: node 1's host is partitioned after step 12 (its
    processes alive), the spare takes its ranks, then the host is healed. Node 1's own ranks
    exit, nothing node 1 writes after it was found lost lands in the shared tier (the spare's
    writes of node 1's ranks do), no round ever has two processes of one rank, the job ends
    bit-identical to an undisturbed run, and the spare ran node 1 in-process throughout."""
    h = hosts(3)
    pfs = tmp_path / "part-pfs"
    cluster = spare_cluster(tmp_path, "part", hosts=h, FT_TIERS=f"pfs://{pfs}")
    try:
        start_spare_first(cluster)
        log1 = (tmp_path / "part-node1-1.log").read_text()
        originals = {int(r): int(p) for r, p in re.findall(r"restored ([23]) \S+ pid=(\d+)", log1)}
        assert sorted(originals) == [2, 3], log1[-3000:]
        cut = time.time()
        h.partition(1)
        # Found lost, and its ranks claimed in the next round by the spare's standbys: then the
        # heal, within that round's deadline (node 0's ranks wait in a collective with node 1's
        # until their connections close, issue 52: a longer partition ends in a full restart).
        assert poll(lambda: any(e["kind"] == "rank_claimed" for e in cluster.events(2)),
                    30, 0.1), explain(cluster.finish(1))  # fmt: skip
        h.heal(1)
        healed = time.time()
        gone = poll(lambda: all(is_dead(p) for p in originals.values()), 30, 0.1)
        gone_s = time.time() - healed
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish(240)
    print(
        f"partitioned, healed {healed - cut:.2f}s later; node 1's ranks gone {gone_s:.2f}s "
        f"after the heal ({gone}); exits {run.codes}"
    )
    for n, events in enumerate(run.events):
        print(f"node {n}:", [(round(e["time"] - cut, 2), e["kind"], e.get("reason", e.get("why", "")))
                             for e in events if e["time"] > cut and e["kind"] not in
                             ("tier_committed", "global_commit", "stepped")])  # fmt: skip
    assert gone, ({r: p for r, p in originals.items() if not is_dead(p)}, explain(run))
    assert run.codes[0] == run.codes[2] == 0, explain(run)
    taken_and_fenced(run, pfs, cluster.job)
    # Node 1's own processes ran no step of the job after it was found lost.
    assert not any(f"done {r} pid={p} " in run.logs[1] for r, p in originals.items()), explain(run)
    assert run.digest == reference
    # In-process throughout: the spare's round formed with node 0's ranks, nothing restarted.
    fallbacks = [e for ev in run.events for e in ev if e["kind"] == "inprocess_fallback"]
    assert not fallbacks, fallbacks
    taken = restores(run.events[2])
    assert sorted(taken) == [2, 3] and {e["step"] for e in taken.values()} == {12}, taken


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_a_host_that_loses_power_is_taken_by_the_spare_and_the_others_keep_their_processes(
    hosts, tmp_path, reference
):
    """Power lost: node 1's host is unplugged after step 12, then everything in it killed (its
    connections never close: node 0's ranks are blocked in a gloo collective on it). The
    spare takes its ranks; node 0's ranks are released by their round watch (it shuts down
    the round's connections) within the node timeout and keep their processes; every rank
    trains step 13 from step 12, nothing falls back, and the job ends bit-identical."""
    h = hosts(3)
    cluster = spare_cluster(tmp_path, "power", hosts=h)
    try:
        start_spare_first(cluster)
        cut = time.time()
        h.unplug(1)
        cluster.lose(1)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish(240)
    back = taken_by_the_spare(run, run.events[0], 1, reference, cut)
    print(f"unplugged, then killed -> every rank trained again: {back - cut:.2f}s")


def taken_by_the_spare(run, controller_events: list[dict], lost: int, reference: str,
                       cut: float) -> float:  # fmt: skip
    """Node ``lost`` of 2 (2 ranks each) was found lost and taken by the spare (node 2), in
    process: the other node's ranks kept their processes, every rank restored step 12, the
    job ended bit-identical. When the spare's ranks first trained after ``cut``."""
    kept_node = 1 - lost
    assert run.codes[kept_node] == run.codes[2] == 0, explain(run)
    found = [e for e in controller_events if e["kind"] == "node_lost"]
    assert (found[0]["action"], found[0]["spares"]) == ("replace", {f"node{lost}": "node2"}), found
    fallbacks = [e for ev in run.events for e in ev if e["kind"] == "inprocess_fallback"]
    assert not fallbacks, (fallbacks, explain(run))
    ranks = [2 * kept_node, 2 * kept_node + 1]
    for rank in ranks:  # the other node's ranks kept their processes through it
        assert len(pids_of(run.logs[kept_node], rank)) == 1, run.logs[kept_node][-3000:]
    kept, taken = restores(run.events[kept_node]), restores(run.events[2])
    assert {kept[r]["step"] for r in ranks} == {12}, kept
    assert sorted(taken) == [2 * lost, 2 * lost + 1], taken
    assert {e["step"] for e in taken.values()} == {12}, taken
    assert run.digest == reference
    back = first_step_after(run.events[2], cut)
    assert back is not None, explain(run)
    return back


def start_until_step(cluster, rank: int, step: int) -> None:
    """Node 0, the spare until its standbys are warm, then node 1, until ``rank`` saved
    ``step`` (its ``mark`` fault: a mark file and nothing else)."""

    def until(what, timeout: float) -> None:
        if not poll(what, timeout, 0.05):
            cluster.close()
            raise AssertionError(explain(cluster.finish(1)))

    cluster.start(0)
    until(lambda: (cluster.run_dirs[0] / f"{cluster.job}.controller").exists(), 60)
    cluster.start(2)
    until(lambda: any(e["kind"] == "spare_ready" for e in cluster.events(2)), 180)
    cluster.start(1)
    until(lambda: (cluster.marks / f"mark-{rank}-{step}").exists(), 180)


def training_cluster(h, tmp_path, name: str, **env: str):
    """2 nodes x 2 gloo ranks and a spare, in-process recovery, hang floor and node timeout
    3 s, steps of 0.3 s (the job still trains when a fault strikes after rank 2's step 12,
    its ``mark``)."""
    return spare_cluster(tmp_path, name, hosts=h, FT_FAULTS="mark:2:12", FT_STEP_S="0.3",
                         FLASHCKPT_HANG_FLOOR="3", **env)  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_a_host_cut_off_the_training_network_leaves_and_the_spare_takes_it(hosts, tmp_path,
                                                                          reference):  # fmt: skip
    """Two networks a host, as real clusters have: node 1's training network fails after step
    12 while its management network, agent and launcher are healthy. Every rank stalls in its
    collective; the nodes' probes of the training network (``reach``) find node 1 cut off: it
    is the culprit, whole, and it leaves the job (exit 78) instead of having a rank replaced
    by a standby that would stall again. The spare takes it; node 0's ranks keep their
    processes; the job ends bit-identical."""
    h = hosts(3, networks=2)
    cluster = training_cluster(h, tmp_path, "cutoff")
    try:
        start_until_step(cluster, 2, 12)
        cut = time.time()
        h.unplug(1, netns.TRAINING)
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish(240)
    from flashckpt.faults.reach import EXIT_CUT_OFF

    assert run.codes == [0, EXIT_CUT_OFF, 0], explain(run)
    left = [e for e in run.events[1] if e["kind"] == "node_cut_off"]
    assert left and left[0]["node"] == "node1", explain(run)
    killed = [e for ev in run.events for e in ev if e["kind"] == "killed" and e["time"] > cut]
    assert not killed, killed  # no rank replaced as hung: the node left whole
    lost = [e for e in run.events[0] if e["kind"] == "node_lost"]
    assert (lost[0]["action"], lost[0]["spares"]) == ("replace", {"node1": "node2"}), lost
    fallbacks = [e for ev in run.events for e in ev if e["kind"] == "inprocess_fallback"]
    assert not fallbacks, (fallbacks, explain(run))
    for rank in (0, 1):
        assert len(pids_of(run.logs[0], rank)) == 1, run.logs[0][-3000:]
    taken = restores(run.events[2])
    assert sorted(taken) == [2, 3] and {e["step"] for e in taken.values()} != {None}, taken
    assert run.digest == reference
    back = first_step_after(run.events[2], cut)
    print(f"training network cut -> node 1 left after {left[0]['time'] - cut:.2f}s, every rank "
          f"trained again after {back - cut:.2f}s")  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_a_host_cut_off_the_management_network_is_fenced_and_the_spare_takes_it(
    hosts, tmp_path, reference
):
    """Two networks a host: node 1's management network fails after step 12 (the controller,
    the rendezvous and the recovery store out of its reach) while its training network works
    and its ranks still train with node 0's. The controller finds node 1 lost and the spare
    takes it; node 0's ranks leave node 1's behind in the old round (its connections shut
    down by their round watch). Node 1's own processes end, none lands a commit in the shared
    tier after it was found lost, no round has two processes of one rank, and the job ends
    bit-identical. Node 1's launcher waits for the control plane (it cannot tell a partition
    from a controller restarting) until its network is healed, after the job ended: then it
    finds nothing to rejoin and ends too."""
    h = hosts(3, networks=2)
    pfs = tmp_path / "mgmt-pfs"
    cluster = training_cluster(h, tmp_path, "mgmt", FT_TIERS=f"pfs://{pfs}")
    try:
        start_until_step(cluster, 2, 12)
        log1 = (tmp_path / "mgmt-node1-1.log").read_text()
        originals = {int(r): int(p) for r, p in re.findall(r"restored ([23]) \S+ pid=(\d+)", log1)}
        cut = time.time()
        h.partition(1, netns.MANAGEMENT)
        ended = poll(lambda: all(cluster.procs[n].poll() is not None for n in (0, 2)), 240, 0.2)
        h.heal(1)  # the job ended: node 1 finds no store, controller or rendezvous any more
        healed = time.time()
        gone = poll(lambda: all(is_dead(p) for p in originals.values()), 60, 0.1)
        left = poll(lambda: cluster.procs[1].poll() is not None, 120, 0.2)
        left_s = time.time() - healed
    except BaseException:
        cluster.close()
        raise
    run = cluster.finish(10)
    assert gone, ({r: p for r, p in originals.items() if not is_dead(p)}, explain(run))
    assert ended and run.codes[0] == run.codes[2] == 0, explain(run)
    assert left and run.codes[1] == 1, explain(run)  # the rendezvous cannot be reached
    found_lost = taken_and_fenced(run, pfs, cluster.job)
    for rank in (0, 1):
        assert len(pids_of(run.logs[0], rank)) == 1, run.logs[0][-3000:]
    assert run.digest == reference
    back = first_step_after(run.events[2], cut)
    print(f"management network cut -> found lost after {found_lost - cut:.2f}s, every rank "
          f"trained again after {back - cut:.2f}s; healed after the job ended, node 1's "
          f"launcher exited {run.codes[1]} {left_s:.2f}s later")  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_node_0_losing_power_is_taken_by_the_spare_with_the_control_plane_off_the_nodes(
    hosts, tmp_path, reference
):
    """No host is special: the rendezvous (a real etcd server) and the controller with the
    recovery store (``flashckpt-agent controller``) run on a host of their own, as the README's
    multi-node launch has them. Node 0, the first training node, loses power after step 12
    (unplugged, then everything in it killed): the spare takes it like any other node, node
    1's ranks keep their processes, every rank trains step 13 from step 12, and the job ends
    bit-identical."""
    import control_plane
    from test_launcher import TOKEN

    if why := control_plane.unavailable():
        pytest.skip(why)
    h = hosts(4)
    control = control_plane.ControlPlane(tmp_path / "control", TOKEN, hosts=h, host=3)
    cluster = spare_cluster(tmp_path, "node0", hosts=h, control=control, FT_FAULTS="pause:0:12")
    try:
        for n in (2, 0, 1):  # the spare first: warm before the loss
            cluster.start(n)
        assert poll(lambda: (cluster.marks / "paused").exists(), 180), explain(cluster.finish(1))
        assert poll(lambda: any(e["kind"] == "spare_ready" for e in cluster.events(2)), 120)
        time.sleep(1.0)  # the spare's first reports reach the controller
        cut = time.time()
        h.unplug(0)
        cluster.lose(0)
        run = cluster.finish(240)
    finally:
        cluster.close()
        control.close()

    back = taken_by_the_spare(run, control.events(), 0, reference, cut)
    print(f"node 0 unplugged, then killed -> every rank trained again: {back - cut:.2f}s")


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_node_0_losing_power_without_a_spare_restarts_the_job_on_a_fresh_host(
    hosts, tmp_path, reference
):
    """The same loss with no spare, under the restart policy: node 0 (the first training node)
    loses power after step 12 and the scheduler starts a fresh host in its place. The control
    plane, off the nodes, finds it lost and has node 1's workers restarted; the job restarts
    whole, every rank resumes from step 12 (node 0's from its replica in node 1's memory) and
    ends bit-identical."""
    import control_plane
    from test_launcher import PEER, TOKEN, Cluster

    if why := control_plane.unavailable():
        pytest.skip(why)
    h = hosts(3)
    control = control_plane.ControlPlane(tmp_path / "control", TOKEN, hosts=h, host=2,
                                         policy="restart")  # fmt: skip
    cluster = Cluster(tmp_path, "node0r", ({}, {}), trainer=INPROCESS, hosts=h, control=control,
                      FT_TIERS=f"pfs://{tmp_path / 'node0r-pfs'}?every_steps=1000",
                      FT_WAIT_TIERS=PEER, FT_FAULTS="pause:0:12",
                      FLASHCKPT_RESTART_POLICY="restart", FLASHCKPT_NODE_TIMEOUT="3")  # fmt: skip

    def lost() -> list[dict]:
        return [e for e in control.events() if e["kind"] == "node_lost"]

    try:
        for n in (0, 1):
            cluster.start(n)
        assert poll(lambda: (cluster.marks / "paused").exists(), 180), explain(cluster.finish(1))
        cut = time.time()
        h.unplug(0)
        cluster.lose(0)
        assert poll(lost, 30), explain(cluster.finish(1))
        h.heal(0)
        cluster.start(0)  # a fresh host in its place
        run = cluster.finish(300)
    finally:
        cluster.close()
        control.close()
    assert run.codes == [0, 0], explain(run)
    assert lost()[0]["nodes"] == ["node0"] and lost()[0]["action"] == "kill", lost()
    back = {e["rank"]: e["step"] for ev in run.events for e in ev
            if e["kind"] == "restored" and e["time"] > cut}  # fmt: skip
    assert back == dict.fromkeys(range(4), 12), (back, explain(run))
    assert run.digest == reference
    print(f"node 0 unplugged, no spare -> found lost after {lost()[0]['time'] - cut:.2f}s, "
          f"every rank trained again after {max(first_step_after(ev, cut) for ev in run.events) - cut:.2f}s")  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_training_goes_on_while_the_control_plane_is_unreachable_for_30_seconds(
    hosts, tmp_path, reference
):
    """The control plane's host (etcd's rendezvous, the controller, the recovery store) is cut
    off the network for 30 s while two nodes train (a step a second). Nothing acts on it:
    the launchers wait for the rendezvous and the controller instead of exiting, the
    controller, hearing from no node at all, finds none lost, and the job trains through it
    (steps taken during the cut), restarts no worker and ends bit-identical."""
    import control_plane
    from test_launcher import TOKEN, Cluster

    if why := control_plane.unavailable():
        pytest.skip(why)
    h = hosts(3)
    control = control_plane.ControlPlane(tmp_path / "control", TOKEN, hosts=h, host=2)
    cluster = Cluster(tmp_path, "cpcut", ({}, {}), trainer=INPROCESS, hosts=h,
                      control=control, FT_FAULTS="mark:0:4,mark:0:20", FT_STEP_S="0.8",
                      FLASHCKPT_RESTART_POLICY="in-process", FLASHCKPT_NODE_TIMEOUT="3")  # fmt: skip
    try:
        for n in (0, 1):
            cluster.start(n)
        assert poll(lambda: (cluster.marks / "mark-0-4").exists(), 180), explain(cluster.finish(1))
        cut = time.time()
        h.partition(2)
        time.sleep(30)
        h.heal(2)
        healed = time.time()
        run = cluster.finish(240)
    finally:
        cluster.close()
        control.close()
    assert run.codes == [0, 0], explain(run)
    during = (cluster.marks / "mark-0-20").stat().st_mtime
    assert cut < during < healed, (during - cut, healed - cut)  # it trained through the cut
    for rank in range(4):
        assert len(pids_of(run.logs[rank // 2], rank)) == 1, explain(run)  # never restarted

    acted = [e for e in control.events() if e["kind"] in ("node_lost", "worker_failed")]
    assert not acted, acted
    assert run.digest == reference


@pytest.mark.slow
@pytest.mark.serial  # the node timeout is judged by the clock
@pytest.mark.timeout(600)
def test_two_hosts_losing_power_with_one_spare_restart_the_job_once_with_the_spare_in_it(
    hosts, tmp_path, reference3
):
    """Three training nodes, one spare, the control plane on a host of its own. Nodes 1 and 2
    lose power together after step 12: one spare cannot take both, so the job restarts whole,
    once. The spare joins the restart as one of them (the controller tells it to), the
    scheduler brings the other back on its host, and the job ends bit-identical."""
    import control_plane
    from test_launcher import TOKEN

    if why := control_plane.unavailable():
        pytest.skip(why)
    h = hosts(5)
    control = control_plane.ControlPlane(tmp_path / "control", TOKEN, hosts=h, host=4)
    cluster = spare_cluster(tmp_path, "twolost", nodes=4, hosts=h, control=control)
    try:
        for n in (3, 0, 1, 2):  # the spare first: warm before the loss
            cluster.start(n)
        assert poll(lambda: (cluster.marks / "paused").exists(), 180), explain(cluster.finish(1))
        assert poll(lambda: any(e["kind"] == "spare_ready" for e in cluster.events(3)), 120)
        time.sleep(1.0)  # the spare's first reports reach the controller
        for n in (1, 2):
            h.unplug(n)
        for n in (1, 2):
            cluster.lose(n)

        def lost() -> list[dict]:
            return [e for e in control.events() if e["kind"] == "node_lost"]

        def found() -> set[str]:
            return {n for e in lost() for n in e["nodes"]}

        assert poll(lambda: found() == {"node1", "node2"}, 60), explain(cluster.finish(1))
        # Found in one tick: one detection, and the spare joins the restart as one of them;
        # a tick apart: the spare takes the first, and joins the restart as it (its round
        # cannot form without the second).
        first = lost()[0]
        (joined, spare), *_ = (first.get("joining") or first.get("spares")).items()
        assert spare == "node3" and (first["action"] == "kill") == (len(first["nodes"]) == 2)
        back = 3 - int(joined.removeprefix("node"))  # the lost node the spare is not
        h.heal(back)
        cluster.start(back)  # the scheduler's fresh start of that node's task
        run = cluster.finish(300)
    finally:
        cluster.close()
        control.close()
    assert [run.codes[n] for n in (0, back, 3)] == [0, 0, 0], explain(run)
    for rank in (0, 1):  # node 0's ranks restarted once: one full restart
        assert len(pids_of(run.logs[0], rank)) == 2, run.logs[0][-3000:]
    assert re.search(rf"joins the (job's )?restart as (that )?node( {joined})?", run.logs[3]), (
        run.logs[3][-3000:])  # fmt: skip
    assert run.digest == reference3
    print(
        f"nodes 1 and 2 lost: {len(lost())} detection(s), the spare ran as {joined}, one "
        "full restart"
    )
