"""What a user sees when the state to restore no longer fits the checkpoint: each error
names what failed and what to do, and the advice works."""

from __future__ import annotations

import pytest
import torch

import ckpt
from tests.support.workers import assert_same


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


class _Renamed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)


def test_a_renamed_layer_is_named_and_the_advice_loads_it(tmp_path):
    saved = _net()
    ckpt.save({"model": saved}, tmp_path / "c")
    live = _Renamed()
    with pytest.raises(ckpt.StateMismatchError) as e:
        ckpt.load({"model": live}, tmp_path / "c")
    message = str(e.value)
    assert "missing from the checkpoint: model/enc.bias" in message
    assert "unexpected in the checkpoint: model/0.bias" in message
    assert "ckpt.load(path)" in message and "strict=False" in message
    # the advice: read the saved tensors, rename, load
    names = {"0": "enc", "1": "head"}
    sd = ckpt.load(tmp_path / "c")["model"]
    live.load_state_dict({names[k.split(".")[0]] + k[1:]: v for k, v in sd.items()})
    assert torch.equal(live.head.weight, saved[1].weight)


def test_a_model_grown_by_a_layer_is_told_to_restore_what_still_matches(tmp_path):
    ckpt.save({"model": _net()}, tmp_path / "c")
    grown = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ckpt.StateMismatchError,
                       match=r"(?s)missing from the checkpoint: model/2.bias, model/2.weight\n"
                             r".*renamed, added or removed.*strict=False"):
        ckpt.load({"model": grown}, tmp_path / "c")


def test_a_model_cast_to_bf16_is_told_to_restore_in_the_saved_dtype(tmp_path):
    saved = _net()
    ckpt.save({"model": saved}, tmp_path / "c")
    live = _net().to(torch.bfloat16)
    with pytest.raises(ckpt.StateMismatchError,
                       match=r"(?s)checkpoint dtype torch.float32, model dtype torch.bfloat16"
                             r".*model.float\(\)"):
        ckpt.load({"model": live}, tmp_path / "c")
    ckpt.load({"model": live.float()}, tmp_path / "c")  # the advice
    assert_same(live.to(torch.bfloat16).state_dict(), saved.to(torch.bfloat16).state_dict())


def test_other_optimizer_groups_are_told_how_to_resume(tmp_path):
    model = _net()
    optim = torch.optim.AdamW(model.parameters())
    ckpt.save({"model": model, "optim": optim}, tmp_path / "c")
    split = torch.optim.AdamW([{"params": model[0].parameters()},
                               {"params": model[1].parameters(), "lr": 1e-4}])
    with pytest.raises(ckpt.StateMismatchError,
                       match=r"sizes \[4\], this optimizer \[2, 2\].*Build it with the saved "
                             r"groups.*restore without 'optim'"):
        ckpt.load({"model": model, "optim": split}, tmp_path / "c")


def test_a_missing_item_is_told_to_restore_without_it(tmp_path):
    ckpt.save({"model": _net()}, tmp_path / "c")
    with pytest.raises(ckpt.StateMismatchError,
                       match=r"(?s)'ema' is not in the checkpoint.*without the items"):
        ckpt.load({"model": _net(), "ema": _net()}, tmp_path / "c")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_map_location_cuda_without_cuda_says_so_before_reading(tmp_path):
    ckpt.save({"model": _net()}, tmp_path / "c")
    with pytest.raises(ValueError, match=r"map_location='cuda' cannot be used here.*"
                                         r"map_location='cpu'"):
        ckpt.load(tmp_path / "c", map_location="cuda")
    assert ckpt.load(tmp_path / "c", map_location="cpu")["model"]["0.weight"].device.type == "cpu"
