"""How the S3 tier reads an error: the S3 code and HTTP status behind it, and whether a retry
can help (throttling, 5xx, dropped connections) or it is permanent (denied, missing)."""

from __future__ import annotations

import asyncio

import aiohttp
import botocore.exceptions
from fsspec.exceptions import FSTimeoutError

TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestThrottled",
    "TooManyRequestsException",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "ConditionalRequestConflict",  # a conditional write raced another on the key: try again
}
UNSUPPORTED_CODES = {"NotImplemented"}
"""What a store that has no conditional writes answers to If-None-Match (HTTP 501)."""
DENIED_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "403",
}
TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ConnectionError,
    aiohttp.ClientError,
    ConnectionError,
    asyncio.TimeoutError,
    FSTimeoutError,
)


def client_error(exc: BaseException) -> botocore.exceptions.ClientError | None:
    """The ClientError behind ``exc`` (a wrapper may carry it as its cause)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, botocore.exceptions.ClientError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def error_code(exc: BaseException) -> tuple[str, int]:
    """S3 error code and HTTP status of ``exc``, or ``("", 0)`` when it is not an S3 reply."""
    err = client_error(exc)
    if err is None:
        return "", 0
    return str(err.response.get("Error", {}).get("Code", "")), int(
        err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    )


def describe(exc: BaseException) -> str:
    """``SlowDown (HTTP 503): message`` for S3 replies, the exception's repr otherwise."""
    code, status = error_code(exc)
    return f"{code or 'error'} (HTTP {status}): {exc}" if code or status else repr(exc)


def transient(exc: BaseException) -> bool:
    code, status = error_code(exc)
    if code in UNSUPPORTED_CODES:  # a 501: the store lacks the feature, no retry gives it
        return False
    if code or status:
        return code in TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(exc, TRANSIENT_TYPES)
