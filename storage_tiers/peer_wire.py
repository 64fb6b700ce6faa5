"""The replica channel between node agents: framing, the handshake, TLS contexts.

A connection starts with a ``hello`` naming the job and carrying its token; the holder
answers ``ok`` or an error and hangs up. Then requests go one at a time, each a header (four
bytes of length, then a JSON object) and for ``put`` and ``get`` the raw bytes after it:

- ``put {key, size}``: the holder answers ``ok`` (room made, send) or an error; the bytes
  follow; it answers ``ok`` once they are stored whole, under their key, atomically;
- ``get {key, start, end}``: ``ok {size}`` and that many bytes (sent by the kernel from the
  holder's memory, ``sendfile``), or an error;
- ``list {prefix}``: ``ok {keys}``; ``delete {prefix}``: ``ok``.

Errors carry a ``code``: ``auth`` (wrong token or job), ``missing`` (no such object), ``full``
(the holder's memory would run out), ``bad`` (a malformed request), ``failed``.
Both sides treat everything read as untrusted: headers are bounded and must be JSON objects.
"""

from __future__ import annotations

import json
import os
import ssl
import struct
from typing import Any

from flashckpt.errors import ConfigError

MAX_HEADER = 1 << 20  # a listing of thousands of keys fits; more is not a header
PIECE = 8 << 20  # bytes moved per socket call
_LEN = struct.Struct(">I")


class WireError(Exception):
    """A request the other side refused, or a broken exchange; ``code`` says which."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def encode(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def decode_length(raw: bytes) -> int:
    (n,) = _LEN.unpack(raw)
    if n > MAX_HEADER:
        raise WireError("bad", f"a header of {n} bytes (at most {MAX_HEADER})")
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
    return _raise(code, f"{where}: {reply.get('error', 'refused')}")


def _raise(code: str, message: str) -> dict[str, Any]:
    raise WireError(code, message)


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server, client) contexts where the controller's TLS is configured (the same files:
    ``FLASHCKPT_CONTROLLER_TLS_CERT``, ``..._KEY``, ``..._CA``), else None. Peers are reached
    by address, so the client checks the certificate's chain, not its name; the job's token
    is checked on top."""
    cert = os.environ.get("FLASHCKPT_CONTROLLER_TLS_CERT")
    key = os.environ.get("FLASHCKPT_CONTROLLER_TLS_KEY")
    ca = os.environ.get("FLASHCKPT_CONTROLLER_TLS_CA") or cert
    if not cert and not ca:
        return None
    if not (cert and key):
        raise ConfigError(
            "replicas between nodes use the controller's TLS files: set both "
            "FLASHCKPT_CONTROLLER_TLS_CERT and FLASHCKPT_CONTROLLER_TLS_KEY on every node"
        )
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server.load_cert_chain(cert, key)
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"the TLS files for replicas cannot be used: {exc}") from None
    client.check_hostname = False  # peers by address; the chain and the token are checked
    return server, client
