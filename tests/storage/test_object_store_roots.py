"""Opening a root on an object store that is not there: a read-only manager refuses a root
in a bucket that does not exist (as it refuses a missing directory) instead of restoring
nothing, and a writer's error gives the advice of an object store, not of a file system."""

from __future__ import annotations

import uuid

import pytest
import torch

import ckpt
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3
pytest.importorskip("s3fs", reason="the S3 extra (s3fs, botocore) is not installed")


def missing_bucket_root(endpoint) -> str:
    return f"s3://ckpt-missing-{uuid.uuid4().hex[:12]}/run"


def test_a_read_only_restore_from_a_missing_bucket_raises_not_found(s3):
    root = missing_bucket_root(s3)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="does not exist") as info:
        with ckpt.CheckpointManager(root, read_only=True,
                                    storage_options=s3.storage_options) as mgr:
            mgr.restore({"w": torch.zeros(3)})
    assert info.value.path == root


def test_a_read_only_root_that_exists_on_the_store_still_opens(s3):
    root = s3.root("run")
    with ckpt.CheckpointManager(root, storage_options=s3.storage_options) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    into = {"w": torch.zeros(3)}
    with ckpt.CheckpointManager(root, read_only=True,
                                storage_options=s3.storage_options) as mgr:
        assert mgr.restore(into) == 1
    assert torch.equal(into["w"], torch.ones(3))


def test_a_writer_on_a_missing_bucket_gets_object_store_advice(s3):
    root = missing_bucket_root(s3)
    with pytest.raises(ckpt.StorageError) as info:
        ckpt.CheckpointManager(root, storage_options=s3.storage_options)
    message = str(info.value)
    assert "does not exist" in message and "bucket exists" in message
    assert "symbolic link" not in message and "free space" not in message


def test_a_writer_on_an_unwritable_directory_keeps_the_file_system_advice(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ckpt.StorageError) as info:
        ckpt.CheckpointManager(blocker / "root")
    assert "symbolic link named .lock" in str(info.value)
