"""A rank slow in its data is scored a straggler also when the model has buffers (BatchNorm's
running statistics): DDP then broadcasts them from rank 0 at the start of every forward, so
the other ranks wait for the slow one inside their forward, and a score that counted the
forward as the rank's own work would find every rank equally slow.

Two real gloo ranks train a DDP model with the trainer's progress markers; rank 1 sleeps
50 ms in its data section each step; the scores come from trainer.stragglers.watch_for,
as the trainer builds it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.support.ranks import run_ranks

STEPS, SLOW_S = 6, 0.05


def _train(rank: int, world: int, buffers: bool) -> dict[int, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainer.config import StragglerConfig
    from trainer.sections import Sections
    from trainer.stragglers import watch_for

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8),
                                 *([torch.nn.BatchNorm1d(8)] if buffers else []))
    model = DDP(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sections = Sections()
    sections.begin_attempt()
    trainer = SimpleNamespace(
        config=SimpleNamespace(stragglers=StragglerConfig(window=STEPS),
                               step=SimpleNamespace(fsdp=False)),
        sections=sections, metrics=None, elastic=False)
    parts = SimpleNamespace(attempt=SimpleNamespace(rank=rank, world_size=world,
                                                    collective=True),
                            records=None, exits=None, module=module)
    watch = watch_for(trainer, parts)
    scores = None
    for step in range(1, STEPS + 1):
        sections.step(step)
        sections.enter("data")
        x = torch.randn(16, 8)
        if rank == 1:
            time.sleep(SLOW_S)
        sections.enter("forward")
        loss = model(x).pow(2).mean()
        sections.enter("backward")
        loss.backward()
        sections.enter("collective")
        dist.all_reduce(torch.zeros(1))
        sections.enter("optimizer")
        optimizer.step()
        optimizer.zero_grad()
        scores = watch.step_done(step) or scores
    assert scores is not None
    return {r: round(v, 2) for r, v in scores.overall.items()}


def test_a_rank_slow_in_its_data_is_flagged_when_ddp_broadcasts_buffers_in_the_forward():
    """(Without buffers the same is tests/trainer/test_stragglers.py's gloo case.)"""
    overall = run_ranks(2, _train, True)[0]
    print(f"\n  overall scores with BatchNorm: {overall}")
    assert overall[1] >= 2.0  # the default threshold
    assert overall[0] == pytest.approx(1.0)
