"""A model, also an FSDP2-sharded one, initialised from a Hugging Face folder of
safetensors shards, each rank reading only its shards' slices."""

from __future__ import annotations

import json

import pytest
import torch

import ckpt
import ckpt.interop
from tests.interop import hf_workers as w
from tests.support.ranks import run_ranks
from verify.cli import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> tuple[str, torch.Tensor]:
    path = str(tmp_path_factory.mktemp("hf") / "gpt2")
    return path, w.save_folder(path, max_shard_size="100KB")


def test_a_sharded_gpt2_is_initialised_reading_about_its_share(gpt2_folder):
    path, logits = gpt2_folder
    index = json.load(open(f"{path}/model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1  # really several shards
    results = run_ranks(2, w.sharded_init, path)
    for r in results:
        assert torch.equal(torch.from_numpy(r["logits"]), logits)
        # each rank reads about half of the weights (the folder also holds headers)
        assert 0.4 < r["bytes_read"] / r["folder_bytes"] < 0.6, r
    assert sum(r["bytes_read"] for r in results) <= results[0]["folder_bytes"]


def test_ckpt_load_of_the_folder_into_a_plain_model_gives_from_pretrained_logits(gpt2_folder):
    from transformers import GPT2LMHeadModel

    path, logits = gpt2_folder
    torch.manual_seed(1)
    model = GPT2LMHeadModel(w.config()).eval()
    assert ckpt.load({"model": model}, path) == 0
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    with torch.no_grad():
        assert torch.equal(model(w.tokens()).logits, logits)


def test_import_from_hf_is_a_step_the_model_loads(gpt2_folder, tmp_path):
    from transformers import GPT2LMHeadModel

    path, logits = gpt2_folder
    root = tmp_path / "root"
    assert main(["import", "--from", "hf", path, str(root), "--step", "0"]) == 0
    assert main(["verify", str(root)]) == 0
    torch.manual_seed(1)
    model = GPT2LMHeadModel(w.config()).eval()
    ckpt.load({"model": model}, root)
    with torch.no_grad():
        assert torch.equal(model(w.tokens()).logits, logits)


# Threat: whoever wrote the folder chooses its index and files.

def test_an_index_naming_a_file_outside_the_folder_is_refused(gpt2_folder, tmp_path):
    import shutil

    path, _ = gpt2_folder
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../etc/passwd"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    from transformers import GPT2LMHeadModel

    with pytest.raises(ckpt.CorruptCheckpointError, match="not a file inside the folder"):
        ckpt.load({"model": GPT2LMHeadModel(w.config())}, copy)


def test_a_shape_that_differs_is_refused_before_anything_is_copied(gpt2_folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    path, _ = gpt2_folder
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2, n_inner=128))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.StateMismatchError, match="nothing was loaded"):
        ckpt.load({"model": model}, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_root_with_an_exported_safetensors_file_in_it_stays_a_root(tmp_path):
    """A ckpt root is loaded as a root even when a model.safetensors lies next to its steps."""
    model = torch.nn.Linear(3, 2)
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"model": model}, force=True)
    assert main(["export", str(tmp_path), "--to", "safetensors",
                 str(tmp_path / "model.safetensors"), "--item", "model"]) == 0
    assert ckpt.load({"model": torch.nn.Linear(3, 2)}, tmp_path) == 1
