"""Exact resume in the loops people write: torch.compile'd models, data loaders (torchdata's
StatefulDataLoader, a plain DataLoader with trainer.ResumableLoader), the RNG stream, save
schedules by wall-clock time and best-N retention; the whole loop SIGKILLed and resumed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ckpt
import trainer
from _workers import assert_same


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


# ------------------------------------------------------------------------ torch.compile names


def test_compiled_model_saves_plain_names_and_loads_both_ways(tmp_path):
    compiled = torch.compile(_net())
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    ckpt.save({"model": compiled}, tmp_path / "c")
    manifest = (tmp_path / "c" / "manifest.json").read_text()
    assert "_orig_mod" not in manifest

    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ckpt.load({"model": plain}, tmp_path / "c")
    assert_same(plain.state_dict(), _net().state_dict())

    # plain -> compiled, and a compiled submodule inside a plain model
    ckpt.save({"model": _net()}, tmp_path / "p")
    target = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                                               torch.nn.Linear(3, 2)))
    ckpt.load({"model": target}, tmp_path / "p")
    assert_same(target._orig_mod.state_dict(), _net().state_dict())
    outer = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    outer[2] = torch.compile(outer[2])
    ckpt.load({"model": outer}, tmp_path / "p")
    assert_same(outer[2]._orig_mod.weight, _net()[2].weight)


# ------------------------------------------------------------------------ data loaders


class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 22

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


def _resumable(num_workers: int, seed: int = 3, **kwargs) -> "trainer.ResumableLoader":
    sampler = trainer.ResumableSampler(len(_Squares()), seed=seed)
    return trainer.ResumableLoader(torch.utils.data.DataLoader(
        _Squares(), sampler=sampler, batch_size=4, num_workers=num_workers, **kwargs))


def _firsts(batches) -> list[list[int]]:
    return [b[:, 0].tolist() for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumable_loader_saves_the_loop_position_not_the_prefetched_one(num_workers):
    straight = _resumable(num_workers)
    expected = [_firsts(straight) for _ in range(3)]  # three epochs, uninterrupted
    assert expected[0] != expected[1] and sorted(sum(expected[0], [])) == list(range(22))

    first = _resumable(num_workers)
    it = iter(first)
    got = _firsts(next(it) for _ in range(2))     # workers have fetched further by now
    state = first.state_dict()
    assert state == {"num_samples": 22, "seed": 3, "epoch": 0, "consumed": 8}
    del it

    second = _resumable(num_workers, seed=99)     # the seed comes from the state
    second.load_state_dict(state)
    got += _firsts(second)
    assert got == expected[0]
    assert [_firsts(second), _firsts(second)] == expected[1:]


def test_resumable_loader_with_drop_last_and_breaking_out_continues():
    loader = _resumable(0, drop_last=True)
    whole = _firsts(_resumable(0, drop_last=True))
    assert len(whole) == 5
    got = []
    for batch in loader:                          # leave the loop after two batches
        got.append(batch[:, 0].tolist())
        if len(got) == 2:
            break
    got += _firsts(loader)                        # a new iter() continues there
    assert got == whole and loader.epoch == 1


def test_resumable_loader_iter_draws_nothing_from_the_global_rng():
    loader = _resumable(2)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)
    # the iterator's worker seed is the epoch's, so a resumed epoch seeds its workers alike
    assert loader.loader.generator.initial_seed() == trainer.data._epoch_seed(3, 0)


def test_sampler_in_a_dataloader_without_counter_refuses_to_save():
    sampler = trainer.ResumableSampler(10, seed=1)
    loader = torch.utils.data.DataLoader(list(range(10)), sampler=sampler, batch_size=2)
    next(iter(loader))
    with pytest.raises(RuntimeError, match="ResumableLoader"):
        sampler.state_dict()
    with pytest.raises(TypeError, match="ResumableSampler"):
        trainer.ResumableLoader(torch.utils.data.DataLoader(list(range(10)), batch_size=2))


def test_plain_dataloader_in_the_state_is_refused_with_the_fix(tmp_path):
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=2)
    with pytest.raises(ckpt.UnsupportedValueError, match="ResumableLoader"):
        ckpt.save({"data": loader}, tmp_path / "c")


def test_stateful_dataloader_without_generator_warns_next_to_rng_state(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    bare = StatefulDataLoader(_Squares(), batch_size=4, shuffle=True)
    with pytest.warns(RuntimeWarning, match="generator="):
        ckpt.save({"data": bare, "rng": ckpt.RNGState()}, tmp_path / "a")
    seeded = StatefulDataLoader(_Squares(), batch_size=4, shuffle=True,
                                generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ckpt.save({"data": seeded, "rng": ckpt.RNGState()}, tmp_path / "b")
        ckpt.load({"data": seeded, "rng": ckpt.RNGState()}, tmp_path / "b")
