"""Exact resume in the loops people write: torch.compile'd models, data loaders (torchdata's
StatefulDataLoader, a plain DataLoader with trainer.ResumableLoader), the RNG stream, save
schedules by wall-clock time and best-N retention; the whole loop SIGKILLed and resumed.
"""

from __future__ import annotations

import random
import signal
import warnings
from pathlib import Path

import pytest
import torch

from tests.support import exact_workers
import ckpt
import trainer
from tests.support.workers import ForkedLines, Worker, assert_same


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
    # the same with batch_sampler=BatchSampler(ResumableSampler(...), ...)
    batches = torch.utils.data.BatchSampler(trainer.ResumableSampler(22, seed=3), 4, True)
    assert _firsts(trainer.ResumableLoader(torch.utils.data.DataLoader(
        _Squares(), batch_sampler=batches))) == whole


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


@pytest.mark.parametrize("taken", [5, "last", "epoch"])  # mid-epoch, its last batch, StopIteration
@pytest.mark.parametrize("drop_last", [False, True])
def test_single_process_stateful_dataloader_shuffles_the_later_epochs_as_before(
        tmp_path, taken, drop_last):
    """num_workers=0: torchdata alone resumes the epoch but reshuffles the next ones."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:  # 103 samples: the last batch is short (or dropped)
        return StatefulDataLoader(list(range(103)), batch_size=8, shuffle=True,
                                  drop_last=drop_last, generator=torch.Generator().manual_seed(1))

    def epochs(loader: StatefulDataLoader, n: int) -> list[list[int]]:
        return [b.tolist() for _ in range(n) for b in loader]

    want = epochs(make(), 3)
    first = make()
    if taken == "epoch":
        seen = epochs(first, 1)
    else:
        it = iter(first)
        seen = [next(it).tolist() for _ in range(len(first) if taken == "last" else taken)]
    ckpt.save({"data": first}, tmp_path / "c")
    resumed = make()
    ckpt.load({"data": resumed}, tmp_path / "c")
    rest = epochs(resumed, 2 if taken == "epoch" else 3)
    assert seen + rest == want


@pytest.mark.parametrize("saved_workers, workers", [(2, 0), (0, 1), (2, 1)])
def test_stateful_dataloader_with_other_num_workers_is_refused_before_loading(
        tmp_path, saved_workers, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make(n: int) -> StatefulDataLoader:
        return StatefulDataLoader(list(range(20)), batch_size=4, shuffle=True, num_workers=n,
                                  generator=torch.Generator().manual_seed(1))

    net = _net()
    ckpt.save({"model": net, "data": make(saved_workers)}, tmp_path / "c")
    fresh, loader = torch.nn.Linear(4, 3), make(workers)
    target = torch.nn.Sequential(fresh, torch.nn.ReLU(), torch.nn.Linear(3, 2))
    before = fresh.weight.detach().clone()
    with pytest.raises(ckpt.StateMismatchError,
                       match=f"saved with num_workers={saved_workers} cannot continue with "
                             f"num_workers={workers}.*build it with num_workers={saved_workers}"):
        ckpt.load({"model": target, "data": loader}, tmp_path / "c")
    assert torch.equal(fresh.weight, before)  # refused before anything was loaded
    ckpt.load({"model": target}, tmp_path / "c")  # the advice: restore without the loader
    assert_same(target.state_dict(), net.state_dict())


def test_stateful_dataloader_over_a_stateless_shuffling_sampler_warns(tmp_path):
    """torch's RandomSampler keeps no state: a resumed StatefulDataLoader over it skips the
    batches seen in a fresh permutation, so a later epoch resumes in another order."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(16))

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(
            data, generator=torch.Generator().manual_seed(1)))

    first = make()
    seen = [b.tolist() for b in first]  # epoch 0, then a batch of epoch 1
    seen.append(next(iter(first)).tolist())
    with pytest.warns(RuntimeWarning, match="RandomSampler.*keeps no state"):
        ckpt.save({"data": first}, tmp_path / "c")
    resumed = make()
    ckpt.load({"data": resumed}, tmp_path / "c")
    want = [b.tolist() for _ in range(2) for b in make()]
    assert seen + [b.tolist() for b in resumed] != want  # what the warning is about

    class EpochSeeded(torch.utils.data.RandomSampler):  # its order is the epoch's (Accelerate)
        def set_epoch(self, epoch: int) -> None:
            self.generator.manual_seed(epoch)

    shuffled = StatefulDataLoader(data, batch_size=4, shuffle=True,
                                  generator=torch.Generator().manual_seed(1))
    seeded = StatefulDataLoader(data, batch_size=4, sampler=EpochSeeded(
        data, generator=torch.Generator()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ckpt.save({"data": shuffled}, tmp_path / "d")
        ckpt.save({"data": seeded}, tmp_path / "e")


# ------------------------------------------------------------------------ the whole loop, SIGKILLed

# What every run of the loop imports, a fork server (multiprocessing's forkserver, started
# once per session, shared with tests/support/ranks.py's ranks) imports once; each run is a fresh
# process forked from it.


class ForkedRun(ForkedLines):
    """``exact_workers.py COMMAND ARGS...`` forked from the fork server, without paying the
    imports again; SIGKILL and output lines as for a Worker."""

    def __init__(self, command: str, *args: object) -> None:
        argv = [str(a) for a in args]
        super().__init__(exact_workers.run_forked, (command, argv), [command, *argv])


def _loop(mode: str, root: Path, out: Path) -> Worker:
    return ForkedRun(mode, root, out)


def _killed_and_resumed(tmp_path: Path, mode: str, points: list[tuple[str, int]]) -> dict:
    """Run the loop, SIGKILL it at each point (``("step", n)``: once step n is done;
    ``("saved", n)``: right after the first save at or after step n), resume; return the
    final state the last run wrote."""
    root, out = tmp_path / "root", tmp_path / "out.pt"
    for what, n in points:
        run = _loop(mode, root, out)
        start = int(run.expect("start ", timeout=180).split()[1])
        while True:
            line = run.expect(what + " ", timeout=180)
            if int(line.split()[1]) >= n:
                break
        run.kill()
        assert run.proc.returncode == -signal.SIGKILL, run.output
        assert start < n, f"restarted at {start}, past the next kill point {n}"
    run = _loop(mode, root, out)
    assert run.finish(300) == 0, run.output
    return torch.load(out, weights_only=True)


def _reference(tmp_path: Path, mode: str, in_process: bool = False) -> dict:
    """The uninterrupted run (in this process when asked: one torch import less)."""
    if in_process:
        from tests.support.exact_workers import main

        main(mode, str(tmp_path / "ref-root"), str(tmp_path / "ref.pt"))
    else:
        run = _loop(mode, tmp_path / "ref-root", tmp_path / "ref.pt")
        assert run.finish(300) == 0, run.output
    return torch.load(tmp_path / "ref.pt", weights_only=True)


def _kill_points(seed: int, count: int = 3) -> list[tuple[str, int]]:
    """``count`` increasing random kill points in the 15 steps; the second right after a save."""
    r = random.Random(seed)
    a = r.randint(2, 5)
    b = r.randint(a + 1, 9)
    c = r.randint(b + 1, 13)
    return [("step", a), ("saved", b), ("step", c)][:count]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["stateful", "plain"])
def test_loop_killed_three_times_resumes_bit_exact(tmp_path, mode, one_thread):
    seed = random.randrange(1 << 30)
    points = _kill_points(seed)
    got = _killed_and_resumed(tmp_path, mode, points)
    want = _reference(tmp_path, mode, in_process=True)
    assert_same(got, want, f"seed={seed} points={points}")


# ------------------------------------------------------------------------ schedules and retention


class _Clock:
    """A clock the test moves (the manager reads rank 0's clock for every_seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_seconds_saves_when_the_interval_passed(tmp_path):
    with ckpt.CheckpointManager(tmp_path, schedule=ckpt.Schedule(every_seconds=10),
                                async_save=False) as mgr:
        clock = mgr._schedule.clock = _Clock()
        mgr._schedule.last_save_time = 0.0
        saved = []
        for step in range(1, 13):
            clock.now = 4.0 * step                # 4 s per step: due every third step
            if mgr.save(step, {"x": torch.tensor([step])}) is not None:
                saved.append(step)
        assert saved == mgr.steps() == [3, 6, 9, 12]
    with ckpt.CheckpointManager(tmp_path / "b", schedule=ckpt.Schedule(every_steps=5,
                                                                       every_seconds=10),
                                async_save=False) as mgr:
        clock = mgr._schedule.clock = _Clock()
        mgr._schedule.last_save_time = 0.0
        for step in range(1, 8):
            clock.now = 3.0 * step
            mgr.save(step, {"x": torch.tensor([step])})
        assert mgr.steps() == [4, 5]              # 12 s at step 4; step 5 by every_steps
    with pytest.raises(ValueError, match="every_seconds"):
        ckpt.CheckpointManager(tmp_path / "c", schedule=ckpt.Schedule(every_seconds=0))


def _rank_clocks(rank: int, world: int, root: str) -> list[int]:
    # Rank 1's clock always says "due", rank 0's only from step 3 on: rank 0 decides for both.
    import torch

    import ckpt

    with ckpt.CheckpointManager(root, schedule=ckpt.Schedule(every_seconds=10),
                                async_save=False) as mgr:
        mgr._schedule.last_save_time = 0.0
        clock = mgr._schedule.clock = _Clock()
        saved = []
        for step in range(1, 5):
            clock.now = 100.0 if rank == 1 else 5.0 * step
            if mgr.save(step, {"x": torch.tensor([rank])}) is not None:
                saved.append(step)
        return saved


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_seconds_is_decided_by_rank_0_for_every_rank(tmp_path):
    from tests.support.ranks import run_ranks

    assert run_ranks(2, _rank_clocks, str(tmp_path)) == [[2, 4], [2, 4]]


def test_keep_best_keeps_the_best_n_and_the_newest_and_stores_the_metrics(tmp_path):
    losses = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.2, 5: float("nan"), 6: 0.8}
    best = ckpt.RetentionPolicy(keep_best=ckpt.KeepBest(2, "val_loss"))
    with ckpt.CheckpointManager(tmp_path, retention=best, async_save=False) as mgr:
        for step, loss in losses.items():
            mgr.save(step, {"x": torch.tensor([step])}, metrics={"val_loss": loss})
        assert mgr.steps() == [2, 4, 6]           # best two (0.2, 0.5) and the newest
        assert mgr.manifest(4).metadata["metrics"] == {"val_loss": 0.2}
        assert mgr.manifest(6).metadata["metrics"] == {"val_loss": 0.8}
    best = ckpt.RetentionPolicy(keep_last=2, keep_best=ckpt.KeepBest(1, "acc", "max"))
    with ckpt.CheckpointManager(tmp_path / "max", retention=best, async_save=False) as mgr:
        for step, acc in {1: 0.3, 2: 0.9, 3: 0.4, 4: 0.5, 5: 0.1}.items():
            mgr.save(step, {"x": torch.tensor([step])}, metrics={"acc": acc})
        assert mgr.steps() == [2, 4, 5]           # best one, and the last two
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        ckpt.RetentionPolicy(keep_best=ckpt.KeepBest(1, ""))
    with pytest.raises(ValueError, match="best_mode"):
        ckpt.RetentionPolicy(keep_best=ckpt.KeepBest(1, "acc", "up"))
    with ckpt.CheckpointManager(tmp_path / "m", async_save=False) as mgr:
        with pytest.raises(TypeError, match="number"):
            mgr.save(1, {"x": torch.tensor([1])}, metrics={"val_loss": "low"})
        mgr.save(2, {"x": torch.tensor([1])}, metrics={"val_loss": float("nan")})
        assert mgr.manifest(2).metadata["metrics"] == {"val_loss": "nan"}


@pytest.mark.slow
@pytest.mark.multiproc
def test_compiled_loop_killed_right_after_a_save_resumes_bit_exact(tmp_path):
    # One kill (not three): each run of the compiled loop pays dynamo and inductor again.
    seed = random.randrange(1 << 30)
    points = [("saved", random.Random(seed).randint(3, 12))]
    want = _reference(tmp_path, "compiled")  # first: it fills the inductor cache
    got = _killed_and_resumed(tmp_path, "compiled", points)
    assert_same(got, want, f"seed={seed} points={points}")


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_seconds_and_best_n_under_sigkill_keep_the_newest_good_step(tmp_path):
    from tests.support.exact_workers import SCHEDULE_SECONDS, SCHEDULE_STEPS, val_loss

    saves = list(range(SCHEDULE_SECONDS, SCHEDULE_STEPS + 1, SCHEDULE_SECONDS))
    r = random.Random(seed := random.randrange(1 << 30))
    newest = 0
    for _ in range(2):
        run = ForkedRun("schedule", tmp_path)
        start = int(run.expect("start ").split()[1])
        assert start >= newest, f"seed={seed}: restored {start}, but {newest} was committed"
        ahead = [s for s in saves if s > start][:3]
        if not ahead:
            break
        kill_at = r.choice(ahead)
        while newest < kill_at:
            newest = int(run.expect("committed ").split()[1])
        run.kill()                                 # right after a save, or in the next one
        assert run.proc.returncode == -signal.SIGKILL
    run = ForkedRun("schedule", tmp_path)
    assert int(run.expect("start ").split()[1]) >= newest
    assert run.finish() == 0, run.output
    best = sorted(saves, key=val_loss)[:2]
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.steps() == sorted({*best, saves[-1]}), f"seed={seed}"
        assert mgr.manifest(saves[-1]).metadata["metrics"] == {"val_loss": val_loss(saves[-1])}
