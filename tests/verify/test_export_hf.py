"""``ckpt export ROOT --to hf DIR`` without transformers: the folder's files, index and
printed counts agree; tied weights once; config.json from the step's metadata; no absolute
paths. (tests/e2e/test_integrations.py loads such a folder with from_pretrained.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import ckpt
from verify import cli


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(50, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.wte.weight


def make_root(tmp_path, metadata=None):
    torch.manual_seed(0)
    model = Tied()
    with ckpt.CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        mgr.save(3, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1),
                     "epoch": 1}, metadata=metadata)
    return model


def test_export_to_hf_writes_shards_index_and_config(tmp_path, capsys):
    model = make_root(tmp_path, {"hf_config": {"model_type": "tiny", "n_embd": 16}})
    out = tmp_path / "hf"
    assert cli.main(["export", str(tmp_path / "root"), "--to", "hf", str(out),
                     "--max-shard-size", "4KB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == report["shards"] and len(shards) == 2
    assert shards[0] == "model-00001-of-00002.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert len(index["weight_map"]) == report["tensors"] == 3  # wte, mix.weight, mix.bias
    assert report["tied"] == {"head.weight": "wte.weight"}
    assert json.loads((out / "config.json").read_text()) == {"model_type": "tiny", "n_embd": 16}
    loaded = {}
    for shard in shards:
        loaded.update(load_file(out / shard))
    expected = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in expected.values())
    text = "".join(p.read_text(errors="replace") for p in out.iterdir())
    assert str(tmp_path) not in text  # no absolute paths in the metadata


def test_export_to_hf_without_config_says_so_and_refuses_an_existing_folder(tmp_path, capsys):
    make_root(tmp_path)
    out = tmp_path / "hf"
    assert cli.main(["export", str(tmp_path / "root"), "--to", "hf", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 tensors in 1 shard (" in printed and "no config.json" in printed
    assert not (out / "config.json").exists()
    assert cli.main(["export", str(tmp_path / "root"), "--to", "hf", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "root"), "--to", "hf", str(out), "--force"]) == 0
    assert cli.main(["export", str(tmp_path / "root"), "--to", "hf", str(tmp_path / "x"),
                     "--max-shard-size", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err


def test_export_to_hf_of_a_damaged_step_leaves_nothing(tmp_path, capsys):
    make_root(tmp_path)
    step = tmp_path / "root/step-00000003"
    doc = json.loads((step / "manifest.json").read_bytes())
    chunk = doc["tensors"]["model/mix.weight"]["chunks"][0]
    path = step / chunk["file"]
    raw = bytearray(path.read_bytes())
    raw[chunk["start"] + 2] ^= 0x01
    path.write_bytes(bytes(raw))
    assert cli.main(["export", str(tmp_path / "root"), "--to", "hf", str(tmp_path / "hf")]) == 1
    assert "digest mismatch" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_export_to_hf_without_a_model_item_names_the_items_holding_tensors(tmp_path, capsys):
    model = torch.nn.Linear(4, 2)
    ckpt.save({"state_dict": model.state_dict(), "epoch": 3, "rng": ckpt.RNGState()},
              str(tmp_path / "lightning-like"))
    assert cli.main(["export", str(tmp_path / "lightning-like"), "--to", "hf",
                     str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "name the model with --item (items holding tensors: state_dict;" in err
    assert cli.main(["export", str(tmp_path / "lightning-like"), "--to", "hf",
                     str(tmp_path / "hf"), "--item", "state_dict"]) == 0
    exported = load_file(str(tmp_path / "hf/model-00001-of-00001.safetensors"))
    assert torch.equal(exported["weight"], model.weight.detach())


@pytest.mark.parametrize("text,expected", [("5GB", 5 * 10**9), ("1MiB", 2**20), ("123", 123)])
def test_shard_sizes_parse(text, expected):
    from verify.export_hf import parse_size

    assert parse_size(text) == expected
