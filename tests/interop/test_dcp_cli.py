"""``ckpt import`` of a DCP checkpoint (a step with digests) and ``ckpt export --to dcp``
(a directory ``dcp.load`` reads on any world size)."""

from __future__ import annotations

import pytest
import torch

import ckpt
from tests.interop import dcp_workers as w
from tests.support.ranks import run_ranks
from verify.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_an_imported_fsdp2_dcp_checkpoint_verifies_and_restores(fsdp_dcp, tmp_path, capsys):
    """The step has digests (`ckpt verify` passes; a flipped byte fails it) and restores
    into a ModelOptimizer equal to the original."""
    path, expected = fsdp_dcp
    root = tmp_path / "root"
    assert main(["import", path, str(root), "--item", "train"]) == 0
    assert "as step 7 of" in capsys.readouterr().out
    assert main(["verify", str(root), "--step", "7"]) == 0
    model, opt = w.build(None, seed=1)
    assert ckpt.load({"train": ckpt.ModelOptimizer(model, opt)}, root) == 7
    w.assert_equal(expected, w.full_state(model, opt))
    data = max((p for p in (root / "step-00000007").iterdir() if p.name != "manifest.json"),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["verify", str(root), "--step", "7"]) != 0


def test_an_exported_step_loads_with_dcp_load_on_two_ranks(fsdp_dcp, tmp_path):
    path, expected = fsdp_dcp
    root, out = tmp_path / "root", tmp_path / "out"
    assert main(["import", path, str(root), "--item", "train"]) == 0
    assert main(["export", str(root), "--to", "dcp", str(out), "--item", "train"]) == 0
    assert (out / ".metadata").is_file()
    w.assert_equal(expected, run_ranks(2, w.dcp_load, str(out))[0])


def test_an_export_on_two_ranks_spreads_the_tensors_and_loads_on_three(fsdp_dcp, tmp_path):
    path, expected = fsdp_dcp
    root, out = tmp_path / "root", tmp_path / "out"
    assert main(["import", path, str(root), "--item", "train"]) == 0
    run_ranks(2, w.ckpt_export, str(root), str(out))
    files = sorted(p.name for p in out.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    assert all((out / f).stat().st_size > 1000 for f in files[1:])  # both wrote a share
    w.assert_equal(expected, run_ranks(3, w.dcp_load, str(out))[0])


def test_an_imported_model_state_dict_loads_into_a_module(tmp_path):
    """A DCP checkpoint of a model's state dict alone (TorchTitan's model at the top level,
    or under a key) becomes a module item."""
    import torch.distributed.checkpoint as dcp

    model, _ = w.build(None, seed=0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert main(["import", str(tmp_path / "c"), str(tmp_path / "root"), "--step", "3"]) == 0
    fresh, _ = w.build(None, seed=1)
    assert ckpt.load({"model": fresh}, tmp_path / "root") == 3
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_import_of_a_hostile_metadata_fails_in_one_line(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    (tmp_path / "c" / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    assert main(["import", str(tmp_path / "c"), str(tmp_path / "root")]) == 1
    err = capsys.readouterr().err
    assert "os.system, which is not part of DCP's metadata" in err
    assert "Traceback" not in err and not (tmp_path / "root").exists()
