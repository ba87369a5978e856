"""Which store errors are retried, how often, and what the caller sees at the end; and the
refusal to write through a protocol without conditional writes. No server needed: the
errors are the real exception classes of botocore and aiohttp, raised by a callable."""

from __future__ import annotations

import errno
import sys
import time

import pytest

pytest.importorskip("s3fs", reason="the S3 extra (s3fs, botocore) is not installed")
from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402

from storage_backends import open_storage
from storage_backends.fsspec_store import FsspecStorage, is_transient


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def translated(error: ClientError) -> OSError:
    """The error as s3fs raises it: an OSError with the ClientError as its cause."""
    from s3fs.errors import translate_boto_error

    return translate_boto_error(error)


@pytest.mark.parametrize("error, transient", [
    (client_error("SlowDown", 503), True),
    (translated(client_error("SlowDown", 503)), True),
    (client_error("InternalError", 500), True),
    (translated(client_error("InternalError", 500)), True),
    (client_error("RequestTimeout", 408), True),
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
    (ConnectionResetError(errno.ECONNRESET, "reset by peer"), True),
    (TimeoutError("read timed out"), True),
    (client_error("NoSuchKey", 404), False),
    (client_error("AccessDenied", 403), False),
    (client_error("PreconditionFailed", 412), False),
    (translated(client_error("PreconditionFailed", 412)), False),
    (ValueError("bad argument"), False),
])
def test_transient_errors(error, transient):
    assert is_transient(error) is transient


def flaky(errors: list[BaseException], result: object = "done"):
    calls = []

    def fn():
        calls.append(time.monotonic())
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return fn, calls


@pytest.fixture
def store():
    return FsspecStorage("memory://retry-tests/root", retries=4, retry_delay=0.01)


def test_throttling_is_retried_with_backoff(store):
    fn, calls = flaky([client_error("SlowDown", 503), client_error("SlowDown", 503),
                       EndpointConnectionError(endpoint_url="http://x")])
    assert store._call("writing", "f", fn) == "done"
    assert len(calls) == 4
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    # 0.01 * 2**k with jitter in [half, full]: each wait at least half its nominal delay.
    assert all(g >= 0.005 * 2 ** k for k, g in enumerate(gaps)), gaps


def test_the_last_failure_is_an_oserror_with_the_cause_chained(store):
    cause = client_error("InternalError", 500)
    fn, calls = flaky([cause] * 10)
    with pytest.raises(OSError) as info:
        store._call("writing", "step-1/f", fn)
    assert len(calls) == 4
    assert type(info.value) is OSError and info.value.__cause__ is cause
    assert "after 4 attempts" in str(info.value) and "memory://retry-tests/root/step-1/f" in str(
        info.value)


def test_permanent_errors_are_not_retried(store):
    fn, calls = flaky([client_error("AccessDenied", 403)])
    with pytest.raises(OSError):
        store._call("reading", "f", fn)
    assert len(calls) == 1
    fn, calls = flaky([FileNotFoundError("gone")])
    with pytest.raises(FileNotFoundError):
        store._call("reading", "f", fn)
    assert len(calls) == 1


@pytest.fixture
def plain_protocol():
    """``plain://``: fsspec's local file system under a protocol name ckpt knows nothing of
    (``local://`` and ``file://`` open the POSIX backend), so it has no conditional write."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class PlainFileSystem(LocalFileSystem):
        protocol = ("plain",)

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            return super()._strip_protocol(path[len("plain://"):] if path.startswith(
                "plain://") else path)

    fsspec.register_implementation("plain", PlainFileSystem, clobber=True)
    yield "plain"
    sys.modules["fsspec.registry"]._registry.pop("plain", None)


def test_a_protocol_without_conditional_writes_refuses_writers(tmp_path, plain_protocol):
    url = f"{plain_protocol}://{tmp_path}/root"
    options = {"storage_options": {"auto_mkdir": True}}
    storage = open_storage(url, **options)
    storage.write("step-00000001/data", [b"x"])  # plain bytes are fine
    with pytest.raises(OSError, match="allow_unsafe_commit"):
        storage.lock({"host": "h", "pid": 1, "since": 0.0})
    staging = storage.begin("step-00000001", "tok")
    with pytest.raises(OSError, match="allow_unsafe_commit"):
        storage.commit(staging, "step-00000001", b"{}", "manifest.json")
    assert (tmp_path / "root" / "step-00000001" / "data").read_bytes() == b"x"  # there
    unsafe = open_storage(url, allow_unsafe_commit=True, **options)
    lock = unsafe.lock({"host": "h", "pid": 1, "since": 0.0})
    unsafe.commit(unsafe.begin("step-00000001", "tok"), "step-00000001", b"{}", "manifest.json")
    assert unsafe.read("step-00000001/manifest.json") == b"{}"
    lock.release()


def test_options_for_a_local_path_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not apply"):
        open_storage(str(tmp_path), storage_options={"anon": True})
    with pytest.raises(ValueError, match="no storage backend"):
        open_storage("nosuchproto://x/y")


def test_retries_end_at_the_operation_deadline_and_say_so():
    """However many retries are left, an operation gives up once its deadline has passed,
    with an ETIMEDOUT error that names the deadline; the store counts as unreachable until
    an operation succeeds again."""
    store = FsspecStorage("memory://retry-tests/deadline", retries=10_000, retry_delay=0.02,
                          deadline=0.3)
    fn, calls = flaky([client_error("SlowDown", 503)] * 10_000)
    with pytest.raises(OSError) as info:
        store._call("writing", "f", fn)
    assert info.value.errno == errno.ETIMEDOUT and "deadline of 0.3 s" in str(info.value)
    assert 1 < len(calls) < 10_000 and store.unreachable
    assert store._call("reading", "f", lambda: "back") == "back" and not store.unreachable


@pytest.mark.parametrize("name, value", [("deadline", 0), ("read_timeout", -1),
                                         ("connect_timeout", float("inf"))])
def test_deadlines_must_be_positive_seconds(name, value):
    with pytest.raises(ValueError, match=name):
        FsspecStorage("memory://retry-tests/bad", **{name: value})
