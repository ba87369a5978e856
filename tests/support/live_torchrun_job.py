"""The live job's training (tests/support/live_job.py) on the restart path: the same model,
data, global batch, seed and checkpoint interval, trained by ``trainer.ElasticTrainer``
under torchrun (one worker per agent, each agent a "node"). benchmarks/bench_live.py runs
it to compare a lost node's cost on the restart path with live recovery's.

    torchrun ... tests/support/live_torchrun_job.py --root R --run-dir D [--steps N]

What differs from the live job, and why:

- micro batches of 2 samples: the global batch of 12 must split into whole micro batches
  at world 3 and at world 2 (the live job splits it over the groups of each quorum);
- every other setting is the trainer's default: the memory tier on (torchrun), a
  checkpoint every 4 steps, written asynchronously, resumes from the newest verified step.

Each process writes ``procs/<pid>.json`` in the run directory, naming its node (env
``LIVE_BENCH_NODE``, set per agent by the benchmark), so that the benchmark can tell the
survivors' workers from the replacement's. The memory tier's segments go to the node's own
directory (env ``LIVE_BENCH_SHM``, else ``/dev/shm``), as each node of a cluster has its
own /dev/shm; ``CKPT_NODE`` names the node there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import ckpt  # noqa: E402
from tests.support.live_job import GLOBAL_BATCH, SAMPLES  # noqa: E402
from trainer.config import CheckpointConfig, ElasticConfig, ObservabilityConfig  # noqa: E402
from trainer.elastic import ElasticTrainer  # noqa: E402

MICRO_BATCH = 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--every", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    procs = run_dir / "procs"
    procs.mkdir(parents=True, exist_ok=True)
    (procs / f"{os.getpid()}.json").write_text(json.dumps(
        {"pid": os.getpid(), "node": os.environ.get("LIVE_BENCH_NODE")}))

    # the live job's data, model, optimizer and scheduler
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (SAMPLES,), generator=g)

    def step_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    shm = os.environ.get("LIVE_BENCH_SHM")
    config = ElasticConfig(
        seed=7,
        checkpoint=CheckpointConfig(
            memory_options=ckpt.MemoryTierOptions(shm_dir=shm) if shm else None),
        observability=ObservabilityConfig(run_dir=run_dir))
    trainer = ElasticTrainer(
        lambda: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)),
        lambda params: torch.optim.AdamW(params, lr=0.01),
        TensorDataset(x, y), step_fn,
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.9),
        checkpoint_root=args.root, checkpoint_every=args.every,
        global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, config=config)
    trainer.fit(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
