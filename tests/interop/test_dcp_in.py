"""ckpt.load of a PyTorch DCP checkpoint directory: any world size, sharded or not, and the
checkpoint's files checked before anything is loaded."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

import ckpt
from tests.interop import dcp_workers as w
from tests.support.ranks import run_ranks
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

# dcp.save/load in one process say that they assume one process: that is the intent here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_fsdp2_dcp_from_two_ranks_loads_on_three(fsdp_dcp):
    """Resharded 2 -> 3 ranks: model and optimizer state (by parameter name) equal."""
    path, expected = fsdp_dcp
    got = run_ranks(3, w.ckpt_load, path)
    w.assert_equal(expected, got[0]["state"])  # gathered from the three ranks' shards
    # each rank reads the stored chunks its shards overlap: the middle rank's rows straddle
    # both saved shards of every tensor, the first and last rank's only one
    read = [tuple(map(int, re.search(r"read (\d+) of its (\d+)", r["read"]).groups()))
            for r in got]
    assert read[1][0] == read[1][1]
    assert 0 < read[0][0] < 0.75 * read[0][1] and 0 < read[2][0] < 0.75 * read[2][1], read


def test_fsdp2_dcp_loads_in_one_process_into_a_plain_model(fsdp_dcp):
    path, expected = fsdp_dcp
    model, opt = w.build(None, seed=1)
    assert ckpt.load({"model": model, "optim": opt}, path) == 7  # from the name step-7
    w.assert_equal(expected, w.full_state(model, opt))


def test_a_model_optimizer_item_finds_model_and_optim_at_the_top_level(fsdp_dcp):
    path, expected = fsdp_dcp
    model, opt = w.build(None, seed=1)
    ckpt.load({"train": ckpt.ModelOptimizer(model, opt)}, path)
    w.assert_equal(expected, w.full_state(model, opt))


def test_dcp_without_a_state_returns_full_tensors(fsdp_dcp):
    path, expected = fsdp_dcp
    saved = ckpt.load(path)
    assert torch.equal(saved["model"]["0.weight"], torch.from_numpy(expected["model.0.weight"]))
    assert saved["optim"]["param_groups"][0]["lr"] == expected["lr"]


def test_a_model_saved_at_the_top_level_loads_into_an_item(tmp_path):
    """TorchTitan keeps the model's parameters at the checkpoint's top level."""
    import torch.distributed.checkpoint as dcp

    model, _ = w.build(None, seed=0)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    fresh, _ = w.build(None, seed=1)
    ckpt.load({"model": fresh}, tmp_path / "titan")
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_a_key_the_checkpoint_lacks_is_a_state_mismatch(fsdp_dcp):
    path, _ = fsdp_dcp
    with pytest.raises(ckpt.StateMismatchError, match="no key 'other'"):
        ckpt.load({"other": torch.zeros(3)}, path)


# Threat: whoever can write the checkpoint directory (a shared bucket, a downloaded run)
# chooses the bytes of `.metadata` and of every `.distcp` file.

class _RunsCode:
    """Unpickling this calls os.system: a .metadata that would run a command."""

    def __reduce__(self):
        return (__import__("os").system, (f"touch {_RunsCode.marker}",))


def _small_dcp(path, value=None) -> dict:
    import torch.distributed.checkpoint as dcp

    sd = {"model": {"w": torch.arange(1000.0), "b": torch.ones(3)}, "extra": value or {}}
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return sd


def test_a_metadata_pickle_that_would_run_code_is_refused_unrun(tmp_path):
    _small_dcp(tmp_path / "c")
    _RunsCode.marker = tmp_path / "ran"
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(ckpt.CorruptCheckpointError, match="posix.system.*not part of DCP"):
        ckpt.load({"model": {"w": torch.zeros(1000), "b": torch.zeros(3)}}, tmp_path / "c")
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.load(tmp_path / "c")
    assert not _RunsCode.marker.exists()


def test_a_metadata_entry_pointing_outside_the_directory_is_refused(tmp_path):
    _small_dcp(tmp_path / "c")
    raw = (tmp_path / "c" / ".metadata").read_bytes()
    (tmp_path / "c" / ".metadata").write_bytes(raw.replace(b"__0_0.distcp", b"../_0.distcp"))
    with pytest.raises(ckpt.CorruptCheckpointError, match="not a file inside"):
        ckpt.load(tmp_path / "c")


def test_a_truncated_distcp_is_refused_before_anything_is_loaded(tmp_path):
    _small_dcp(tmp_path / "c")
    data = tmp_path / "c" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    target = {"model": {"w": torch.zeros(1000), "b": torch.zeros(3)}}
    with pytest.raises(ckpt.CorruptCheckpointError, match="__0_0.distcp is truncated"):
        ckpt.load(target, tmp_path / "c")
    assert not target["model"]["w"].any()


def test_a_value_that_needs_pickle_loads_only_when_allowed(tmp_path):
    """DCP saves non-tensor values with torch.save; ckpt loads them weights_only unless
    allow_pickle=True."""
    from fractions import Fraction

    _small_dcp(tmp_path / "c", {"ratio": Fraction(1, 3)})
    with pytest.raises(ckpt.UnsupportedValueError, match="allow_pickle=True"):
        ckpt.load(tmp_path / "c")
    assert ckpt.load(tmp_path / "c", allow_pickle=True)["extra"]["ratio"] == Fraction(1, 3)


def test_a_dcp_checkpoint_on_s3_loads_through_fsspec(s3):
    """An object-store URL (fsspec) works as a local directory does, truncation included."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = s3.root("titan/step-5")
    sd = {"model": {"w": torch.arange(1000.0), "b": torch.ones(3)}}
    dcp.save(sd, storage_writer=FsspecWriter(url, **s3.storage_options), no_dist=True)
    target = {"model": {"w": torch.zeros(1000), "b": torch.zeros(3)}}
    assert ckpt.load(target, url, storage_options=s3.storage_options) == 5
    assert torch.equal(target["model"]["w"], sd["model"]["w"])
    data = next(k for k in s3.keys("titan/step-5/") if k.endswith(".distcp"))
    body = s3.client().get_object(Bucket=s3.bucket, Key=data)["Body"].read()
    s3.client().put_object(Bucket=s3.bucket, Key=data, Body=body[:-10])
    with pytest.raises(ckpt.CorruptCheckpointError, match="is truncated"):
        ckpt.load(target, url, storage_options=s3.storage_options)


def test_a_metadata_claiming_a_huge_tensor_is_refused_not_allocated(tmp_path):
    """Without a state, ckpt allocates what the metadata describes: no more than the
    (size-checked) files hold."""
    import torch.distributed.checkpoint.metadata as md

    _small_dcp(tmp_path / "c")
    meta = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    entry = meta.state_dict_metadata["model.w"]
    entry.size = torch.Size([1 << 40])
    entry.chunks = [md.ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 40]))]
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"model.w claims \[1099511627776\]"):
        ckpt.load(tmp_path / "c")
