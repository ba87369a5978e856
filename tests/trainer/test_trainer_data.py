"""Standalone checks of the demo's training pieces: the resumable sampler and the tiny LM."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch

from trainer import ResumableSampler
from trainer.demo import diff
from trainer.tiny_lm import (CONTEXT, VOCAB, TinyLM, WindowDataset, make_corpus, make_training,
                             train_step, warmup_cosine)


pytestmark = pytest.mark.usefixtures("one_thread")  # bit-exact comparisons below


def _epochs(seen: list[int], n: int) -> list[list[int]]:
    return [seen[i:i + n] for i in range(0, len(seen), n)]


# ------------------------------------------------------------------ ResumableSampler


def test_each_sample_exactly_once_per_epoch_with_batches_crossing_epochs():
    n = 103  # prime: almost every epoch ends in the middle of a batch
    s = ResumableSampler(n, seed=7, audit=True)
    for _ in range(40):
        assert len(s.next_indices(8)) == 8
    assert s.audit is not None and len(s.audit) == 320
    epochs = _epochs(s.audit, n)
    for full in epochs[:-1]:
        assert sorted(full) == list(range(n))
    assert len(set(epochs[-1])) == len(epochs[-1])  # partial epoch: no repeats either
    assert (s.epoch, s.consumed) == (320 // n, 320 % n)


def test_epochs_are_different_seeded_permutations():
    n = 50
    s = ResumableSampler(n, seed=3)
    e0, e1 = s.next_indices(n), s.next_indices(n)
    assert e0 != e1 and sorted(e0) == sorted(e1) == list(range(n))
    assert ResumableSampler(n, seed=3).next_indices(n) == e0
    assert ResumableSampler(n, seed=4).next_indices(n) != e0
    # Epoch e uses seed+epoch, so seed 4 epoch 0 is seed 3 epoch 1.
    assert ResumableSampler(n, seed=4).next_indices(n) == e1


def test_state_round_trips_through_json_and_resumes_the_same_sequence():
    n, batch = 37, 6
    straight = ResumableSampler(n, seed=11)
    expected = [straight.next_indices(batch) for _ in range(20)]

    first = ResumableSampler(n, seed=11)
    got = [first.next_indices(batch) for _ in range(9)]
    state = json.loads(json.dumps(first.state_dict()))
    assert all(type(v) is int for v in state.values())
    assert set(state) >= {"seed", "epoch", "consumed"}

    second = ResumableSampler(n, seed=999)  # the seed comes from the state
    second.load_state_dict(state)
    assert second.state_dict() == first.state_dict()
    got += [second.next_indices(batch) for _ in range(11)]
    assert got == expected


@pytest.mark.parametrize("worlds", [(4, 2), (2, 8), (1, 4, 2)])
def test_exactly_once_across_resumes_that_change_world_size(worlds):
    n, global_batch, steps_per_phase = 96, 8, 7
    state = ResumableSampler(n, seed=5).state_dict()
    per_rank_seen: list[int] = []
    for world in worlds:
        # Every rank rebuilds its own sampler from the same global state, as after a restart.
        ranks = [ResumableSampler(n) for _ in range(world)]
        for r in ranks:
            r.load_state_dict(state)
        for _ in range(steps_per_phase):
            batches = [r.next_indices(global_batch) for r in ranks]
            assert all(b == batches[0] for b in batches)  # ranks agree on the global batch
            slices = [ResumableSampler.rank_slice(batches[0], rank, world)
                      for rank in range(world)]
            assert sum(slices, []) == batches[0]
            for sl in slices:
                per_rank_seen.extend(sl)
        state = ranks[0].state_dict()
    total = len(worlds) * steps_per_phase * global_batch
    assert len(per_rank_seen) == total
    for epoch in _epochs(per_rank_seen, n):
        assert max(Counter(epoch).values()) == 1
    assert sorted(per_rank_seen[:n]) == list(range(n))
    assert per_rank_seen == ResumableSampler(n, seed=5).next_indices(total)


@pytest.mark.parametrize("stop", [13, 20, 29])  # mid-epoch, at an epoch's end, in the last
def test_the_guides_epoch_loop_resumed_trains_the_batches_of_an_uninterrupted_run(stop):
    """docs/guide.md: ``for epoch in range(loader.epoch, epochs): for batch in loader``."""
    from torch.utils.data import DataLoader

    from trainer import ResumableLoader

    def loader() -> ResumableLoader:
        return ResumableLoader(DataLoader(list(range(40)), batch_size=4,
                                          sampler=ResumableSampler(40, seed=3)))

    def run(data: ResumableLoader, trained: list, stop_at: int | None = None) -> dict | None:
        for epoch in range(data.epoch, 3):
            for batch in data:
                trained.append(batch.tolist())
                if len(trained) == stop_at:
                    return json.loads(json.dumps(data.state_dict()))  # as saved
        return None

    reference, before, after = [], [], []
    run(loader(), reference)
    saved = run(loader(), before, stop_at=stop)
    resumed = loader()
    resumed.load_state_dict(saved)
    run(resumed, after)
    assert len(reference) == 30 and before + after == reference


def test_rank_slice_and_load_reject_bad_input():
    with pytest.raises(ValueError):
        ResumableSampler.rank_slice(list(range(10)), 0, 3)
    with pytest.raises(ValueError):
        ResumableSampler.rank_slice(list(range(12)), 3, 3)
    s = ResumableSampler(10)
    with pytest.raises(ValueError):
        s.load_state_dict({**ResumableSampler(11).state_dict()})
    with pytest.raises(ValueError):
        s.load_state_dict({"seed": 0, "epoch": 0, "consumed": 10})
    with pytest.raises(ValueError):
        s.next_indices(0)
    with pytest.raises(ValueError):
        ResumableSampler(0)


# ------------------------------------------------------------------ tiny LM


def test_corpus_and_windows_are_deterministic_and_shifted():
    assert make_corpus(1) == make_corpus(1)
    assert make_corpus(1) != make_corpus(2)
    ds = WindowDataset(make_corpus(1))
    assert len(ds) > 1000
    x, y = ds[len(ds) - 1]
    assert x.shape == y.shape == (CONTEXT,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])
    assert int(torch.cat([x, y]).max()) < VOCAB
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_output_head_is_tied_to_the_embedding():
    model = TinyLM()
    assert model.lm_head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "lm_head.weight" not in names  # one Parameter
    assert "lm_head.weight" in model.state_dict()  # yet two names in the state dict


def test_dropout_makes_training_depend_on_the_global_rng():
    model = TinyLM().train()
    idx = torch.randint(0, VOCAB, (2, CONTEXT))
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_schedule_warms_up_then_decays_to_the_floor():
    f = warmup_cosine(10, 100, floor=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 100))


def _params(tr) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.model.state_dict().items()}


def test_two_runs_from_the_same_seed_are_bit_identical_and_learn():
    a = make_training(3)
    losses_a = [train_step(a) for _ in range(40)]
    params_a = _params(a)
    b = make_training(3)
    losses_b = [train_step(b) for _ in range(40)]
    assert losses_a == losses_b
    assert diff(params_a, _params(b)) == []
    assert diff(a.optimizer.state_dict(), b.optimizer.state_dict()) == []
    assert sum(losses_a[-5:]) / 5 < losses_a[0] - 1.0
    assert diff(params_a, _params(make_training(4))) != []


def test_resume_from_state_dicts_matches_an_uninterrupted_run():
    """The pieces ckpt will checkpoint are sufficient for a bit-exact resume."""
    total, cut = 30, 13
    ref = make_training(0, total_steps=total)
    for _ in range(total):
        train_step(ref)

    first = make_training(0, total_steps=total)
    for _ in range(cut):
        train_step(first)
    saved = copy.deepcopy({
        "model": first.model.state_dict(), "optim": first.optimizer.state_dict(),
        "sched": first.scheduler.state_dict(), "data": first.sampler.state_dict(),
        "rng": torch.get_rng_state()})
    del first

    second = make_training(0, total_steps=total)
    second.model.load_state_dict(saved["model"])
    second.optimizer.load_state_dict(saved["optim"])
    second.scheduler.load_state_dict(saved["sched"])
    second.sampler.load_state_dict(saved["data"])
    torch.set_rng_state(saved["rng"])
    for _ in range(total - cut):
        train_step(second)

    assert second.model.lm_head.weight is second.model.embed.weight
    assert diff(_params(ref), _params(second)) == []
    assert diff(ref.optimizer.state_dict(), second.optimizer.state_dict()) == []
    assert ref.scheduler.state_dict() == second.scheduler.state_dict()
    assert ref.sampler.state_dict() == second.sampler.state_dict()


def test_diff_finds_single_bit_and_structure_changes():
    a = {"w": torch.zeros(3), "n": [1, (2, 3)], "s": "x"}
    b = copy.deepcopy(a)
    assert diff(a, b) == []
    b["w"][1] = torch.finfo(torch.float32).tiny
    b["n"][1] = (2, 4)
    assert diff(a, b) == ["/w", "/n/1/1: 3 vs 4"]
    assert diff({"a": 1}, {"b": 1})
    assert diff(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert diff(1, 1.0)  # a type change is a change
