"""How a node reaches the job's controller: its address, the shared token, optional TLS.

``flashckpt-run`` writes ``<run_dir>/<job>.controller`` (mode 0600, in the private run dir)
with the address and token it resolved; the node agent and the CLI read it, so an agent that
outlived an earlier launch follows the current one. Settings, each also an argument of
``flashckpt-agent controller``:

- ``FLASHCKPT_CONTROLLER``: ``host:port`` of the controller. Default under ``flashckpt-run``:
  the rendezvous endpoint's host and its port + 1 (standalone: 127.0.0.1, any free port).
- ``FLASHCKPT_CONTROLLER_TOKEN`` or ``FLASHCKPT_CONTROLLER_TOKEN_FILE`` (a file only its
  owner can read): the secret every agent presents. Required across nodes; a standalone
  launch makes a random one.
- ``FLASHCKPT_CONTROLLER_TLS_CERT`` and ``..._TLS_KEY`` (the controller's certificate and
  key) turn TLS on; agents verify it against ``FLASHCKPT_CONTROLLER_TLS_CA`` (default: the
  certificate itself).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from .. import config
from ..errors import ConfigError
from ..safe_paths import open_file, write_atomic

MIN_TOKEN = 16


def file_path(run_dir: Path, job: str) -> Path:
    return run_dir / f"{job}.controller"


def launcher_path(run_dir: Path, job: str) -> Path:
    """The job's launcher claim on this node: a pid file its flashckpt-run holds locked (not
    ``*.pid``, which names the agents' claims)."""
    return run_dir / f"{job}.launcher"


def split_address(address: str, what: str = "FLASHCKPT_CONTROLLER") -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``[v6]:port``; ConfigError naming ``what``."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what} must be host:port, got {address!r}")
    return host, int(port)


def controller_address(args) -> str:
    """FLASHCKPT_CONTROLLER, else the rendezvous host with the rendezvous port + 1 (any free
    port on 127.0.0.1 when standalone)."""
    if os.environ.get("FLASHCKPT_CONTROLLER"):
        split_address(os.environ["FLASHCKPT_CONTROLLER"])  # host:port, or ConfigError
        return os.environ["FLASHCKPT_CONTROLLER"]
    if args.standalone or not args.rdzv_endpoint:
        return "127.0.0.1:0"
    endpoint = args.rdzv_endpoint if ":" in args.rdzv_endpoint else f"{args.rdzv_endpoint}:29400"
    host, port = split_address(endpoint, "--rdzv-endpoint")
    return f"[{host}]:{port + 1}" if ":" in host else f"{host}:{port + 1}"


def read_secret(path: str, what: str) -> bytes:
    """A secret file's bytes, refused unless it is a regular file only its owner can read."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{what} {path} can be read by others (mode {stat.filemode(st.st_mode)}); "
                f"run 'chmod 600 {path}'"
            )
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc}") from None


def token_from_env() -> str | None:
    """The token of FLASHCKPT_CONTROLLER_TOKEN or ..._TOKEN_FILE; None if neither is set."""
    token = os.environ.get("FLASHCKPT_CONTROLLER_TOKEN")
    path = os.environ.get("FLASHCKPT_CONTROLLER_TOKEN_FILE")
    if path and token is None:
        token = read_secret(path, "FLASHCKPT_CONTROLLER_TOKEN_FILE").decode().strip()
    if token is None:
        return None
    if len(token) < MIN_TOKEN:
        raise ConfigError(
            f"the controller token has {len(token)} characters; use at least {MIN_TOKEN} "
            "random ones (e.g. 'openssl rand -hex 32')"
        )
    return token


@dataclass(frozen=True)
class Tls:
    cert: bytes  # PEM
    key: bytes | None  # the controller's; None on the agents' side
    ca: bytes

    @classmethod
    def from_env(cls, server: bool) -> Tls | None:
        cert_path = os.environ.get("FLASHCKPT_CONTROLLER_TLS_CERT")
        ca_path = os.environ.get("FLASHCKPT_CONTROLLER_TLS_CA") or cert_path
        if not cert_path and not ca_path:
            return None
        key_path = os.environ.get("FLASHCKPT_CONTROLLER_TLS_KEY")
        if server and not (cert_path and key_path):
            raise ConfigError(
                "TLS for the controller needs both FLASHCKPT_CONTROLLER_TLS_CERT and "
                "FLASHCKPT_CONTROLLER_TLS_KEY"
            )
        cert = _read_pem(cert_path) if cert_path else b""
        key = read_secret(key_path, "FLASHCKPT_CONTROLLER_TLS_KEY") if server else None
        return cls(cert, key, _read_pem(ca_path))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca)


def _read_pem(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"TLS file {path} cannot be read: {exc}") from None


@dataclass(frozen=True)
class Endpoint:
    """Where the controller is and how to talk to it."""

    address: str
    token: str
    tls: bool = False

    def save(self, run_dir: Path, job: str) -> Path:
        path = file_path(run_dir, job)
        write_atomic(path, json.dumps(self.__dict__).encode())
        return path

    @classmethod
    def load(cls, run_dir: Path, job: str) -> Endpoint | None:
        """The endpoint a launcher on this node wrote; None if there is none or it does not
        parse (a torn or foreign file is no endpoint: the node runs without a controller)."""
        try:
            fd = open_file(file_path(run_dir, job), os.O_RDONLY)
        except (OSError, ConfigError):
            return None
        try:
            doc = json.loads(os.read(fd, 1 << 16))
            address, token, tls = doc["address"], doc["token"], bool(doc.get("tls", False))
            split_address(str(address))
            if not isinstance(token, str) or len(token) < MIN_TOKEN:
                return None
            return cls(str(address), token, tls)
        except (ValueError, KeyError, TypeError, ConfigError):
            return None
        finally:
            os.close(fd)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def channel(self) -> grpc.aio.Channel:
        if self.tls:
            tls = Tls.from_env(server=False)
            if tls is None:
                raise ConfigError(
                    f"the controller at {self.address} uses TLS: set FLASHCKPT_CONTROLLER_TLS_CA"
                )
            return grpc.aio.secure_channel(self.address, tls.channel_credentials(),
                                           options=CHANNEL_OPTIONS)  # fmt: skip
        return grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)


# Keepalive on every channel to the controller and on its side of them: an HTTP/2 ping every
# KEEPALIVE_MS, idle or not, and a channel whose ping goes unanswered for KEEPALIVE_TIMEOUT_MS
# fails its calls. An agent, spare or launcher whose controller lost power (no FIN, no RST)
# knows within about 5 s, and the controller is rid of a silent node's streams as fast,
# instead of waiting for TCP to give up (some 15 minutes).
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 2000, 3000
# A channel that lost its controller dials again at most RECONNECT_MAX_MS apart, each dial
# given at least RECONNECT_MIN_MS: gRPC's own backoff grows to two minutes and its first dial
# may wait 20 s for a host that does not answer, so after a 30 s cut a node was heard again
# 9 s after the heal, and found lost by a controller that had heard the others (it gives the
# rest the node timeout and ``REDIAL_S`` to be heard).
RECONNECT_MIN_MS, RECONNECT_MAX_MS = 1000, 2000
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_MIN_MS),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_MIN_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Any ping unanswered this long fails the channel (the bandwidth probe's too, 60 s by
    # default: a keepalive is not sent while it is outstanding).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
SERVER_OPTIONS = (
    *CHANNEL_OPTIONS,
    # Accept the clients' pings at that pace without calling it abuse (a GOAWAY otherwise).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)


POLICIES = ("restart", "in-process", "notify")
"""restart: a failure restarts every worker; in-process: a lost worker is replaced and the
others keep their processes (a lost node still restarts everyone); notify: report only."""


def policy() -> str:
    value = str(config.setting("restart_policy", None, "restart")).lower()
    if value not in POLICIES:
        raise ConfigError(
            f"FLASHCKPT_RESTART_POLICY must be one of {', '.join(POLICIES)}, got {value!r}"
        )
    return value


def job_status(endpoint: Endpoint, job: str, timeout: float = 3.0):
    """The controller's view of ``job`` (a ``JobStatusReply``); grpc.aio.AioRpcError if it
    does not answer."""
    import asyncio

    from ..proto import controller_pb2 as pb
    from ..proto import controller_pb2_grpc as pb_grpc

    async def go():
        async with endpoint.channel() as channel:
            return await pb_grpc.ControllerStub(channel).JobStatus(
                pb.JobStatusRequest(job=job), metadata=endpoint.metadata(), timeout=timeout
            )

    return asyncio.run(go())
