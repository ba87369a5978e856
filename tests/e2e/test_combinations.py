"""Every pair of the manager's switches, together: saved, SIGKILLed, resumed bit-exact.

The switches (tests/support/combo_workers.py, ``FACTORS``): asynchronous or synchronous
saves, incremental, zstd compression, the memory tier (a peer replica at world 2), a probe,
each verify level, each retention rule, a schedule by steps or by seconds, world 1 or 2
(gloo), POSIX or S3 (moto), and the kill point (after save k committed, with save k still
being written, or after save k with the node's memory lost). A covering array (allpairspy)
picks cases so that every pair of values of two switches occurs in at least one case: 16
cases instead of the product's 18,432. Each case: a run SIGKILLed at its kill point,
a fresh run that restores and trains to the end; the final model, optimizer, data position
and every random generator must equal the uninterrupted run's bit for bit, and the restore
must come from the tier it should: this node's memory when the memory tier is on and the
node survived, the peer replica for a lost node's rank at world 2, the root otherwise.

Combinations refused by design are tested as refusals. ``CKPT_MATRIX_RANDOM=N`` adds N
cases drawn at random from every accepted combination (``CKPT_MATRIX_SEED`` picks them), for
a longer run (docs/design.md, "Combinations").
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
from allpairspy import AllPairs

import ckpt
from tests.support import combo_workers as workers
from tests.support.ranks import forkserver
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

RANDOM_CASES = int(os.environ.get("CKPT_MATRIX_RANDOM", "0"))
RANDOM_SEED = int(os.environ.get("CKPT_MATRIX_SEED", "0"))


def _cases() -> list[dict]:
    names = list(workers.FACTORS)

    def accepted(row: list) -> bool:  # partial rows too: refuse as soon as a pair is refused
        partial = dict(zip(names, row))
        return workers.refused({**_DEFAULTS, **partial}) is None

    seeds = [[case[name] for name in names] for case in SEEDS]
    rows = AllPairs(list(workers.FACTORS.values()), filter_func=accepted,
                    previously_tested=seeds)
    cases = [dict(case) for case in SEEDS] + [dict(zip(names, row)) for row in rows]
    generated = len(cases)  # allpairspy's filter can leave a pair out: one more case for each
    while missing := _uncovered(cases):
        a, va, b, vb = missing[0]
        base = {**cases[len(cases) % generated], a: va, b: vb}
        cases.append(base if workers.refused(base) is None else {**_DEFAULTS, a: va, b: vb})
    return _cheapened(cases) + _drawn(RANDOM_CASES, RANDOM_SEED)


def _drawn(n: int, seed: int) -> list[dict]:
    """``n`` accepted combinations drawn at random (uniformly over the product)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        case = {name: rng.choice(values) for name, values in workers.FACTORS.items()}
        if workers.refused(case) is None and case not in out:
            out.append(case)
    return out


# The costly values, each with its cheap alternative (S3 through moto and a second rank cost
# the most; an every_seconds schedule sleeps in every step).
_CHEAPER = [("storage", "s3", "posix"), ("world", 2, 1), ("schedule", "every_seconds",
                                                             "every_steps")]


def _cheapened(cases: list[dict]) -> list[dict]:
    """The cases with each costly value replaced by its cheap one wherever every pair stays
    covered: the covering array's filler values are arbitrary."""
    for i, case in enumerate(cases):
        if i < len(SEEDS):
            continue
        for name, costly, cheap in _CHEAPER:
            if case[name] == costly:
                trial = {**case, name: cheap}
                if workers.refused(trial) is None \
                        and not _uncovered(cases[:i] + [trial] + cases[i + 1:]):
                    cases[i] = case = trial
    return cases


def _uncovered(cases: list[dict]) -> list[tuple]:
    """The accepted pairs of values that no case holds."""
    names = list(workers.FACTORS)
    seen = {(a, c[a], b, c[b]) for c in cases for i, a in enumerate(names) for b in names[i + 1:]}
    return [(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1:]
            for va in workers.FACTORS[a] for vb in workers.FACTORS[b]
            if (a, va, b, vb) not in seen
            and workers.refused({**_DEFAULTS, a: va, b: vb}) is None]


_DEFAULTS = {name: values[0] for name, values in workers.FACTORS.items()}

# Cases in the matrix whatever the covering array picks: the combinations ElasticTrainer
# runs by default under torchrun (the memory tier with a replica, a probe, the forward
# gate, several ranks), with a worker killed and with a node lost.
_ELASTIC = {**_DEFAULTS, "memory": True, "probe": True, "verify": "forward", "world": 2,
            "retention": "keep_last"}
SEEDS = [{**_ELASTIC, "kill": "committed", "kill_after": 1},
         {**_ELASTIC, "kill": "node_lost", "kill_after": 3, "mode": "sync",
          "compression": "zstd"}]
CASES = _cases()


def _case_id(case: dict) -> str:
    return "-".join(str(v) if not isinstance(v, bool) else (k if v else f"no_{k}")
                    for k, v in case.items())


def _phase(case: dict | None, phase: str, world: int, paths: dict, tmp: Path,
           timeout: float = 90.0) -> list[int]:
    """Run one phase on ``world`` forked ranks; their exit codes (-9: SIGKILLed)."""
    ctx = forkserver()
    store = str(tmp / f"store-{phase}-{time.monotonic_ns()}")
    procs = [ctx.Process(target=workers.entry,
                         args=(r, world, store, case, phase, paths, dict(os.environ)),
                         daemon=True)
             for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    print(f"{phase} {time.monotonic() - t0:.2f} s", end="; ")  # measured, for the docs
    return [p.exitcode for p in procs]


def _final(out: Path, phase: str, rank: int) -> tuple[dict, dict]:
    return (torch.load(out / f"{phase}-r{rank}.pt", weights_only=True),
            json.loads((out / f"{phase}-r{rank}.json").read_text()))


def _differences(got: dict, want: dict, prefix: str = "") -> list[str]:
    """Paths where two nested values differ (tensors bit for bit)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{prefix}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{prefix}/{k}")]
    if isinstance(want, torch.Tensor):
        same = isinstance(got, torch.Tensor) and got.dtype == want.dtype \
            and got.shape == want.shape and torch.equal(got, want)
        return [] if same else [prefix]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [prefix]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in _differences(g, w, f"{prefix}/{i}")]
    return [] if got == want else [f"{prefix}: {got!r} != {want!r}"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, list[dict]]:
    """The uninterrupted loop's final state, by world, by rank."""
    refs = {}
    for world in (1, 2):
        tmp = tmp_path_factory.mktemp(f"reference{world}")
        codes = _phase(None, "reference", world, {"out": str(tmp)}, tmp)
        assert codes == [0] * world, f"the reference run at world {world} exited {codes}"
        refs[world] = [_final(tmp, "reference", r)[0] for r in range(world)]
    return refs


def _expected_tiers(case: dict) -> list[str]:
    """The tier each rank must restore from."""
    world = case["world"]
    if not case["memory"]:
        return ["storage"] * world
    if case["kill"] != "node_lost":
        return ["memory"] * world
    if world == 1:
        return ["storage"]
    return ["memory", "peer"]  # rank 1's node was lost: its shards from the replica on n0


@pytest.mark.parametrize("case", [
    pytest.param(c, id=_case_id(c), marks=[pytest.mark.s3] if c["storage"] == "s3" else [])
    for c in CASES])
def test_case_killed_and_resumed_bit_exact_from_its_tier(case, references, tmp_path, request):
    world = case["world"]
    paths = {"out": str(tmp_path), "shm": str(tmp_path / "shm"), "job": "matrix"}
    os.makedirs(paths["shm"])
    if case["storage"] == "s3":
        bucket = request.getfixturevalue("s3")
        paths["root"] = bucket.root("run")
        paths["storage_options"] = bucket.storage_options
    else:
        paths["root"] = str(tmp_path / "root")

    codes = _phase(case, "killed", world, paths, tmp_path)
    assert codes == [-9] * world, f"the killed run exited {codes}, not SIGKILL"
    if case["kill"] == "node_lost" and case["memory"]:
        assert workers.lose_node(paths["shm"], paths["job"], f"n{world - 1}"), \
            "the lost node held no segment"
    codes = _phase(case, "resume", world, paths, tmp_path)
    assert codes == [0] * world, f"the resumed run exited {codes}"

    tiers = []
    for rank in range(world):
        got, info = _final(tmp_path, "resume", rank)
        if case["kill"] != "in_flight":  # the newest step committed before the kill
            killed = json.loads((tmp_path / f"killed-r{rank}.json").read_text())
            assert info["restored"] == killed["latest"] is not None, (info, killed)
        assert _differences(got, references[world][rank]) == [], f"rank {rank} differs"
        tiers.append(info["tier"])
    cpu = [json.loads(p.read_text()).get("cpu_s", 0.0) for p in tmp_path.glob("*-r*.json")]
    print(f"worker cpu {sum(cpu):.2f} s")  # measured, for docs/design.md's figures
    if info["restored"] is None:  # killed while its first save was written: none committed
        assert case["kill"] == "in_flight" and case["kill_after"] == 1, info
        assert tiers == [None] * world
    else:
        assert tiers == _expected_tiers(case), info


def test_matrix_covers_every_pair_of_accepted_values():
    assert _uncovered(CASES) == []
    assert all(workers.refused(c) is None for c in CASES)


def test_memory_tier_with_incremental_saves_is_refused_naming_both(tmp_path):
    """An incremental save references chunks of its base step by their files in the root;
    the memory tier keeps whole steps in RAM, so the two cannot be combined."""
    with pytest.raises(ValueError, match="memory_tier.*incremental"):
        ckpt.CheckpointManager(tmp_path / "root", memory_tier=True,
                               options=ckpt.SaveOptions(incremental=True))
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_memory_only_save_without_a_memory_tier_is_refused(tmp_path):
    with ckpt.CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        with pytest.raises(ValueError, match="memory_tier"):
            mgr.save(1, {"x": torch.zeros(2)}, persist=False)
        assert mgr.steps() == []
