"""The training script of tests/e2e/test_memory_torchrun.py (and bench_memory_tier's timeline):
``trainer.ElasticTrainer`` with its memory tier, under torchrun agents
(tests/support/elastic_job.py's LocalCluster) or as a plain process.

    torchrun ... tests/support/memory_job.py --root R --run-dir D --digests G --steps 20 \\
        --every 5 --persist-every 2 --memory-job J [--hold-at 17,22] [--memory on|off|auto]

Writes, per attempt and rank, to ``--digests``:

- ``saved-a<attempt>-r<rank>.jsonl``: ``{"step", "digest"}`` of the model and optimizer at
  every checkpointed step (after the update, as the step's checkpoint holds them);
- ``restored-a<attempt>-r<rank>.json``: the step and digest of the state the attempt
  started from (taken in its first micro batch, before anything changed it);
- ``holding-s<H>-r<rank>.json``: with ``--hold-at H,...``, the first time rank ``rank`` is
  about to train step H, once its checkpoints are committed (and replicated to the peers):
  ``{"pid", "step", "attempt", "ppid", "zygote"}`` (``zygote``: the pid of the zygote of
  ``trainer.warm`` that forked it, else None); the worker then waits (until SIGTERM, a file
  ``release-s<H>`` there, or 120 s) so that the test can kill it at a known point.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ckpt  # noqa: E402

from trainer import (CheckpointConfig, ElasticConfig, FailureConfig, Hooks,  # noqa: E402
                     ObservabilityConfig)
from trainer.elastic import ElasticTrainer  # noqa: E402
from trainer.tiny_lm import TinyLM, WindowDataset, make_corpus  # noqa: E402

from tests.support.elastic_job import setup_worker  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
MEMORY = {"on": True, "off": False, "auto": None}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--digests", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--persist-every", type=int, default=1)
    p.add_argument("--memory-job", default=None)
    p.add_argument("--memory", choices=sorted(MEMORY), default="auto")
    p.add_argument("--hold-at", default="",
                   help="comma-separated steps to wait before, once per rank (see above)")
    p.add_argument("--hold-until-world", type=int, default=0,
                   help="first attempt only: at world sizes below this, wait for SIGTERM")
    p.add_argument("--sample-sleep", type=float, default=0.0)
    p.add_argument("--pad-mb", type=float, default=0.0,
                   help="checkpoint this many MB more (a bigger state than the tiny LM's)")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--trainer-defaults", action="store_true",
                   help="the trainer's own probe and verify level (a probe, the forward "
                        "gate) instead of no probe and digests")
    return p.parse_args(argv)


def state_digest(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the model's tensors and the optimizer's state and hyperparameters."""
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    for name, v in module.state_dict().items():
        h.update(name.encode())
        add(v)
    opt = optimizer.state_dict()
    for idx in sorted(opt["state"]):
        for key in sorted(opt["state"][idx]):
            v = opt["state"][idx][key]
            h.update(f"{idx}.{key}".encode())
            add(v) if isinstance(v, torch.Tensor) else h.update(repr(v).encode())
    h.update(json.dumps(opt["param_groups"], sort_keys=True, default=repr).encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_worker()
    out = Path(args.digests)
    out.mkdir(parents=True, exist_ok=True)
    dataset = WindowDataset(make_corpus(0, 60))
    first_batch: list[int] = []
    held: list[int] = []

    def write(name: str, record: dict, append: bool = False) -> None:
        path = out / name if append else out / f".{name}.tmp"
        with open(path, "a" if append else "w") as f:
            f.write(json.dumps(record) + "\n")
        if not append:  # whole or absent for a reader polling for it
            os.replace(path, out / name)

    def digest() -> str:
        return state_digest(trainer.module, trainer.optimizer)

    holds = {int(h) for h in args.hold_at.split(",") if h}

    def wait_for_sigterm(t: ElasticTrainer, release: Path | None = None) -> None:
        deadline = time.time() + 120
        while not t.preempted and time.time() < deadline and not (release and release.exists()):
            time.sleep(0.05)

    def maybe_hold(t: ElasticTrainer) -> None:
        if (args.hold_until_world and t.attempt == 0 and not held
                and t.world_size < args.hold_until_world):
            held.append(t.step)
            wait_for_sigterm(t)
            return
        marker = out / f"holding-s{t.step + 1}-r{t.rank}.json"
        if t.step + 1 in holds and not marker.exists():  # once per step and rank
            # The kill comes at a known point: the newest checkpoint committed and copied to
            # the peers (private: the trainer has no public wait; this is a test's job).
            t._parts.checkpointer.manager.wait_replicated(timeout=60)
            write(marker.name, {"pid": os.getpid(), "step": t.step, "attempt": t.attempt,
                                "ppid": os.getppid(),
                                "zygote": os.environ.get("CKPT_WARM_ZYGOTE")})
            wait_for_sigterm(t, out / f"release-s{t.step + 1}")

    def step_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        t = trainer
        if not first_batch:  # the state this attempt started from, untouched yet
            first_batch.append(t.step)
            write(f"restored-a{t.attempt}-r{t.rank}.json", {"step": t.step, "digest": digest(),
                                                            "world": t.world_size})
        maybe_hold(t)
        x, y = batch
        if args.sample_sleep:
            time.sleep(args.sample_sleep * len(x))
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def after_step(t: ElasticTrainer, step: int) -> None:
        if step % args.every == 0:  # the checkpoint of this step holds exactly this state
            write(f"saved-a{t.attempt}-r{t.rank}.jsonl", {"step": step, "digest": digest()},
                  append=True)

    memory = ckpt.MemoryTierOptions(persist_every=args.persist_every,
                                    job=args.memory_job or None)
    pad = int(args.pad_mb * 1e6 / 4)
    config = ElasticConfig(
        health=False, hooks=Hooks(after_step=after_step),
        checkpoint=CheckpointConfig(
            manager_options={"keep_last": 3}, memory_tier=MEMORY[args.memory],
            memory_options=memory,
            **({} if args.trainer_defaults else {"probe": False, "verify": "digest"}),
            extra_state=(lambda model: {"pad": torch.ones(pad)}) if pad else None),
        failure=FailureConfig(heartbeat_timeout=args.heartbeat_timeout,
                              collective_timeout=args.collective_timeout),
        observability=ObservabilityConfig(run_dir=args.run_dir, log_every=None))
    trainer = ElasticTrainer(
        TinyLM, lambda params: torch.optim.AdamW(params, lr=3e-3), dataset, step_fn,
        checkpoint_root=args.root, checkpoint_every=args.every,
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        config=config)
    trainer.fit(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------------ harness for tests/benchmarks

from tests.support.elastic_job import LocalCluster, Node  # noqa: E402


class Cluster(LocalCluster):
    """LocalCluster running tests/support/memory_job.py, each node named for the memory tier
    (``CKPT_NODE=<tag>n<i>``), so that its segments are ``ckpt-<job>-<tag>n<i>-*``. With
    ``warm``, the agents start the workers through ``-m trainer.warm`` (warm restarts from a
    zygote per node), their sockets in ``<workdir>/warm``."""

    def __init__(self, workdir: Path, job_args: list[str], tag: str, warm: bool = False,
                 **kw) -> None:
        super().__init__(workdir, job_args, **kw)
        self.tag = tag
        self.warm = warm
        if warm:
            self.env["CKPT_WARM_DIR"] = str(self.warm_dir)

    @property
    def warm_dir(self) -> Path:
        return self.workdir / "warm"

    def node_name(self, i: int) -> str:
        return f"{self.tag}n{i}"

    # What the private-shm cluster changes: a command that wraps the agent, the rendezvous id.
    wrapper: list[str] = []
    rdzv_id = "memory-test"

    def node_env(self, i: int) -> dict[str, str]:
        """The environment of node ``i``'s agent."""
        return {**self.env, "CKPT_NODE": self.node_name(i)}

    def add_node(self) -> Node:
        name = f"node{len(self.nodes)}"
        log_path = self.workdir / f"{name}.log"
        args = [f"--nnodes={self.nnodes}",
                "--nproc-per-node=1", f"--max-restarts={self.max_restarts}",
                f"--monitor-interval={self.monitor_interval}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.rdzv_id}",
                f"--rdzv-conf={self.rdzv_conf}", "--local-addr=127.0.0.1",
                *(["-m", "trainer.warm"] if self.warm else []), SCRIPT, *self.job_args]
        env = self.node_env(len(self.nodes))
        proc = self.start_agent(args, env, log_path, self.wrapper)
        node = Node(name, proc, log_path, time.time())
        self.nodes.append(node)
        return node
