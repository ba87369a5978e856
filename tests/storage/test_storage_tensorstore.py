"""ckpt through the tensorstore backend: a manager saves, retires, restores and collects on
``tensorstore+file://`` and on ``tensorstore+s3://`` (moto), as it does on POSIX."""

from __future__ import annotations

import pytest
import torch

import ckpt
from storage_backends import open_storage
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def ts_root(request, tmp_path):
    """A function opening one tensorstore root (a fresh handle per call)."""
    if request.param == "file":
        return lambda: open_storage(f"tensorstore+file://{tmp_path}/root")
    endpoint = request.getfixturevalue("s3")
    return lambda: open_storage(f"tensorstore+s3://{endpoint.bucket}/root",
                                storage_options=endpoint.storage_options)


def test_manager_on_tensorstore(ts_root):
    torch.manual_seed(0)
    state = {"w": torch.randn(300, 70), "b": torch.randn(70).bfloat16(), "step": 0}
    with ckpt.CheckpointManager(ts_root(), options=ckpt.SaveOptions(incremental=True),
                                keep_last=2, schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        for step in (1, 2, 3):
            state["w"][step] += 1  # a little changes: the rest is referenced
            state["step"] = step
            mgr.save(step, state)
        mgr.wait()
        assert mgr.steps() == [2, 3]
    # A save that died before its commit leaves a manifest-less step; the next writer's
    # collection removes it.
    leftover = ts_root()
    leftover.write("step-00000004/data-0123456789ab-r00000-000.safetensors", [b"junk"])
    fresh = {"w": torch.zeros(300, 70), "b": torch.zeros(70).bfloat16(), "step": None}
    with ckpt.CheckpointManager(ts_root(), schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        assert not mgr.storage.exists("step-00000004")
        assert mgr.restore(fresh) == 3
    assert torch.equal(fresh["w"], state["w"]) and fresh["step"] == 3
    assert torch.equal(fresh["b"].view(torch.int16), state["b"].view(torch.int16))
