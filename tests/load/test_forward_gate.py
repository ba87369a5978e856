"""``restore(state, verify=...)`` and ``ckpt.load(..., verify=...)``: the forward level reruns
the probe recorded at save time through the restored model and falls back past a step that
was saved whole but is bad (weights gone NaN, a model whose code changed); the structure
level skips digests. Faults are real: NaN weights saved by a real save, a model class with
another activation, a bit flipped in a data file on disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import ckpt

INPUTS = torch.randn(5, 8, generator=torch.Generator().manual_seed(9))


class Net(torch.nn.Module):
    """A small MLP with a dropout (eval mode matters) and a BatchNorm buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.drop = torch.nn.Dropout(0.5)
        self.fc2 = torch.nn.Linear(32, 4)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.norm(self.fc1(x)))))


class GeluNet(Net):
    """The same parameters under the same names; the code computes something else."""

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x)


class NoisyNet(Net):
    """Draws from the global RNG in every forward, without changing its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.rand(1)
        return super().forward(x)


def make_state(seed: int, cls: type = Net) -> dict:
    torch.manual_seed(seed)
    model = cls()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optim": optim, "epoch": 0}


def train(state: dict, steps: int = 2) -> None:
    model, optim = state["model"], state["optim"]
    model.train()
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        optim.step()
    state["epoch"] += 1


def snapshot(state: dict) -> dict:
    """Every tensor of the state, copied: model weights and buffers, optimizer momenta."""
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state.items():
        out[f"optim.{i}"] = s["momentum_buffer"].clone()
    out["epoch"] = state["epoch"]
    return out


def assert_same(state: dict, expected: dict) -> None:
    now = snapshot(state)
    assert now.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(now[k], v) if isinstance(v, torch.Tensor) else now[k] == v, k


def manager(root: Path, probe: bool = True, **kw) -> ckpt.CheckpointManager:
    options = ckpt.SaveOptions(probe=ckpt.Probe(inputs=INPUTS) if probe else None)
    return ckpt.CheckpointManager(root, async_save=False, options=options, **kw)


def save_two_steps(root: Path, *, nan_before_step_2: bool = False, cls: type = Net) -> dict:
    """Steps 1 and 2 of a short training run, with a probe; returns step 1's tensors."""
    state = make_state(0, cls)
    with manager(root) as mgr:
        train(state)
        mgr.save(1, state)
        step1 = snapshot(state)
        train(state)
        if nan_before_step_2:  # the run diverged: a weight went NaN before the save
            with torch.no_grad():
                state["model"].fc1.weight[3, 2] = float("nan")
        mgr.save(2, state)
    return step1


def test_a_step_saved_with_nan_weights_falls_back_to_the_step_before_bit_exact(tmp_path):
    step1 = save_two_steps(tmp_path / "root", nan_before_step_2=True)
    state = make_state(1)
    with manager(tmp_path / "root", read_only=True) as mgr:
        assert mgr.restore(state, verify="forward") == 1
        assert_same(state, step1)  # model, momenta and epoch: all of step 1, bit-exact
        assert all(bool(torch.isfinite(p).all()) for p in state["model"].parameters())
        assert [s for s, _ in mgr.skipped] == [2]
        assert "NaN" in mgr.skipped[0][1] and "fc1.weight" in mgr.skipped[0][1]
        assert "diverged before this step was saved" in mgr.skipped[0][1]
        # The digest level cannot see it: the bytes are exactly what was saved.
        assert mgr.restore(make_state(1), verify="digest") == 2


def test_a_changed_model_class_raises_naming_the_mismatch_and_leaves_the_model(tmp_path):
    save_two_steps(tmp_path / "root")
    state = make_state(1, GeluNet)
    before = snapshot(state)
    with manager(tmp_path / "root", read_only=True) as mgr:
        with pytest.raises(ckpt.CheckpointError) as raised:
            mgr.restore(state, verify="forward")
        message = str(raised.value)
        assert isinstance(raised.value, ckpt.ForwardCheckError)
        assert "differs from the one recorded at save time at every step" in message
        assert "the model's code has changed" in message
        assert "largest |diff|" in message
        assert 'verify="digest"' in message  # how to accept it
        assert "step 2: the probe's output differs" in message
        assert "step 1: the probe's output differs" in message
        # Nothing to train on: the model holds what it held before the restore.
        for k, v in before.items():
            if k.startswith("model."):
                assert torch.equal(state["model"].state_dict()[k[6:]], v), k
        # Accepting the change, as the message says, loads the newest step.
        assert mgr.restore(state, verify="digest") == 2


def test_an_explicit_step_that_fails_the_forward_check_raises_and_changes_no_model(tmp_path):
    save_two_steps(tmp_path / "root", nan_before_step_2=True)
    state = make_state(1)
    before = snapshot(state)
    with manager(tmp_path / "root", read_only=True) as mgr:
        with pytest.raises(ckpt.ForwardCheckError, match="step-00000002: the forward check "
                                                         "failed: weight fc1.weight"):
            mgr.restore(state, step=2, verify="forward")
    assert torch.equal(state["model"].fc1.weight, before["model.fc1.weight"])


def test_a_step_without_a_probe_passes_the_forward_level_with_a_logged_note(tmp_path, caplog):
    state = make_state(0)
    with manager(tmp_path / "root", probe=False) as mgr:
        mgr.save(1, state)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with manager(tmp_path / "root", read_only=True) as mgr:
            assert mgr.restore(make_state(1), verify="forward") == 1
    notes = [r for r in caplog.records if r.name == "ckpt" and "no probe" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert "step 1" in notes[0].getMessage()


def test_a_restore_of_a_subset_without_the_probes_model_passes_with_a_logged_note(
        tmp_path, caplog):
    save_two_steps(tmp_path / "root")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with manager(tmp_path / "root", read_only=True) as mgr:
            assert mgr.restore({"epoch": None}, verify="forward") == 2
    assert any("is not an nn.Module of the state" in r.getMessage() for r in caplog.records)


def flip_a_data_bit(root: Path, step: int) -> None:
    """Flip one bit in the middle of the step's largest data file (tensor bytes)."""
    files = [p for p in (root / f"step-{step:08d}").iterdir() if p.name != "manifest.json"]
    data = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))


def test_the_structure_level_loads_a_flipped_bit_the_digest_level_falls_back(tmp_path):
    """Decided and documented (ckpt/_load/levels.py, docs/guide.md): ``verify="structure"`` checks
    the manifest and file sizes only, so a flipped data bit is loaded as it is."""
    root = tmp_path / "root"
    save_two_steps(root)
    with manager(root, read_only=True) as mgr:
        reference = make_state(1)
        assert mgr.restore(reference, step=2) == 2
        saved = snapshot(reference)
    flip_a_data_bit(root, 2)
    with manager(root, read_only=True) as mgr:
        loose = make_state(1)
        assert mgr.restore(loose, verify="structure") == 2
        changed = [k for k, v in snapshot(loose).items()
                   if isinstance(v, torch.Tensor) and not torch.equal(v, saved[k])]
        assert len(changed) == 1  # the flipped value, loaded without a word
        assert mgr.restore(make_state(1), verify="digest") == 1
        assert "digest mismatch" in mgr.skipped[-1][1]


def test_when_every_step_fails_for_different_reasons_each_is_listed(tmp_path):
    """Step 2 fails its forward check, step 1 its digest: a CorruptCheckpointError names
    both, and the model is put back."""
    root = tmp_path / "root"
    save_two_steps(root, nan_before_step_2=True)
    flip_a_data_bit(root, 1)
    state = make_state(1)
    before = snapshot(state)
    with manager(root, read_only=True) as mgr:
        with pytest.raises(ckpt.CorruptCheckpointError) as raised:
            mgr.restore(state, verify="forward")
    assert not isinstance(raised.value, ckpt.ForwardCheckError)
    message = str(raised.value)
    assert "step 2:" in message and "hold NaN/Inf" in message
    assert "step 1:" in message and "digest mismatch" in message
    assert torch.equal(state["model"].fc1.weight, before["model.fc1.weight"])


def test_the_structure_level_still_falls_back_past_a_truncated_file(tmp_path):
    root = tmp_path / "root"
    save_two_steps(root)
    files = [p for p in (root / "step-00000002").iterdir() if p.name != "manifest.json"]
    data = max(files, key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-8])
    with manager(root, read_only=True) as mgr:
        assert mgr.restore(make_state(1), verify="structure") == 1
        assert "truncated" in mgr.skipped[-1][1]


def test_the_forward_check_keeps_each_modules_mode_and_the_training_rng(tmp_path):
    save_two_steps(tmp_path / "root", cls=NoisyNet)
    state = make_state(1, NoisyNet)
    state["model"].train()
    state["model"].norm.eval()  # a frozen BatchNorm stays frozen
    with manager(tmp_path / "root", read_only=True) as mgr:
        torch.manual_seed(7)
        assert mgr.restore(state, verify="forward") == 2
        drawn = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(4))  # the probe's forward drew from a forked RNG
    assert state["model"].training and state["model"].drop.training
    assert not state["model"].norm.training


def test_a_compiled_model_runs_its_probe_uncompiled(tmp_path):
    """Recording and rerunning a probe never compiles an eval-mode graph of a torch.compile'd
    model (seconds in a fresh process); the probe still catches a NaN step."""
    compiles = []

    def backend(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    state = make_state(0)
    state["model"] = torch.compile(state["model"], backend=backend)
    with manager(tmp_path / "root") as mgr:
        mgr.save(1, state)
        with torch.no_grad():
            state["model"].fc1.weight[0, 0] = float("nan")
        mgr.save(2, state)
        assert mgr.restore(state, verify="forward") == 1
    assert compiles == []


def test_load_verify_forward_raises_and_puts_the_model_back(tmp_path):
    save_two_steps(tmp_path / "root", nan_before_step_2=True)
    step2 = tmp_path / "root" / "step-00000002"
    state = make_state(1)
    before = snapshot(state)
    with pytest.raises(ckpt.ForwardCheckError, match="NaN"):
        ckpt.load(state, step2, verify="forward")
    assert torch.equal(state["model"].fc1.weight, before["model.fc1.weight"])
    assert ckpt.load(state, step2, verify="digest") == 2  # the bytes themselves are whole
    assert torch.isnan(state["model"].fc1.weight).any()
    assert ckpt.load(make_state(1), tmp_path / "root" / "step-00000001",
                     verify="forward") == 1


def test_verify_takes_only_the_three_levels(tmp_path):
    save_two_steps(tmp_path / "root")
    with manager(tmp_path / "root", read_only=True) as mgr:
        with pytest.raises(ValueError, match="'structure', 'digest', 'forward'"):
            mgr.restore(make_state(1), verify="full")
    with pytest.raises(ValueError, match="verify must be one of"):
        ckpt.load(make_state(1), tmp_path / "root" / "step-00000001", verify="fast")
    with pytest.raises(ValueError, match="needs the model"):  # load(path) has no model
        ckpt.load(tmp_path / "root" / "step-00000001", verify="forward")


@pytest.mark.multiproc
@pytest.mark.slow
def test_every_rank_restores_the_same_step_past_nan_weights_and_one_ranks_corrupt_chunk(
        tmp_path):
    """Ranks run the forward check all or none: step 3 fails on rank 1 only (its own chunk's
    digest), step 2 on every rank (NaN weights); both ranks restore step 1."""
    from tests.support.ranks import run_ranks
    from tests.support.forward_gate_workers import restore_past_bad_steps

    results = run_ranks(2, restore_past_bad_steps, str(tmp_path / "root"), timeout=90)
    assert results == [(1, [3, 2], True), (1, [3, 2], True)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_forward_check_runs_on_the_models_cuda_device(tmp_path):
    step1 = save_two_steps(tmp_path / "root", nan_before_step_2=True)
    model = make_state(1)["model"].cuda()
    with manager(tmp_path / "root", read_only=True) as mgr:
        assert mgr.restore({"model": model}, verify="forward") == 1
        assert all(p.is_cuda for p in model.parameters())
        assert torch.equal(model.fc1.weight.cpu(), step1["model.fc1.weight"])
        changed = make_state(1, GeluNet)["model"].cuda()
        before = changed.fc1.weight.clone()
        with pytest.raises(ckpt.ForwardCheckError, match="model's code has changed"):
            mgr.restore({"model": changed}, verify="forward")
        assert torch.equal(changed.fc1.weight, before)


@pytest.mark.multiproc
@pytest.mark.slow
def test_an_fsdp2_model_is_gated_on_every_rank_and_put_back_when_every_step_fails(tmp_path):
    from tests.support.ranks import run_ranks
    from tests.support.forward_gate_workers import fsdp_forward_gate

    results = run_ranks(2, fsdp_forward_gate, str(tmp_path / "root"), timeout=120)
    for restored, same, message, kept in results:
        assert (restored, same, kept) == (1, True, True)
        assert "passed the forward check" in message, message
        assert "step 2: weight 0.weight of the model hold NaN/Inf" in message
        assert "step 1: the probe's output differs" in message


def _drop_the_output(tree: dict) -> dict:
    del tree["output"]
    return tree


@pytest.mark.parametrize("damage, reason", [
    (_drop_the_output, "it has no recorded output"),
    (lambda tree: [tree["inputs"]], "it is a list, not the recorded fields"),
    (lambda tree: "probe", "it is a str, not the recorded fields")])
def test_a_probe_item_damaged_beyond_its_fields_fails_the_step_not_skips_its_check(
        tmp_path, caplog, damage, reason):
    """A step whose manifest records a probe item that no longer holds a probe (hand-edited)
    is skipped as damaged; before, the gate took it for a step saved without a probe and
    restored it with only a note that the check was skipped."""
    import json

    from ckpt._format.sealed import sealed_json

    step1 = save_two_steps(tmp_path / "root")
    manifest = tmp_path / "root/step-00000002/manifest.json"
    doc = json.loads(manifest.read_text())
    doc["items"]["__probe__"]["tree"] = damage(doc["items"]["__probe__"]["tree"])
    manifest.write_bytes(sealed_json(doc))  # re-sealed: an edit, not damage
    state = make_state(1)
    with caplog.at_level(logging.WARNING, logger="ckpt"), \
            manager(tmp_path / "root", read_only=True) as mgr:
        assert mgr.restore(state, verify="forward") == 1
        assert [s for s, _ in mgr.skipped] == [2]
        assert f"the probe item is damaged: {reason}" in mgr.skipped[0][1]
    assert_same(state, step1)
    assert "no probe" not in caplog.text
