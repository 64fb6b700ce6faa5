"""An in-process cluster for peer-replica tests: a real controller and one real replica store
per named node, this process acting as any one of the nodes (``Nodes.as_node``)."""

from __future__ import annotations

import asyncio
import threading
import uuid

from flashckpt.agent import replicas as replicas_module
from flashckpt.agent.controller import Controller, InThread
from flashckpt.proto import controller_pb2 as pb

from flashckpt.faults import control

TOKEN = "peer-tests-" + uuid.uuid4().hex


class Nodes:
    """A controller and one replica store per named node; ``as_node`` makes this process
    that node (its name, its run directory with the controller's endpoint)."""

    def __init__(self, tmp_path, monkeypatch, job: str, names: list[str]):
        self.tmp, self.mp, self.job = tmp_path, monkeypatch, job
        # With the controller's TLS files set, the controller and the stores use them.
        tls = control.Tls.from_env(server=True)
        self.tls = tls is not None
        self.controller = InThread(Controller(), "127.0.0.1:0", TOKEN, tls)
        self.address = f"127.0.0.1:{self.controller.start_serving()}"
        self.stores: dict[str, replicas_module.ReplicaStore] = {}
        self.loop = asyncio.new_event_loop()
        for name in names:
            run_dir = self.run_dir(name)
            shm = tmp_path / f"shm-{name}"
            shm.mkdir()
            store = replicas_module.ReplicaStore(job, shm, run_dir, node=name)
            self.loop.run_until_complete(store.start("127.0.0.1"))
            self.stores[name] = store
            self.report_address(name, store.address)

    def run_dir(self, name: str):
        path = self.tmp / f"run-{name}"
        if not path.exists():
            path.mkdir(mode=0o700)
            control.Endpoint(self.address, TOKEN, self.tls).save(path, self.job)
        return path

    def as_node(self, name: str) -> None:
        self.mp.setenv("FLASHCKPT_NODE", name)
        self.mp.setenv("FLASHCKPT_RUN_DIR", str(self.run_dir(name)))

    def serve(self) -> None:
        """Let the stores answer while the test's own event loops run elsewhere."""
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def call(self, coro):
        """Run ``coro`` on the stores' event loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop_store(self, name: str) -> None:
        """``name``'s replica store stops serving (its agent died); what it holds stays in
        its memory, and the controller still lists it."""
        self.call(self.stores[name].close(remove=False))

    def restart_store(self, name: str) -> None:
        """``name``'s store serves again, on the same address, what it held."""
        store = self.stores[name]
        self.call(store.start("127.0.0.1", int(store.address.rsplit(":", 1)[1])))

    def report_address(self, name: str, address: str) -> None:
        """The controller learns that ``name`` serves replicas at ``address``."""
        self.controller.controller.report(pb.NodeReport(
            job=self.job, node=name, agent_id=f"{name}-a", peer_address=address))  # fmt: skip

    def close(self) -> None:
        for store in self.stores.values():
            asyncio.run_coroutine_threadsafe(store.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.controller.stop()
