"""The one framing and handshake of every node-to-node service (the replica store, the
recovery store's gate).

A frame is four bytes of big-endian length and a JSON object. Before a connection is
authenticated its frames are at most ``HELLO_LIMIT`` bytes; after, ``MAX_HEADER``.

Both sides prove that they hold the job's token (the controller's), and the token never crosses
the wire. With C the client, S the server, K the token:

1. C sends ``hello {v, service, job, node, holder, nonce}``: the service it wants, the job, its
   own node name, the node it believes it reaches, and 32 fresh random bytes (hex);
2. S answers ``{ok, nonce, proof}``: fresh bytes of its own and
   ``HMAC-SHA256(K, "server" | service | job | node | holder | C's nonce | S's nonce)``;
3. C checks S's proof (whoever binds a dead holder's port learns nothing and is not believed)
   and sends ``{proof}``, the same MAC labelled ``"client"``;
4. S checks it and answers ``{ok}``; the node name is now bound to the connection.

Both nonces are in both proofs, so a recorded exchange cannot be replayed, and the labels
differ, so a proof cannot be reflected back in the other direction. Errors carry a ``code``:
``auth``, ``missing``, ``full``, ``bad``, ``busy``, ``failed``. Everything read is untrusted:
lengths are bounded before anything is buffered, and headers must be JSON objects.

The token proves membership of the job: a process holding it may claim any node name of the
job, as it may reach any node's shared memory through that node. Confidentiality of the bytes
needs TLS (the controller's certificate files, see ``tls_contexts``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import ssl
import struct
import time
from typing import Any

from flashckpt import config
from flashckpt.errors import ConfigError

VERSION = 1
HELLO_LIMIT = 4 << 10  # a frame before authentication: a hello is a few hundred bytes
MAX_HEADER = 1 << 20  # after it: a listing of thousands of keys fits; more is not a header
NONCE_BYTES = 32
_LEN = struct.Struct(">I")


class WireError(Exception):
    """A request the other side refused, or a broken exchange; ``code`` says which."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# ---- frames ---------------------------------------------------------------------------------
def encode(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def decode_length(raw: bytes, limit: int = MAX_HEADER) -> int:
    (n,) = _LEN.unpack(raw)
    if n > limit:
        raise WireError("bad", f"a header of {n} bytes (at most {limit})")
    return n


def decode(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise WireError("bad", "a header that is not JSON") from None
    if not isinstance(doc, dict):
        raise WireError("bad", "a header that is not a JSON object")
    return doc


def checked(reply: dict[str, Any], where: str) -> dict[str, Any]:
    """``reply`` if it says ok; else WireError with its code and message."""
    if reply.get("ok") is True:
        return reply
    code = reply.get("code") if isinstance(reply.get("code"), str) else "failed"
    raise WireError(code, f"{where}: {reply.get('error', 'refused')}")


def refusal(code: str, error: str) -> bytes:
    return encode({"ok": False, "code": code, "error": error})


# ---- the handshake, apart from any I/O ------------------------------------------------------
def _proof(token: bytes, side: str, fields: tuple[str, ...], nc: bytes, ns: bytes) -> str:
    text = "\0".join((f"flashckpt node channel v{VERSION}", side, *fields))
    return hmac.new(token, text.encode() + b"\0" + nc + ns, hashlib.sha256).hexdigest()


def _nonce(doc: dict, where: str) -> bytes:
    raw = doc.get("nonce")
    try:
        nonce = bytes.fromhex(raw) if isinstance(raw, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise WireError("bad", f"{where}: a nonce that is not {NONCE_BYTES} bytes of hex")
    return nonce


class ClientHandshake:
    """The client's side: ``hello()``, then ``answer(reply)`` for S's challenge (it checks S's
    proof), then ``done(reply)``."""

    def __init__(self, token: str, service: str, job: str, node: str, holder: str):
        self.token, self.fields = token.encode(), (service, job, node, holder)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.where = f"{service} of node {holder or '?'}"

    def hello(self) -> bytes:
        service, job, node, holder = self.fields
        return encode({"op": "hello", "v": VERSION, "service": service, "job": job,
                       "node": node, "holder": holder, "nonce": self.nonce.hex()})  # fmt: skip

    def answer(self, challenge: dict) -> bytes:
        checked(challenge, self.where)
        theirs = _nonce(challenge, self.where)
        want = _proof(self.token, "server", self.fields, self.nonce, theirs)
        got = challenge.get("proof")
        if not isinstance(got, str) or not hmac.compare_digest(got, want):
            raise WireError("auth", f"{self.where} did not prove that it holds the job's token: "
                                    "it is not the job's node (an old address taken over?)")  # fmt: skip
        return encode({"proof": _proof(self.token, "client", self.fields, self.nonce, theirs)})

    def done(self, reply: dict) -> None:
        checked(reply, self.where)


class ServerHandshake:
    """The server's side: ``challenge(hello)`` checks the hello and answers it; ``check(reply)``
    checks the client's proof. WireError (code ``auth`` or ``bad``) where either fails."""

    def __init__(self, token: str, service: str, job: str | None, me: str):
        self.token, self.service, self.job, self.me = token.encode(), service, job, me
        self.fields: tuple[str, ...] = ()
        self.nonces = (b"", b"")
        self.node = ""

    def challenge(self, hello: dict) -> bytes:
        if hello.get("op") != "hello" or hello.get("v") != VERSION:
            raise WireError("bad", f"not a hello of version {VERSION}")
        if hello.get("service") != self.service:
            raise WireError("bad", f"this port serves {self.service}, not {hello.get('service')!r}")
        job, node, holder = hello.get("job"), hello.get("node"), hello.get("holder")
        try:
            if job != "" or self.job is not None:  # a service of every job takes none
                config.validate_name("job", job)
            config.validate_name("node", node)
        except ConfigError as exc:
            raise WireError("bad", str(exc)) from None
        if self.job is not None and job != self.job:
            raise WireError("auth", "wrong job or token")
        if holder not in ("", self.me):
            raise WireError("bad", f"this is node {self.me}, not {holder!r}")
        theirs, mine = _nonce(hello, "hello"), secrets.token_bytes(NONCE_BYTES)
        self.fields, self.nonces, self.node = (
            (self.service, job, node, holder),
            (theirs, mine),
            node,
        )
        proof = _proof(self.token, "server", self.fields, theirs, mine)
        return encode({"ok": True, "nonce": mine.hex(), "proof": proof})

    def check(self, reply: dict) -> str:
        """The client's node name, once its proof is right."""
        want = _proof(self.token, "client", self.fields, *self.nonces)
        got = reply.get("proof")
        if not isinstance(got, str) or not hmac.compare_digest(got, want):
            raise WireError("auth", "wrong job or token")
        return self.node


# ---- a blocking client ------------------------------------------------------------------------
def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, out: memoryview, piece: int = 8 << 20) -> None:
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got : got + piece])
        if not n:
            raise WireError("failed", "the other side hung up mid-transfer")
        got += n


def recv_frame(sock: socket.socket, where: str, limit: int = MAX_HEADER) -> dict:
    n = decode_length(recv_exact(sock, 4), limit)
    return checked(decode(recv_exact(sock, n)), where)


def shake_hands(sock: socket.socket, hands: ClientHandshake) -> None:
    """Run the client's handshake on a connected blocking socket."""
    sock.sendall(hands.hello())
    n = decode_length(recv_exact(sock, 4), HELLO_LIMIT)
    sock.sendall(hands.answer(decode(recv_exact(sock, n))))
    hands.done(recv_frame(sock, hands.where, HELLO_LIMIT))


async def read_frame(reader: Any, limit: int = MAX_HEADER) -> dict:
    """One frame from an ``asyncio.StreamReader``, at most ``limit`` bytes buffered."""
    n = decode_length(await reader.readexactly(4), limit)
    return decode(await reader.readexactly(n))


# ---- connections ----------------------------------------------------------------------------
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 3, 1, 3
BULK_SEND_S = 30.0  # a replica's transfer: see keep_alive


def keep_alive(sock: socket.socket | None, idle: int = KEEPALIVE_IDLE_S,
               interval: int = KEEPALIVE_INTERVAL_S, count: int = KEEPALIVE_COUNT,
               send_s: float | None = None) -> None:  # fmt: skip
    """TCP keepalive and a send deadline on ``sock``: a peer that lost power, or was cut off
    the network, is noticed within about ``idle + interval * count`` seconds (6 by default)
    when the connection is idle (keepalive probes go unanswered), and within ``send_s`` (the
    same by default) when it has data in flight (``TCP_USER_TIMEOUT``: unacknowledged that
    long, or a window kept shut that long, it fails), not after the kernel's two hours or its
    fifteen minutes of retransmissions. Bulk transfers give ``send_s`` more room: a busy
    receiver may leave its window shut for a few seconds."""
    if sock is None:
        return
    send_s = idle + interval * count if send_s is None else send_s
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                        ("TCP_KEEPCNT", count),
                        ("TCP_USER_TIMEOUT", int(1000 * send_s))):  # fmt: skip
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Refusals:
    """Warnings about refused clients, at most one per ``every`` seconds: the first at once, the
    rest summed up in the next (a flood of bad clients cannot flood the log)."""

    def __init__(self, log: logging.Logger, what: str, every: float = 10.0):
        self.log, self.what, self.every = log, what, every
        self.count = 0  # in all
        self._since, self._last, self._quiet = 0, float("-inf"), 0

    def refused(self, peer: object, why: str) -> None:
        self.count += 1
        self._quiet += 1
        now = time.monotonic()
        if now - self._last < self.every:
            return
        more = f" ({self._quiet - 1} more since the last warning)" if self._quiet > 1 else ""
        self.log.warning("%s: refused a connection from %s: %s%s", self.what, peer, why, more)
        self._last, self._quiet = now, 0


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server, client) contexts where the controller's TLS is configured (the same files:
    ``FLASHCKPT_CONTROLLER_TLS_CERT``, ``..._KEY``, ``..._CA``), else None. A client checks
    the chain, and the name in the certificate against the node it reaches where
    ``FLASHCKPT_PEER_TLS_NAMES=1`` (certificates issued per node name); the handshake's
    proofs are checked on top."""
    cert = os.environ.get("FLASHCKPT_CONTROLLER_TLS_CERT")
    key = os.environ.get("FLASHCKPT_CONTROLLER_TLS_KEY")
    ca = os.environ.get("FLASHCKPT_CONTROLLER_TLS_CA") or cert
    if not cert and not ca:
        return None
    if not (cert and key):
        raise ConfigError(
            "connections between nodes use the controller's TLS files: set both "
            "FLASHCKPT_CONTROLLER_TLS_CERT and FLASHCKPT_CONTROLLER_TLS_KEY on every node"
        )
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server.load_cert_chain(cert, key)
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"the TLS files for connections between nodes cannot be used: {exc}"
        ) from None
    client.check_hostname = tls_checks_names()
    return server, client


def tls_checks_names() -> bool:
    return config.setting_bool("peer_tls_names", None, False)
