"""An S3 endpoint that stops answering (a moto server process frozen with SIGSTOP) just after
a step is committed, while the retention that follows deletes an older step: the save
succeeds (its step is committed; the retention's failure is a warning, never "the save is
still running" nor the save's error, and ``wait()`` returns), and once the endpoint answers
again the next save commits and the retention catches up. (A store's ETIMEDOUT is an ``OSError`` that Python
makes a ``TimeoutError``, the very class a wait that ran out raises.)
"""

from __future__ import annotations

import logging

import pytest
import torch

import ckpt
from storage_backends import fsspec_store
from tests.support.moto_process import frozen_moto, moto_bucket  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3
pytest.importorskip("s3fs", reason="the S3 extra (s3fs, botocore) is not installed")

OPTIONS = {"deadline": 2.0, "connect_timeout": 0.5, "read_timeout": 1.0, "lease_ttl": 1.5}


def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step))}


def test_a_store_frozen_during_retention_leaves_the_manager_usable(moto_bucket, monkeypatch,
                                                                    caplog):
    caplog.set_level(logging.WARNING, logger="ckpt")
    endpoint = moto_bucket
    delete = fsspec_store.FsspecStorage.delete
    armed = []

    def freezing_delete(self, path, *args, **kwargs):
        if armed:  # the retention after step 3's commit: the store stops answering here
            armed.clear()
            endpoint.freeze()
        return delete(self, path, *args, **kwargs)

    monkeypatch.setattr(fsspec_store.FsspecStorage, "delete", freezing_delete)
    mgr = ckpt.CheckpointManager(endpoint.root("run"), keep_last=1, async_save=True,
                                 storage_options={**endpoint.storage_options, **OPTIONS})
    try:
        for step in (1, 2):
            mgr.save(step, state(step), force=True).wait()
            mgr.wait()  # and the retention after it
        armed.append(True)
        handle = mgr.save(3, state(3), force=True)
        handle.wait()  # committed: its handle does not wait for the retention
        mgr.wait()  # which fails, and says so, but is not the save's failure
        assert handle.exception() is None
        assert not armed, "the retention never deleted anything"
        assert any(r.getMessage().startswith("ckpt.retention failed after step 3 was committed")
                   for r in caplog.records)
        endpoint.thaw()
        mgr.save(4, state(4), force=True).wait()  # not wedged behind step 3's handle
        mgr.wait()
        assert mgr.steps() == [4]
    finally:
        endpoint.thaw()
        mgr.close()
    into = state(0)
    with ckpt.CheckpointManager(endpoint.root("run"), read_only=True,
                                storage_options={**endpoint.storage_options, **OPTIONS}) as ro:
        assert ro.restore(into) == 4
    assert torch.equal(into["w"], state(4)["w"])
