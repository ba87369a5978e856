"""One conformance suite for every storage backend: the byte methods, the save protocol
(begin/write/commit/abort), and the writer lock.

Backends: POSIX (tmp_path), fsspec ``memory://``, fsspec S3 (moto), tensorstore ``file`` and
tensorstore ``s3`` (moto). Where the backends differ by design (POSIX re-commits a step by
renaming the old one aside; object stores refuse), the test says so.
"""

from __future__ import annotations

import array
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from storage_backends import LockHeldError, Storage, open_storage
from storage_backends.lease import LEASE_NAME
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

def _param(kind: str):
    return pytest.param(kind, marks=pytest.mark.s3) if kind.endswith("s3") else kind


OBJECT_STORES = ["memory", "s3", "tensorstore-file", "tensorstore-s3"]
BACKENDS = [_param(k) for k in ["posix", *OBJECT_STORES]]
MANIFEST = "manifest.json"
OWNER = {"host": "test-host", "pid": 12345, "since": 1.0}


@pytest.fixture(params=BACKENDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def opener(kind, request, tmp_path):
    """Opens the test's root, a fresh handle per call (as another process would have)."""
    memory_root = f"memory://ckpt-{uuid.uuid4().hex}/root"
    endpoint = request.getfixturevalue("s3") if kind.endswith("s3") else None

    def open_(**options) -> Storage:
        if kind == "posix":
            return open_storage(str(tmp_path / "root"))
        if kind == "memory":
            return open_storage(memory_root, **options)
        if kind == "tensorstore-file":
            return open_storage(f"tensorstore+file://{tmp_path}/ts-root", **options)
        if kind == "s3":
            options.setdefault("block_size", 5 << 20)  # multipart from 5 MiB on
            return open_storage(endpoint.root("root"), storage_options=endpoint.storage_options,
                                **options)
        return open_storage(f"tensorstore+s3://{endpoint.bucket}/ts-root",
                            storage_options=endpoint.storage_options, **options)

    return open_


@pytest.fixture
def storage(opener) -> Storage:
    return opener()


def save(storage: Storage, name: str, token: str, files: dict[str, bytes],
         manifest: bytes | None = None) -> str:
    """begin + write; commit when a manifest is given. Returns the staging location."""
    staging = storage.begin(name, token)
    for fname, data in files.items():
        storage.write(f"{staging}/{fname}", [data])
    if manifest is not None:
        storage.commit(staging, name, manifest, MANIFEST)
    return staging


# ---------------------------------------------------------------------------------- bytes
# Files are written the way ckpt writes them: into a step's staging location, then committed
# (the POSIX backend creates directories only in ``begin``).


def committed(storage: Storage, name: str, files: dict[str, object]) -> str:
    staging = storage.begin(name, uuid.uuid4().hex[:12])
    for fname, data in files.items():
        parts = data if isinstance(data, list) else [data]
        assert storage.write(f"{staging}/{fname}", parts) == sum(
            memoryview(p).nbytes for p in parts)
    storage.commit(staging, name, b"{}", MANIFEST)
    return name


def test_write_read_size_exists(storage):
    floats = array.array("f", range(1000))
    parts = [b"head", bytearray(b"-mid-"), memoryview(floats)]
    expected = b"head-mid-" + floats.tobytes()
    committed(storage, "step-00000001", {"f.bin": parts})
    assert storage.read("step-00000001/f.bin") == expected
    assert storage.size("step-00000001/f.bin") == len(expected)
    assert storage.read("step-00000001/f.bin", 4, 5) == b"-mid-"
    assert storage.read("step-00000001/f.bin", len(expected) - 3) == expected[-3:]
    assert storage.read("step-00000001/f.bin", len(expected) - 3, 10) == expected[-3:]
    assert storage.read("step-00000001/f.bin", len(expected) + 10) == b""
    assert storage.exists("step-00000001/f.bin") and storage.exists("step-00000001")
    assert not storage.exists("step-00000002") and not storage.exists("step-00000001/g")
    storage.write("top.bin", [b"first"])
    storage.write("top.bin", [b"replaced"])  # write replaces the whole object
    assert storage.read("top.bin") == b"replaced"
    with pytest.raises(FileNotFoundError):
        storage.size("step-00000001/missing")
    with pytest.raises(FileNotFoundError):
        storage.read("step-00000001/missing")


@pytest.mark.parametrize("method", ["read_into", "read_range_into"])
def test_read_into_byte_ranges(storage, method):
    """``read_range_into`` (exactly the bytes asked for, past any read cache) reads as
    ``read_into`` does."""
    data = os.urandom(12 << 20)  # several multipart parts on S3 (5 MiB blocks)
    committed(storage, "step-00000001", {"big.bin": [data[:100], memoryview(data)[100:]]})
    path = "step-00000001/big.bin"
    read = getattr(storage, method)
    assert storage.size(path) == len(data)
    for start, n in [(0, 10), (7, 5 << 20), ((5 << 20) - 3, 6), (3 << 20, 8 << 20),
                     (len(data) - 4, 4), (9 << 20, 0)]:
        out = bytearray(n)
        read(path, start, memoryview(out))
        assert out == data[start:start + n], (start, n)
    with pytest.raises(EOFError):
        read(path, len(data) - 2, memoryview(bytearray(5)))
    with pytest.raises(EOFError):
        read(path, len(data) + 100, memoryview(bytearray(5)))
    with pytest.raises(FileNotFoundError):
        read("step-00000001/nope.bin", 0, memoryview(bytearray(5)))


def test_read_blocks_streams_byte_ranges(storage):
    data = os.urandom(300_000)
    committed(storage, "step-00000001", {"f.bin": [data]})
    path = "step-00000001/f.bin"
    for start, n, block in [(0, len(data), 65536), (17, 12_000, 999), (5, 0, 10)]:
        parts = list(bytes(p) for p in storage.read_blocks(path, start, n, bytearray(block)))
        assert b"".join(parts) == data[start:start + n], (start, n, block)
        assert all(0 < len(p) <= block for p in parts)
    with pytest.raises(EOFError):
        list(storage.read_blocks(path, len(data) - 10, 20, bytearray(8)))
    with pytest.raises(FileNotFoundError):
        list(storage.read_blocks("step-00000001/nope.bin", 0, 5, bytearray(8)))


def test_list_reports_directories(storage):
    committed(storage, "step-00000001", {"data-a": b"1", "data-b": b"2"})
    committed(storage, "step-00000010", {"data-c": b"3"})
    storage.write("top.txt", [b"4"])
    root = {(e.name, e.is_dir) for e in storage.list()}
    assert {("step-00000001", True), ("step-00000010", True), ("top.txt", False)} <= root
    assert {(e.name, e.is_dir) for e in storage.list("step-00000001")} == {
        ("data-a", False), ("data-b", False), (MANIFEST, False)}
    assert storage.list("no-such-dir") == []


def test_delete_file_and_directory(storage):
    committed(storage, "step-00000001", {"a": b"1", "b": b"2"})
    committed(storage, "step-00000010", {"a": b"3"})
    storage.delete("step-00000001/a")
    assert not storage.exists("step-00000001/a") and storage.exists("step-00000001/b")
    storage.delete("step-00000001")
    assert not storage.exists("step-00000001")
    assert storage.read("step-00000010/a") == b"3"  # a longer name with the same prefix stays
    storage.delete("step-00000001")  # missing: not an error
    storage.delete("never/was")


def test_processes_deleting_the_same_steps_at_once_all_succeed(kind, storage):
    """Every rank's retention may collect one root at the same time: a step's manifest, then
    its directory, deleted by several deleters at once, each finding some gone already (a
    file system's race: object stores get a few steps, to check their deletes too)."""
    if storage.url.startswith("tensorstore+file"):
        pytest.skip("tensorstore's file driver makes a file's directory again to lock it "
                    "while another deleter removes it; collect such a root from one process")
    steps = [f"step-{n:08d}" for n in range(1, 25 if kind == "posix" else 4)]
    for name in steps:
        committed(storage, name, {"a": b"1", "b": b"2"})
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def collect() -> None:
        start.wait()
        try:
            for name in steps:
                storage.delete(f"{name}/{MANIFEST}")
                storage.delete(f"{name}/a")
                storage.delete(name)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=collect) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not any(storage.exists(name) for name in steps)


# ---------------------------------------------------------------------------- save protocol


def test_commit_publishes_the_step(storage):
    staging = save(storage, "step-00000005", "tok1", {"data-tok1-r00000-000": b"payload"})
    assert not storage.exists(f"step-00000005/{MANIFEST}")  # invisible before the commit
    storage.commit(staging, "step-00000005", b'{"step": 5}', MANIFEST)
    assert storage.read(f"step-00000005/{MANIFEST}") == b'{"step": 5}'
    assert storage.read("step-00000005/data-tok1-r00000-000") == b"payload"
    assert ("step-00000005", True) in {(e.name, e.is_dir) for e in storage.list()}


def test_second_commit_of_a_step(storage, kind):
    save(storage, "step-00000007", "first", {"data-first-0": b"A"}, b'{"by": "first"}')
    staging = save(storage, "step-00000007", "second", {"data-second-0": b"B"})
    if kind in OBJECT_STORES:
        # The create-only write refuses, and the committed manifest is untouched.
        with pytest.raises(FileExistsError):
            storage.commit(staging, "step-00000007", b'{"by": "second"}', MANIFEST)
        storage.abort(staging)
        assert storage.read(f"step-00000007/{MANIFEST}") == b'{"by": "first"}'
        assert {e.name for e in storage.list("step-00000007")} == {"data-first-0", MANIFEST}
    else:
        # POSIX re-commits by renaming the old step aside (falling back past a bad step).
        storage.commit(staging, "step-00000007", b'{"by": "second"}', MANIFEST)
        assert storage.read(f"step-00000007/{MANIFEST}") == b'{"by": "second"}'


def test_abort_removes_only_this_attempt(storage, kind, opener):
    save(storage, "step-00000003", "kept", {"data-kept-0": b"K"}, b'{"by": "kept"}')
    other = opener()
    leftover = save(other, "step-00000004", "crashed", {"data-crashed-0": b"C"})
    staging = save(storage, "step-00000004", "failed", {"data-failed-0": b"F",
                                                          "data-failed-1": b"G"})
    storage.abort(staging)
    assert not storage.exists(f"step-00000004/{MANIFEST}")
    names = {e.name for e in storage.list(leftover)}
    assert "data-crashed-0" in names and not any("failed" in n for n in names)
    if kind in OBJECT_STORES:
        assert storage.uncommitted() == []  # a manifest-less step prefix is the GC's
    else:
        assert leftover in storage.uncommitted()
    assert storage.read("step-00000003/data-kept-0") == b"K"
    storage.abort(staging)  # twice: nothing left to do


def test_abort_after_commit_keeps_the_step(storage):
    staging = save(storage, "step-00000009", "tok", {"data-tok-0": b"D"}, b'{"tok": "tok"}')
    storage.abort(staging)  # engine: a fault right after the commit point
    assert storage.read(f"step-00000009/{MANIFEST}") == b'{"tok": "tok"}'
    assert storage.read("step-00000009/data-tok-0") == b"D"


# ------------------------------------------------------------------------------------ locks


def test_lock_is_exclusive(storage, opener):
    lock = storage.lock(OWNER)
    other = opener()
    with pytest.raises(LockHeldError) as info:
        other.lock({"host": "other", "pid": 2, "since": 2.0})
    assert info.value.holder.get("pid") == OWNER["pid"]
    assert info.value.holder.get("host") == OWNER["host"]
    lock.release()
    lock.release()  # idempotent
    second = other.lock({"host": "other", "pid": 2, "since": 2.0})
    with pytest.raises(LockHeldError):
        storage.lock(OWNER)
    second.release()


TTL = 1.0


@pytest.fixture
def object_store(kind, opener) -> Storage:
    return opener(lease_ttl=TTL)


# Leases are for object stores (POSIX uses flock, tested above).
leases = pytest.mark.parametrize("kind", [_param(k) for k in OBJECT_STORES], indirect=True)


def _write_lease(storage: Storage, **fields) -> None:
    body = {"host": "elsewhere", "pid": 1, "since": time.time() - 100, **fields}
    storage.write(LEASE_NAME, [json.dumps(body).encode()])


@leases
def test_expired_lease_is_taken_over(object_store):
    _write_lease(object_store, expires=time.time() - 1)  # a writer that died a while ago
    lock = object_store.lock(OWNER)
    holder = json.loads(object_store.read(LEASE_NAME))
    assert holder["pid"] == OWNER["pid"] and holder["expires"] > time.time()
    lock.release()
    assert not object_store.exists(LEASE_NAME)


@leases
def test_live_lease_is_renewed_and_refused(object_store, opener):
    lock = object_store.lock(OWNER)
    first = json.loads(object_store.read(LEASE_NAME))["expires"]
    deadline = time.monotonic() + 3 * TTL
    while json.loads(object_store.read(LEASE_NAME))["expires"] == first:
        assert time.monotonic() < deadline, "the lease was not renewed"
        time.sleep(0.05)
    with pytest.raises(LockHeldError):
        opener(lease_ttl=TTL).lock({"host": "rival", "pid": 2, "since": 0.0})
    lock.release()


@leases
def test_lease_of_a_dead_process_on_this_machine_is_stale_at_once(object_store):
    from storage_backends.lease import _this_machine

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    _write_lease(object_store, **_this_machine(), pid=int(child.stdout),
                 expires=time.time() + 3600)
    lock = object_store.lock(OWNER)
    assert json.loads(object_store.read(LEASE_NAME))["pid"] == OWNER["pid"]
    lock.release()


@leases
def test_a_lease_with_a_non_finite_expiry_or_an_impossible_pid_is_no_error(object_store):
    """ckpt writes neither: a lease expiring at NaN or Infinity held the root forever (it is
    taken over as any lease ckpt did not write), and one of this machine naming pid 2**64
    made taking the lock raise OverflowError (it is now held until it expires)."""
    from storage_backends.lease import _this_machine

    for expires in (float("nan"), float("inf")):
        _write_lease(object_store, expires=expires)
        lock = object_store.lock(OWNER)
        assert json.loads(object_store.read(LEASE_NAME))["pid"] == OWNER["pid"]
        lock.release()
    _write_lease(object_store, **_this_machine(), pid=2**64, expires=time.time() + 3600)
    with pytest.raises(LockHeldError):
        object_store.lock(OWNER)


@leases
def test_lost_lease_refuses_to_commit(object_store, opener):
    lock = object_store.lock(OWNER)
    staging = save(object_store, "step-00000001", "tok", {"data-tok-0": b"x"})
    lock._stop.set()  # renewal stops, as in a writer frozen for longer than the ttl
    time.sleep(TTL + 0.1)
    rival = opener(lease_ttl=TTL).lock({"host": "rival", "pid": 2, "since": 0.0})
    assert not lock.valid()
    with pytest.raises(OSError, match="lease"):
        object_store.commit(staging, "step-00000001", b"{}", MANIFEST)
    lock.release()  # must not delete the rival's lease
    assert json.loads(object_store.read(LEASE_NAME))["pid"] == 2
    rival.release()


@leases
def test_takeover_race_has_one_winner(object_store, opener):
    handles = [opener(lease_ttl=TTL) for _ in range(6)]
    for _ in range(3):  # rounds: a race is won or lost by microseconds
        _write_lease(object_store, expires=time.time() - 1)
        barrier = threading.Barrier(len(handles))
        won, lost = [], []

        def contend(i: int) -> None:
            barrier.wait()
            try:
                won.append(handles[i].lock({"host": f"racer-{i}", "pid": 1000 + i,
                                            "since": 0.0}))
            except LockHeldError:
                lost.append(i)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(handles))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == len(handles) - 1
        won[0].release()
