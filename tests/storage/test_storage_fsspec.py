"""The fsspec object store: reads follow its own writes and deletes, sizes and listings see
objects only, a server that is down is an I/O error, uploads stay within S3's limit of parts."""

from __future__ import annotations

import os
import uuid

import pytest

from storage_backends import s3_upload
from storage_backends.fsspec_store import READ_BLOCK, FsspecStorage
from tests.support.s3_fixture import _moto, s3_restartable  # noqa: F401  (fixtures)


def test_an_object_stores_reads_follow_its_own_writes_and_deletes():
    """An object store's reads follow its own writes and deletes: a read after a rewrite or a delete
    by this very instance (of the object or of the directory above it) never returns bytes cached
    before it."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root")
    out = memoryview(bytearray(16))
    storage.write("step-1/f", [b"a" * 64])
    storage.read_into("step-1/f", 8, out)
    assert bytes(out) == b"a" * 16
    storage.write("step-1/f", [b"b" * 64])
    storage.read_into("step-1/f", 8, out)
    assert bytes(out) == b"b" * 16
    storage.delete("step-1")  # the directory: its files go with it
    with pytest.raises(FileNotFoundError):
        storage.read_into("step-1/f", 8, out)


@pytest.mark.s3
def test_a_large_read_from_a_server_that_is_down_is_an_io_error_not_a_short_object(
        s3_restartable):
    """A read of 8 MiB or more while the server is unreachable is the I/O error it is, not the
    EOFError of a truncated object (which a restore takes for corruption and skips the step)."""
    endpoint = s3_restartable
    storage = FsspecStorage(endpoint.root("run"), storage_options=endpoint.storage_options,
                            retries=1)
    size = READ_BLOCK + 4096
    storage.write("blob", [bytes(size)])
    out = memoryview(bytearray(size))
    storage.read_into("blob", 0, out)
    endpoint.stop()
    try:
        with pytest.raises(OSError, match="reading .*/blob failed"):
            storage.read_into("blob", 0, out)
    finally:
        endpoint.start()


def test_an_object_store_sizes_only_objects_and_lists_only_what_lies_under_a_path():
    """An object store sizes objects only (a prefix is a directory, not an empty file) and lists
    only what lies under a path (never the object itself as its own child)."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root")
    storage.write("step-1/f", [b"a" * 64])
    assert storage.size("step-1/f") == 64
    with pytest.raises(IsADirectoryError):
        storage.size("step-1")
    assert storage.list("step-1/f") == []
    assert [e.name for e in storage.list("step-1")] == ["f"]


@pytest.mark.s3
def test_a_huge_object_is_uploaded_in_no_more_parts_than_s3_allows(s3_restartable,
                                                                   monkeypatch):
    """A huge object is uploaded in no more parts than S3 allows (10,000; lowered here to 2): 12 MiB
    in 5 MiB blocks goes up in two parts of 6 MiB, not three (S3's ETag of a multipart object ends
    in its number of parts)."""
    monkeypatch.setattr(s3_upload, "PART_LIMIT", 2)
    endpoint = s3_restartable
    storage = FsspecStorage(endpoint.root("run"), storage_options=endpoint.storage_options,
                            block_size=5 << 20)
    data = os.urandom(12 << 20)
    storage.write("blob", [data])
    etag = endpoint.client().head_object(Bucket=endpoint.bucket, Key="run/blob")["ETag"]
    assert etag.strip('"').endswith("-2"), etag
    assert storage.read("blob") == data


@pytest.mark.s3
def test_objects_of_every_size_round_trip_through_single_and_multipart_uploads(
        s3_restartable):
    """ckpt uploads request by request: nothing, a part, a part and one byte, and several
    buffers that straddle part boundaries all come back byte for byte."""
    endpoint = s3_restartable
    storage = FsspecStorage(endpoint.root("run"), storage_options=endpoint.storage_options,
                            block_size=5 << 20)
    part = 5 << 20
    cases = {"empty": [b""], "empties": [b"", b""], "one-part": [os.urandom(part)],
             "part-and-a-byte": [os.urandom(part + 1)],
             "straddling": [os.urandom(3 << 20), b"", os.urandom(4 << 20), os.urandom(5)]}
    for name, buffers in cases.items():
        assert storage.write(name, buffers) == sum(len(b) for b in buffers)
        assert storage.read(name) == b"".join(buffers), name
    assert endpoint.client().list_multipart_uploads(Bucket=endpoint.bucket).get(
        "Uploads", []) == []
