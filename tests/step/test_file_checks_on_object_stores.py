"""Before a restore reads data from an object store, each file it reads is checked: its size
and its safetensors header (``ckpt verify`` sizes every file of a step). Every check there
is a request, so the files are checked at once, not one round trip after another, and a
header costs one request, not two (its length, then the header)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import ckpt
from ckpt._format.names import step_dir
from ckpt._load import reader
from ckpt._step import headers
from ckpt._step.headers import check_headers
from ckpt._step.integrity import check_structure, read_manifest
from storage_backends import open_storage
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3
pytest.importorskip("s3fs", reason="the S3 extra (s3fs, botocore) is not installed")

FILES = 4


@pytest.fixture
def step(s3):
    """A step saved on S3 in four data files: (its storage, its manifest, its chunks as
    (key, chunk))."""
    root = s3.root("checks")
    with ckpt.CheckpointManager(root, async_save=False, storage_options=s3.storage_options,
                                options=ckpt.SaveOptions(write_threads=FILES)) as mgr:
        mgr.save(1, {f"t{i}": torch.rand(64, 1024) for i in range(8)})
    storage = open_storage(root, create=False, storage_options=s3.storage_options)
    manifest = read_manifest(storage, step_dir(1), 1)
    assert len(manifest.files) == FILES
    reads = [(key, c) for key, e in manifest.tensors.items() for c in e.chunks]
    return storage, manifest, reads


def meeting(storage, *methods: str, parties: int) -> None:
    """Make each call of the ``methods`` of ``storage`` wait until ``parties`` calls of
    them are in flight: checks made one after another fail with BrokenBarrierError after
    5 s."""
    barrier = threading.Barrier(parties, timeout=5)
    for method in methods:
        real = getattr(storage, method)

        def waiting(*args, real=real, **kwargs):
            barrier.wait()
            return real(*args, **kwargs)

        setattr(storage, method, waiting)


def counted(storage, method: str) -> list:
    """Record the calls of ``storage.method``."""
    calls: list = []
    real = getattr(storage, method)

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    setattr(storage, method, counting)
    return calls


def test_the_sizes_of_an_object_stores_files_are_asked_for_at_once(step):
    storage, manifest, reads = step
    meeting(storage, "size", parties=FILES)
    check_structure(storage, step_dir(1), manifest, [c for _, c in reads])


def test_the_full_structure_check_sizes_an_object_stores_files_at_once(step):
    """``ckpt verify``'s check of every file of the step."""
    storage, manifest, _ = step
    meeting(storage, "size", parties=FILES)
    check_structure(storage, step_dir(1), manifest)


def test_the_headers_of_an_object_stores_files_are_read_at_once(step):
    storage, manifest, reads = step
    meeting(storage, "read", parties=FILES)
    check_headers(storage, step_dir(1), manifest, reads)


def test_a_restore_reads_the_headers_while_it_asks_for_the_sizes(step):
    """All of a restore's checks of the four files are in flight at once: four sizes and
    four headers."""
    storage, manifest, reads = step
    meeting(storage, "size", "read", parties=2 * FILES)
    reader._check_files(storage, step_dir(1), manifest,
                        [SimpleNamespace(key=key, chunk=c) for key, c in reads])


def test_a_header_costs_one_request_and_a_larger_one_two(step, monkeypatch):
    """The first request asks for a prefix that holds the length and the header; a header
    longer than the prefix is read with a second request, and agrees all the same."""
    storage, manifest, reads = step
    calls = counted(storage, "read")
    check_headers(storage, step_dir(1), manifest, reads)
    assert len(calls) == FILES, calls
    monkeypatch.setattr(headers, "HEADER_PREFIX", 64)  # (each header here: ~1 KiB)
    calls.clear()
    check_headers(storage, step_dir(1), manifest, reads)
    assert len(calls) == 2 * FILES, calls


def test_a_damaged_header_among_files_checked_at_once_names_its_file(step, s3):
    """Of two damaged headers, the error names the first file in path order, whichever
    check ends first."""
    storage, manifest, reads = step
    paths = sorted(f"{step_dir(1)}/{name}" for name in manifest.files)
    for path in (paths[1], paths[3]):
        data = bytearray(s3.client().get_object(Bucket=s3.bucket,
                                                Key=f"checks/{path}")["Body"].read())
        data[:8] = (1 << 40).to_bytes(8, "little")  # a header length past the file's end
        s3.client().put_object(Bucket=s3.bucket, Key=f"checks/{path}", Body=bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="does not fit the file") as info:
        check_headers(storage, step_dir(1), manifest, reads)
    assert info.value.path.endswith(paths[1]), info.value.path


def test_a_missing_file_is_named_missing_though_its_header_was_read_at_once(step, s3):
    """The header's read of a deleted file fails too, at the same time: the size check's
    error, which says the file is missing, is the one raised."""
    storage, manifest, reads = step
    path = sorted(f"{step_dir(1)}/{name}" for name in manifest.files)[2]
    s3.client().delete_object(Bucket=s3.bucket, Key=f"checks/{path}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="is missing") as info:
        reader._check_files(storage, step_dir(1), manifest,
                            [SimpleNamespace(key=key, chunk=c) for key, c in reads])
    assert info.value.path.endswith(path), info.value.path
