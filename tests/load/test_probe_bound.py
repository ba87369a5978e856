"""A probe stores a bounded part of a large output (a language model's logits): a sample of
positions and the whole output's sums, enough for the forward check to find a faulty load."""

from __future__ import annotations

import math

import pytest
import torch

import ckpt
from ckpt._load.probe import MAX_OUTPUT_VALUES, PROBE_ITEM, check_model
from trainer.checkpointing import make_probe

VOCAB, D, BATCH, SEQ = 1000, 16, 4, 64  # logits: 4 x 64 x 1000 = 256,000 values (1000 KiB)


class LM(torch.nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.head = torch.nn.Linear(D, VOCAB)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids))) * self.scale


def lm(scale: float = 1.0) -> LM:
    torch.manual_seed(0)
    return LM(scale)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], ids[:, 1:]


def probe_bytes(manifest) -> int:
    return sum(math.prod(e.shape) * e.torch_dtype.itemsize
               for key, e in manifest.tensors.items() if key.startswith(PROBE_ITEM))


def test_the_trainers_default_probe_stores_at_most_the_bound_of_an_lm_output(tmp_path):
    model = lm()
    probe = make_probe(True, model, batch, fsdp=False)
    with ckpt.CheckpointManager(tmp_path, async_save=False,
                                options=ckpt.SaveOptions(probe=probe)) as mgr:
        mgr.save(1, {"model": model}, force=True)
        manifest = mgr.manifest(1)
    output = manifest.tensors[f"{PROBE_ITEM}/output"]
    assert math.prod(output.shape) == MAX_OUTPUT_VALUES
    inputs = BATCH * SEQ * 8
    # the sample (4 bytes a value) and its positions (8 bytes): 48 KiB, not the 1000 KiB
    assert probe_bytes(manifest) <= MAX_OUTPUT_VALUES * (4 + 8) + inputs
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    print(f"probe {probe_bytes(manifest)} B, model {model_bytes} B, whole output "
          f"{BATCH * SEQ * VOCAB * 4} B")


def test_the_forward_gate_still_fails_a_model_that_computes_differently(tmp_path):
    model = lm()
    probe = make_probe(True, model, batch, fsdp=False)
    with ckpt.CheckpointManager(tmp_path, async_save=False,
                                options=ckpt.SaveOptions(probe=probe)) as mgr:
        mgr.save(1, {"model": model}, force=True)
        assert mgr.restore({"model": lm()}, verify="forward") == 1
        with pytest.raises(ckpt.ForwardCheckError, match="differs"):
            mgr.restore({"model": lm(scale=1.001)}, verify="forward")  # 0.1% off everywhere


@pytest.mark.parametrize("fault", ["one_logit_row", "one_embedding_row", "nan_free_sign"])
def test_a_local_fault_in_the_weights_fails_the_sampled_check(fault):
    model = lm()
    recorded = ckpt.Probe(inputs=batch()[0]).record({"model": model})
    assert "output_index" in recorded and check_model(model, recorded) is None
    ids = batch()[0]
    with torch.no_grad():
        if fault == "one_logit_row":  # the output's logit of one token, at every position
            model.head.weight[417] += 0.5
        elif fault == "one_embedding_row":  # the positions holding one token only
            model.embed.weight[int(ids[2, 5])] *= -1
        else:
            model.head.bias[3] = -model.head.bias[3]
    failure = check_model(model, recorded)
    assert failure is not None and failure.mismatch, fault


def test_a_probe_can_store_the_whole_output_or_refuses_a_bad_bound():
    model = lm()
    whole = ckpt.Probe(inputs=batch()[0], max_outputs=None).record({"model": model})
    assert whole["output"].shape == (BATCH, SEQ, VOCAB) and "output_index" not in whole
    with pytest.raises(ValueError, match="max_outputs"):
        ckpt.Probe(inputs=batch()[0], max_outputs=0)
