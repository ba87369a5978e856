"""An S3 endpoint that stops answering (a moto server process frozen with SIGSTOP) while a
restore reads the newest step: the restore fails with the storage's error naming the object
and the deadline (a ``StorageError``, or a ``PartialLoadError`` when live tensors were
already written, which says so), and does not fall back to an older step (which would
resume silently from older weights because of a network stall). Once the endpoint answers
again the same restore loads the newest step, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import ckpt
from storage_backends import fsspec_store
from tests.support.moto_process import frozen_moto, moto_bucket  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3
pytest.importorskip("s3fs", reason="the S3 extra (s3fs, botocore) is not installed")

OPTIONS = {"deadline": 2.0, "connect_timeout": 0.5, "read_timeout": 1.0}


def state(step: int) -> dict:
    return {"w": torch.full((1 << 16,), float(step)), "k": torch.arange(100.0) + step}


@pytest.mark.parametrize("incremental", [False, True])
def test_a_store_frozen_during_a_restore_fails_it_without_falling_back(
        moto_bucket, monkeypatch, incremental):
    endpoint = moto_bucket
    options = {**endpoint.storage_options, **OPTIONS}
    with ckpt.CheckpointManager(endpoint.root("run"), async_save=False, storage_options=options,
                                options=ckpt.SaveOptions(incremental=incremental)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), force=True)

    read_into = fsspec_store.FsspecStorage.read_into
    armed = [True]

    def freezing_read_into(self, path, *args, **kwargs):
        if armed and "data-" in str(path):  # the first data read: the store stops answering
            armed.clear()
            endpoint.freeze()
        return read_into(self, path, *args, **kwargs)

    monkeypatch.setattr(fsspec_store.FsspecStorage, "read_into", freezing_read_into)
    into = state(0)
    with ckpt.CheckpointManager(endpoint.root("run"), read_only=True,
                                storage_options=options) as ro:
        try:
            with pytest.raises((ckpt.StorageError, ckpt.PartialLoadError),
                               match="deadline") as failed:
                ro.restore(into)
        finally:
            endpoint.thaw()
        assert not armed, "the restore read no data through read_into"
        assert isinstance(failed.value.__cause__, OSError)  # the store's, not a damaged step
        assert "step 3" in str(failed.value)  # no older step was tried in its place
        assert ro.restore(into) == 3
    assert torch.equal(into["w"], state(3)["w"]) and torch.equal(into["k"], state(3)["k"])
