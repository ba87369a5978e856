"""The training script the elastic tests run under torchrun (and once as a plain process).

    torchrun ... tests/support/elastic_job.py --root R --run-dir D --audit-dir A --steps 40 ...

Trains the tiny LM on a small corpus with ``trainer.ElasticTrainer``. ``--sample-sleep``
adds a sleep per sample to each micro batch (simulated compute that scales with the share of
the global batch a rank gets, without burning the two CPU cores). Rank 0 prints the summary
as ``ELASTIC_SUMMARY <json>`` and in words.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ckpt  # noqa: E402

from trainer.config import (CheckpointConfig, DataConfig, ElasticConfig,  # noqa: E402
                            FailureConfig, ObservabilityConfig, StepConfig,
                            StragglerConfig)
from trainer.elastic import ElasticTrainer  # noqa: E402
from trainer.progress import JsonLines  # noqa: E402
from trainer.tiny_lm import TinyLM, WindowDataset, make_corpus, warmup_cosine  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--run-dir")
    p.add_argument("--audit-dir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--sentences", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-sleep", type=float, default=0.0)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--hang-factor", type=float, default=3.0)
    p.add_argument("--hang-floor", type=float, default=10.0)
    # Off unless asked (the trainer's default is 4 steps): these jobs count the steps a node
    # loss, a join or a drop costs from the newest checkpoint; test_hang turns it on.
    p.add_argument("--verified-window", type=int, default=None,
                   help="mark a checkpoint verified after this many healthy steps; restores "
                   "take the newest verified step")
    # A rank whose training thread gets stuck while its heartbeat thread runs on.
    p.add_argument("--stall", action="append", default=[], metavar="RANK:STEP:HOW",
                   help="once per job (a file in the run dir says it happened), that rank "
                   "gets stuck in that step: 'sleep' in its data loader (fetching the "
                   "step's first micro batch) or 'spin' in Python (in step_fn)")
    p.add_argument("--fsdp", action="store_true")
    # A straggler: that rank's forward (step_fn) takes F times as long, at world size
    # --slow-at-world (any world size: 0).
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-lone-rank", action="store_true",
                   help="the straggler is the rank alone on its node (LOCAL_WORLD_SIZE 1)")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--slow-at-world", type=int, default=0)
    p.add_argument("--straggler-window", type=int, default=10)
    p.add_argument("--straggler-windows", type=int, default=3)
    p.add_argument("--straggler-drop", action="store_true")
    # Holds make the scenarios independent of how fast agents start on a loaded machine: the
    # workers wait (heartbeats going, no collective in flight) until torchrun SIGTERMs them
    # because another node arrived, then checkpoint the step and exit for the restart.
    p.add_argument("--hold-until-world", type=int, default=0,
                   help="first attempt only: at world sizes below this, wait for SIGTERM")
    p.add_argument("--hold-at", type=int, default=0,
                   help="at the start of this step, wait for SIGTERM")
    p.add_argument("--hold-at-below-world", type=int, default=0,
                   help="--hold-at only at world sizes below this (a node joining a job "
                   "that shrank)")
    # A pause puts every rank at a known point (no collective in flight) for the test to
    # kill a node there; once released, the survivors meet the loss in their next collective.
    p.add_argument("--pause-at", type=int, default=0,
                   help="at the start of this step, at world size --pause-at-world, write "
                   "paused-s<STEP>-a<ATTEMPT>-r<RANK> (the pid) to the run dir and wait until "
                   "the file release-s<STEP> exists there (or 120 s); a pause once released "
                   "does not come back when a restored job passes the step")
    p.add_argument("--pause-at-world", type=int, default=0)
    # A user's own DataLoader (workers, collate_fn), hooks and extra checkpointed items.
    p.add_argument("--loader-workers", type=int, default=None,
                   help="load through a DataLoader factory with this many workers")
    p.add_argument("--hooks-log", help="keep an EMA and a counter in hooks; log to this dir "
                   "what the hooks saw and which samples step_fn trained")
    p.add_argument("--eval-every", type=int, default=4)
    return p.parse_args(argv)


class IndexedWindows(torch.utils.data.Dataset):
    """The windows of the corpus with their index: (x, y, index)."""

    def __init__(self, windows: WindowDataset) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        x, y = self.windows[i]
        return x, y, i


class StallingDataset(torch.utils.data.Dataset):
    """A dataset that calls ``check()`` before each read (which may never return)."""

    def __init__(self, dataset, check) -> None:
        self.dataset, self.check = dataset, check

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        self.check()
        return self.dataset[i]


def collate_indexed(samples):
    """A user's own collate_fn."""
    xs, ys, ids = zip(*samples)
    return torch.stack(xs), torch.stack(ys), torch.tensor(ids)


class Counter:
    """A user's counter checkpointed with the model."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for v in module.state_dict().values():
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def user_extras(args: argparse.Namespace, get_trainer, dataset) -> dict:
    """The data loader factory, hooks and extra state of ``--loader-workers/--hooks-log``:
    every call writes a line to ``hooks-a<attempt>-r<rank>.jsonl``."""
    from trainer import Hooks

    extras: dict = {}
    if args.loader_workers is not None:
        def data_loader(batch_sampler):
            return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler,
                                               num_workers=args.loader_workers,
                                               collate_fn=collate_indexed)
        extras["data_loader"] = data_loader
    if not args.hooks_log:
        return extras
    ema, counter, logs = {}, Counter(), {}

    def note(kind: str, step: int, **fields) -> None:
        t = get_trainer()
        key = (t.attempt, t.rank)
        if key not in logs:
            logs[key] = JsonLines(Path(args.hooks_log) / f"hooks-a{t.attempt}-r{t.rank}.jsonl")
        logs[key].write({"kind": kind, "step": step, "attempt": t.attempt, "rank": t.rank,
                         "world": t.world_size, **fields})

    def extra_state(model):
        ema["model"] = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        return {"ema": ema["model"], "counter": counter}

    def after_step(t, step):
        m = ema["model"]
        note("step", step, counter=counter.n, ema_updates=int(m.n_averaged),
             ema_before=digest(m))
        m.update_parameters(t.module)
        counter.n += 1
        note("ema", step, ema_after=digest(m))

    def evaluate(t, step):
        x, y, _ = collate_indexed([dataset[i] for i in range(4)])
        logits = t.module(x)
        note("eval", step, loss=float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                      y.reshape(-1))))

    extras["extra_state"] = extra_state
    extras["hooks"] = Hooks(after_step=after_step, evaluate=evaluate,
                            eval_every=args.eval_every,
                            after_checkpoint=lambda t, step: note("ckpt", step))
    extras["note"] = note
    return extras


def setup_worker() -> None:
    """One torch thread and timestamped log lines naming pid and rank (shared by job scripts)."""
    torch.set_num_threads(1)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s.%(msecs)03d [pid {os.getpid()} rank {rank}] "
                               "%(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_worker()
    dataset = WindowDataset(make_corpus(args.seed, args.sentences))
    if args.loader_workers is not None or args.hooks_log:
        dataset = IndexedWindows(dataset)
    stalls = [tuple(x.split(":")) for x in args.stall]

    def maybe_stall(how: str) -> None:
        t = trainer
        for i, (rank, step, kind) in enumerate(stalls):
            if kind == how and t.rank == int(rank) and t.step == int(step) - 1:
                try:  # once per job: not again when the restarted job passes this step
                    os.close(os.open(Path(args.run_dir) / f"stalled-{i}",
                                     os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    continue
                logging.getLogger("elastic_job").info("stalling (%s) in step %s", how, step)
                if how == "sleep":
                    time.sleep(3600)
                while True:  # spin: hold the interpreter (the beat thread still gets turns)
                    pass

    if stalls:
        dataset = StallingDataset(dataset, lambda: trainer.sections.position().section == "data"
                                  and maybe_stall("sleep"))
    extras = user_extras(args, lambda: trainer, dataset)
    note = extras.pop("note", None)

    held = []

    def maybe_hold() -> None:
        if held:
            return
        t = trainer
        if ((args.hold_until_world and t.attempt == 0 and t.world_size < args.hold_until_world)
                or (args.hold_at and t.step == args.hold_at - 1
                    and (not args.hold_at_below_world
                         or t.world_size < args.hold_at_below_world))):
            held.append(t.step)
            logging.getLogger("elastic_job").info("holding before step %d until SIGTERM",
                                                  t.step + 1)
            deadline = time.time() + 120
            with t.sections.user("hold"):  # a wait of ours, not a hang
                while not t.preempted and time.time() < deadline:
                    time.sleep(0.05)

    paused = []

    def maybe_pause() -> None:
        t = trainer
        release = Path(args.run_dir) / f"release-s{args.pause_at}"
        if (paused or not args.pause_at or t.step != args.pause_at - 1
                or t.world_size != args.pause_at_world or release.exists()):
            return
        paused.append(t.step)
        (Path(args.run_dir) / f"paused-s{args.pause_at}-a{t.attempt}-r{t.rank}").write_text(
            str(os.getpid()))
        logging.getLogger("elastic_job").info("pausing before step %d until %s", t.step + 1,
                                              release.name)
        deadline = time.time() + 120
        with t.sections.user("pause"):  # a wait of ours, not a hang
            while not release.exists() and not t.preempted and time.time() < deadline:
                time.sleep(0.02)

    def step_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        maybe_hold()
        maybe_pause()
        if stalls:
            maybe_stall("spin")
        x, y = batch[:2]
        if note is not None:  # the samples really trained
            note("seen", trainer.step + 1, ids=batch[2].tolist())
        t0 = time.perf_counter()
        if args.sample_sleep:
            time.sleep(args.sample_sleep * len(x))
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        slow = args.slow_rank == trainer.rank or (
            args.slow_lone_rank and os.environ.get("LOCAL_WORLD_SIZE") == "1")
        if slow and args.slow_at_world in (0, trainer.world_size):
            # the straggler: its forward takes slow_factor times as long as it just did
            time.sleep((args.slow_factor - 1) * (time.perf_counter() - t0))
        return loss

    def optimizer_fn(params):
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def scheduler_fn(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, args.steps))

    # The memory tier (on by default under torchrun) keeps its segments in the test's own
    # directory, shared by the agents as /dev/shm would be, so no run leaves them behind.
    memory_dir = Path(args.root).parent / "shm"
    memory_dir.mkdir(parents=True, exist_ok=True)
    config = ElasticConfig(
        seed=args.seed, hooks=extras.get("hooks"),
        data=DataConfig(data_loader=extras.get("data_loader")),
        step=StepConfig(fsdp=args.fsdp, max_grad_norm=1.0),
        checkpoint=CheckpointConfig(
            manager_options={"keep_last": 2},
            memory_options=ckpt.MemoryTierOptions(shm_dir=str(memory_dir)),
            extra_state=extras.get("extra_state"), verified_window=args.verified_window),
        failure=FailureConfig(heartbeat_timeout=args.heartbeat_timeout,
                              heartbeat_interval=args.heartbeat_interval,
                              collective_timeout=args.collective_timeout,
                              hang_factor=args.hang_factor, hang_floor=args.hang_floor),
        observability=ObservabilityConfig(audit_dir=args.audit_dir, run_dir=args.run_dir),
        stragglers=StragglerConfig(window=args.straggler_window, windows=args.straggler_windows,
                                   drop=args.straggler_drop))
    trainer = ElasticTrainer(
        TinyLM, optimizer_fn, dataset, step_fn, checkpoint_root=args.root,
        checkpoint_every=args.every, global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch, scheduler_fn=scheduler_fn, config=config)
    summary = trainer.fit(args.steps)
    if trainer.rank == 0:
        print("ELASTIC_SUMMARY " + json.dumps(summary.to_dict()), flush=True)
        print(summary.format(), flush=True)
    return 0


def host_store(conn) -> None:
    """Host a c10d TCPStore, send its port on ``conn``, then wait to be killed (a process of
    its own for a test to SIGSTOP; run from the suite's fork server)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    time.sleep(120)


def run_plain(argv: list[str], environ: dict[str, str], log: str) -> None:
    """``main(argv)`` as a plain process (no torchrun) forked from the test suite's fork
    server (tests/support/ranks.py), which imported torch, torch._dynamo, ckpt and the
    trainer already: the run does not pay those imports again. Its environment is
    ``environ``, its output goes to ``log``; it exits with main's status (1 on an error)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------------ harness for tests/benchmarks
#
# Everything below is for the *launching* side (tests/trainer/test_elastic.py, benchmarks/
# bench_elastic.py): several torchrun agents on this machine, each one "node", joined by a c10d
# rendezvous whose store the harness hosts itself (an agent hosting it would take the job down
# with it when killed). See ../shared/FINDINGS.md, "Elastic training with torchrun".

import signal  # noqa: E402
import subprocess  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
TORCHRUN = str(Path(__file__).resolve().parent / "torchrun.py")
REPO = str(Path(__file__).resolve().parents[2])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts workers in their own session, so a
    process-group kill of the agent misses them)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


class Node:
    """One torchrun agent (a "node") and the workers below it."""

    def __init__(self, name: str, proc: subprocess.Popen, log_path: Path, started: float):
        self.name, self.proc, self.log_path, self.started = name, proc, log_path, started
        self.killed_at: float | None = None

    def tree(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def owns(self, pid: int) -> bool:
        return pid in descendants(self.proc.pid)

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Signal the agent and every process below it, all at once; returns the time."""
        pids = self.tree()
        self.killed_at = time.time()
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        return self.killed_at

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class LocalCluster:
    """Up to ``max_nodes`` torchrun agents on localhost training ``elastic_job.py``."""

    def __init__(self, workdir: Path, job_args: list[str], *, nnodes: str = "2:3",
                 max_restarts: int = 3, last_call_timeout: int = 3, keep_alive_interval: int = 1,
                 keep_alive_max_attempt: int = 4, monitor_interval: float = 0.5,
                 restart_grace: float | None = None,
                 extra_env: dict[str, str] | None = None, warm: bool = False,
                 forked: bool = False) -> None:
        import torch.distributed as dist

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.job_args = job_args
        # Hosted here, not by an agent: killing any node must leave the rendezvous alive.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   multi_tenant=True)
        self.port = self.store.port
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.rdzv_conf = (f"is_host=false,last_call_timeout={last_call_timeout},"
                          f"keep_alive_interval={keep_alive_interval},"
                          f"keep_alive_max_attempt={keep_alive_max_attempt},join_timeout=120")
        # torchrun's agents refresh their keep-alive only once it is older than the interval,
        # on a timer of that interval: a live node's keep-alive can be almost two intervals
        # old. keep_alive_max_attempt=2 therefore evicts live nodes now and then; 4 leaves a
        # margin and still drops a dead node about 4 s after its last keep-alive.
        self.monitor_interval = monitor_interval
        # None: torchrun's own 30 s between the SIGTERM and the SIGKILL of a restart (the
        # workers checkpoint on SIGTERM); else that many seconds (see tests/support/torchrun.py).
        self.restart_grace = restart_grace
        # PET_LOG_DIR is torchrun's --log-dir: without it every agent leaves a
        # /tmp/torchelastic_* directory behind.
        self.env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                        MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        PET_LOG_DIR=str(self.workdir / "torchelastic"),
                        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get(
                            "PYTHONPATH")) if p), **(extra_env or {}))
        # warm: the agents start the workers through ``-m trainer.warm`` (restarts fork from
        # a zygote per node that imported torch once), their sockets in <workdir>/warm.
        self.warm = warm
        if warm:
            self.env["CKPT_WARM_DIR"] = str(self.workdir / "warm")
        # forked: each agent is forked from the suite's fork server (tests/support/ranks.py,
        # torch imported once) instead of a fresh interpreter importing torch: the same
        # torchrun code in a process of its own (see run_agent). Not for a straggler drop:
        # trainer.straggler_drop finds its agent by the command line, here the fork server's.
        self.forked = forked
        self.nodes: list[Node] = []

    def add_node(self, nproc: int = 1) -> Node:
        """Start one more agent, with ``nproc`` workers."""
        name = f"node{len(self.nodes)}"
        log_path = self.workdir / f"{name}.log"
        args = [f"--nnodes={self.nnodes}",
                f"--nproc-per-node={nproc}", f"--max-restarts={self.max_restarts}",
                f"--monitor-interval={self.monitor_interval}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=elastic-test",
                f"--rdzv-conf={self.rdzv_conf}", "--local-addr=127.0.0.1",
                *(["-m", "trainer.warm"] if self.warm else []), SCRIPT, *self.job_args]
        node = Node(name, self.start_agent(args, self.env, log_path), log_path, time.time())
        self.nodes.append(node)
        return node

    def start_agent(self, args: list[str], env: dict[str, str], log_path: Path,
                    wrapper: list[str] | tuple = ()):
        """One torchrun agent with the arguments ``args``, in a session of its own, its
        output to ``log_path``: a Popen, or with ``forked`` (and no ``wrapper`` command to
        run it under) a process forked from the fork server with Popen's pid, poll, wait
        and returncode."""
        if self.forked and not wrapper:
            from tests.support.ranks import forkserver
            from tests.support.workers import ForkedProcess

            process = forkserver().Process(target=run_agent, args=(
                args, env, str(log_path), self.restart_grace))
            process.start()
            return ForkedProcess(process)
        launcher = (["-m", "torch.distributed.run"] if self.restart_grace is None
                    else [TORCHRUN, str(self.restart_grace)])
        with open(log_path, "w") as out:
            return subprocess.Popen([*wrapper, sys.executable, *launcher, *args], cwd=REPO,
                                    env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def node_of(self, pid: int) -> Node:
        for n in self.nodes:
            if n.owns(pid):
                return n
        raise LookupError(f"no node runs pid {pid}")

    def wait(self, timeout: float) -> dict[str, int | None]:
        """Wait for every agent not killed by us; returns exit codes (None: still running)."""
        deadline = time.time() + timeout
        for n in self.nodes:
            if n.killed_at is None:
                try:
                    n.proc.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    pass
        return {n.name: n.proc.poll() for n in self.nodes}

    def close(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None or descendants(n.proc.pid):
                n.kill(signal.SIGKILL)
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def logs(self) -> str:
        return "\n".join(f"===== {n.name} =====\n{n.log()}" for n in self.nodes)


def run_agent(args: list[str], environ: dict[str, str], log: str,
              restart_grace: float | None, err: str | None = None) -> None:
    """``torchrun ARGS`` in a process forked from the fork server (LocalCluster's
    ``forked``, :func:`torchrun_forked`): a session of its own, the repository as working
    directory, ``environ`` as its environment, its output to ``log`` (its stderr to ``err``
    when given); the restart grace of tests/support/torchrun.py."""
    import logging

    os.setsid()
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(environ)
    for target, path in ((1, log), (2, err or log)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED is read at start-up
    # torchrun's loggers take their level from LOGLEVEL when created: any the fork server
    # created took its environment's
    from torch.distributed.elastic.utils.logging import get_log_level

    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (name.startswith(("torch.distributed.elastic", "torch.distributed.launcher",
                             "torch.distributed.run")) and isinstance(logger, logging.Logger)):
            logger.setLevel(environ.get("LOGLEVEL", get_log_level()))
    if restart_grace is not None:
        from tests.support.torchrun import shorten_restart_grace

        shorten_restart_grace(restart_grace)
    from torch.distributed.run import main

    sys.argv = ["torchrun", *args]
    main(args)


def torchrun_forked(args: list[str], env: dict[str, str], out_dir: Path,
                    timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, torch.distributed.run, *args], env=env,
    capture_output=True, text=True, timeout=timeout)`` with the agent forked from the fork
    server (see :func:`run_agent`); its stdout and stderr pass through files in
    ``out_dir``. On the timeout, the agent and its workers are SIGKILLed and
    subprocess.TimeoutExpired raised."""
    from tests.support.ranks import forkserver

    out, err = Path(out_dir) / "torchrun.stdout", Path(out_dir) / "torchrun.stderr"
    for path in (out, err):
        path.write_text("")
    process = forkserver().Process(target=run_agent, args=(args, env, str(out), None, str(err)))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        for pid in [process.pid, *descendants(process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.join()
        raise subprocess.TimeoutExpired(["torchrun", *args], timeout)
    return subprocess.CompletedProcess(["torchrun", *args], process.exitcode,
                                       out.read_text(errors="replace"),
                                       err.read_text(errors="replace"))


def progress(run_dir: Path) -> dict[int, dict]:
    """The newest state of each attempt: {attempt: {"world", "pids": {rank: pid}, "step"}}."""
    from trainer.elastic import read_jsonl

    out: dict[int, dict] = {}
    for adir in sorted(Path(run_dir).glob("attempt-*")):
        a = int(adir.name.split("-")[1])
        info = out[a] = {"world": None, "pids": {}, "step": 0, "events": []}
        for p in adir.glob("rank-*.jsonl"):
            for r in read_jsonl(p):
                info["events"].append(r)
                if r["event"] == "start":
                    info["world"] = r["world"]
                    info["pids"][r["rank"]] = r["pid"]
                elif r["event"] == "step":
                    info["step"] = max(info["step"], r["step"])
    return out


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1, cluster=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f"\n{cluster.logs()[-20000:]}" if cluster is not None else ""))
