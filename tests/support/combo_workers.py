"""The training loop of the combination matrix (tests/e2e/test_combinations.py).

One small loop, checkpointed by a :class:`ckpt.CheckpointManager` configured from a *case*
(a dict naming one value per switch: see :data:`FACTORS`), run in three phases:

* ``reference``: the loop alone, no manager, to the end (the uninterrupted run);
* ``killed``: the loop with the manager, SIGKILLed at the case's kill point;
* ``resume``: a fresh process restores (``verify=`` the case's level), trains to the end.

Each rank writes what the test compares to ``OUT/<phase>-r<rank>.pt`` (the final model,
optimizer, data position and the next random numbers of every generator) and what happened
to ``OUT/<phase>-r<rank>.json`` (the step restored, its tier, the steps committed before the
kill). Processes are forked from the suite's fork server (tests/support/ranks.py), so a
phase costs no import of torch; world 2 runs two ranks on gloo.

The loop: an MLP with dropout and input noise (the global torch RNG), AdamW, index-based
batches over a per-epoch permutation (the data position is two plain values in the state),
gradients averaged over the ranks by hand (an all-reduce), a save after every step that the
schedule makes due, with the step's loss as metric (for ``keep_best``).
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ckpt

#: The switches and their values; the matrix covers every pair of values of two switches.
FACTORS: dict[str, list[Any]] = {
    "mode": ["async", "sync"],
    "incremental": [False, True],
    "compression": [None, "zstd"],
    "memory": [False, True],          # the memory tier, with one peer replica at world 2
    "probe": [False, True],
    "verify": ["structure", "digest", "forward"],
    "retention": ["all", "keep_last", "keep_every", "keep_best"],
    "schedule": ["every_steps", "every_seconds"],
    "world": [1, 2],
    "storage": ["posix", "s3"],
    "kill": ["committed", "in_flight", "node_lost"],
    "kill_after": [1, 3],             # SIGKILL after this many saves of the killed run
}

TOTAL = 8                       # optimizer steps of the whole run
ROWS, FEATURES, OUT_DIM, GLOBAL_BATCH = 64, 6, 3, 8
BATCHES = ROWS // GLOBAL_BATCH  # per epoch
STEP_PAUSE = 0.016              # per step with every_seconds, so that a save is due often
SECONDS = 0.03


def refused(case: dict) -> str | None:
    """Why the manager refuses this combination by design (None: it is accepted)."""
    if case["memory"] and case["incremental"]:
        return "memory_tier=True cannot be combined with incremental=True"
    return None


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(),
                               torch.nn.Dropout(0.2), torch.nn.Linear(16, OUT_DIM))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, FEATURES, generator=gen), torch.randn(ROWS, OUT_DIM, generator=gen)


def _seed(rank: int) -> None:
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)


def _manager(case: dict, rank: int, root: str, shm: str, job: str,
             storage_options: dict | None) -> ckpt.CheckpointManager:
    probe = ckpt.Probe(model_key="model", inputs=torch.ones(2, FEATURES)) \
        if case["probe"] else None
    options = ckpt.SaveOptions(compression=case["compression"],
                               incremental=case["incremental"], probe=probe)
    schedule = ckpt.Schedule(every_steps=2) if case["schedule"] == "every_steps" \
        else ckpt.Schedule(every_seconds=SECONDS)
    retention = {
        "all": ckpt.RetentionPolicy(),
        "keep_last": ckpt.RetentionPolicy(keep_last=2),
        "keep_every": ckpt.RetentionPolicy(keep_last=1, keep_every=4),
        "keep_best": ckpt.RetentionPolicy(keep_best=ckpt.KeepBest(2, "loss")),
    }[case["retention"]]
    memory: Any = False
    if case["memory"]:
        memory = ckpt.MemoryTierOptions(shm_dir=shm, node=f"n{rank}", job=job, replicas=1)
    return ckpt.CheckpointManager(root, async_save=case["mode"] == "async", options=options,
                                  schedule=schedule, retention=retention, memory_tier=memory,
                                  storage_options=storage_options)


def _write(out: str, name: str, rank: int, state: dict, info: dict) -> None:
    final = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict(),
             "data": dict(state["data"]),
             # the next numbers of every generator RNGState restores
             "torch": torch.rand(4), "python": random.random(), "numpy": np.random.rand()}
    torch.save(final, os.path.join(out, f"{name}-r{rank}.pt"))
    with open(os.path.join(out, f"{name}-r{rank}.json"), "w") as f:
        json.dump(info, f)


def run(rank: int, world: int, case: dict | None, phase: str, paths: dict) -> None:
    """One phase of one case on this rank (``case`` None: the reference loop)."""
    torch.set_num_threads(1)
    _seed(rank)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    x_all, y_all = _data()
    state = {"model": model, "optim": optim, "rng": ckpt.RNGState(),
             "data": {"epoch": 0, "batch": 0}}
    mgr = None if case is None else _manager(case, rank, paths["root"], paths["shm"],
                                             paths["job"], paths.get("storage_options"))
    info: dict = {"restored": None}
    start = 0
    if mgr is not None and phase == "resume":
        restored = mgr.restore(state, verify=case["verify"])
        start, last = restored or 0, mgr.last_restore
        info["restored"] = restored
        info["tier"] = None if last is None else str(last.tier)
        info["ranks"] = None if last is None else [[str(t), b] for t, b in last.ranks]
    saves = 0
    for step in range(start + 1, TOTAL + 1):
        position = state["data"]
        order = torch.Generator().manual_seed(100 + position["epoch"])  # the epoch's shuffle
        perm = torch.randperm(ROWS, generator=order)
        share = GLOBAL_BATCH // world
        rows = perm[position["batch"] * GLOBAL_BATCH + rank * share:][:share]
        x = x_all[rows] + 0.01 * torch.randn(share, FEATURES)
        loss = torch.nn.functional.mse_loss(model(x), y_all[rows])
        optim.zero_grad()
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optim.step()
        batch = position["batch"] + 1
        state["data"] = {"epoch": position["epoch"] + batch // BATCHES, "batch": batch % BATCHES}
        if mgr is None:
            continue
        if case["schedule"] == "every_seconds":
            time.sleep(STEP_PAUSE)
        handle = mgr.save(step, state, metrics={"loss": loss.item()})
        saves += handle is not None
        if phase == "killed" and handle is not None and saves == case["kill_after"]:
            _kill(case, mgr, world, paths["out"], rank)
    if mgr is not None:
        mgr.close()
    if phase == "killed":
        raise AssertionError(f"the killed run ended after {saves} saves without being killed")
    info["cpu_s"] = time.process_time()
    _write(paths["out"], phase, rank, state, info)


def _kill(case: dict, mgr: ckpt.CheckpointManager, world: int, out: str, rank: int) -> None:
    """SIGKILL this process at the case's kill point, recording what was committed first."""
    if case["kill"] != "in_flight":
        mgr.wait()  # committed (a synchronous save is committed when save returns anyway)
        if case["kill"] == "node_lost":
            mgr.wait_replicated(60)
        if world > 1:
            dist.barrier()  # every rank's part is done before any rank dies
        with open(os.path.join(out, f"killed-r{rank}.json"), "w") as f:
            json.dump({"latest": mgr.latest_step(), "steps": mgr.steps(),
                   "cpu_s": time.process_time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def lose_node(shm: str, job: str, node: str) -> list[str]:
    """A node's loss: every segment of ``node`` (its own and the replicas it holds), in
    ``shm`` or in this user's private directory inside it."""
    gone = sorted(glob.glob(os.path.join(shm, f"ckpt-{job}-{node}-*"))
                  + glob.glob(os.path.join(shm, "*", f"ckpt-{job}-{node}-*")))
    for path in gone:
        shutil.rmtree(path)
    return gone


def entry(rank: int, world: int, store: str, case: dict | None, phase: str, paths: dict,
          environ: dict[str, str]) -> None:
    """A forked rank: the caller's environment, a gloo group at world > 1, then :func:`run`."""
    os.environ.clear()
    os.environ.update(environ)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
    try:
        run(rank, world, case, phase, paths)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
