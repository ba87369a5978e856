"""Which errors of an object store are worth another try, and which are a refused condition.

Errors of botocore, aiohttp and fsspec are matched by name and by the HTTP status they carry:
importing them would make s3fs a hard dependency of every protocol.
"""

from __future__ import annotations

import errno

_RETRY_STATUS = (408, 429)
NOT_TRANSIENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                 NotADirectoryError, EOFError)
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                     errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.EREMOTEIO}
# Connection-level errors of botocore, aiohttp and fsspec.
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                    "ConnectTimeoutError", "HTTPClientError", "ClientConnectionError",
                    "ServerDisconnectedError", "ClientPayloadError", "ClientOSError",
                    "IncompleteReadError", "ResponseParserError", "FSTimeoutError",
                    "ProxyConnectionError", "ResponseStreamingError"}


def http_status(e: BaseException) -> int | None:
    """The HTTP status behind an exception of botocore, aiohttp or gcsfs, if any."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    for attr in ("status", "code"):
        value = getattr(e, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    return None


def _error_code(e: BaseException) -> str:
    for err in (e, e.__cause__):
        resp = getattr(err, "response", None)
        if isinstance(resp, dict):
            return str(resp.get("Error", {}).get("Code", ""))
    return ""


def is_transient(e: BaseException) -> bool:
    """Throttling, a 5xx, a timeout or a dropped connection: worth another try."""
    for _ in range(4):  # the error, and what it was raised from
        if e is None:
            return False
        status = http_status(e)
        if status is not None:
            return status in _RETRY_STATUS or status >= 500
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        if "SlowDown" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def precondition_failed(e: BaseException) -> bool:
    """A conditional write refused: the key exists, its version moved, or another
    conditional write on it is in flight (S3's 409 ConditionalRequestConflict)."""
    if isinstance(e, FileExistsError):
        return True
    return http_status(e.__cause__ or e) in (409, 412) or _error_code(e) in (
        "PreconditionFailed", "ConditionalRequestConflict")
