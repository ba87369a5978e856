"""A replica group of a small live job (trainer.live), and how tests run and read one.

As a script (started by ``trainer.live.supervisor``): trains a small MLP with dropout
(so the RNG matters) and AdamW + StepLR on 96 samples, global batch 12, recording every
commit with digests; with several ranks per group (``--group-size``) the MLP is replicated
inside the group (``LIVE_LAYOUT=ddp``) or sharded over it with FSDP2 (``hsdp``). Faults,
each injected once per job (a marker file), by env ``LIVE_KILL=group:step:where[:rank]``,
comma separated:

- ``forward``: the group SIGKILLs itself in the middle of the step (after its forward);
- ``allreduce``: at the gradient all-reduce it waits until its peers are surely inside
  theirs (0.3 s), then SIGKILLs itself.

  (at the first step from the one named on at which all the job's groups are in the
  quorum and ``LIVE_WAIT_SPARE`` warm spares (default 1) wait: ``spare-<pid>`` in the
  run directory, so that the replacement starts without importing torch; start the job
  with ``--spares``).

Each kill is written to ``kills.jsonl`` (group, step, time) just before the signal. A
``stop_at`` file in the run directory ends the job at that step (the test writes one a few
steps ahead once it has seen what it waits for). A ``hold_at`` file holds every group at a
step boundary (after committing that step, before the next quorum) until the test removes
it; each held group touches ``held-<group>-<step>``: faults injected there (the lighthouse
killed, a majority stopped) find every group at the same committed step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

SAMPLES, GLOBAL_BATCH = 96, 12


def _kills() -> dict[tuple[int, int], tuple[int, str, int]]:
    """(group, rank) -> (step, where, order): the n-th kill fires only after n-1 kills."""
    out = {}
    for order, spec in enumerate(filter(None, os.environ.get("LIVE_KILL", "").split(","))):
        group, step, where, *rank = spec.split(":")
        out[int(group), int(rank[0]) if rank else 0] = (int(step), where, order)
    return out


def _due(run_dir: Path, kill: tuple[int, str, int] | None, where: str, step: int,
         participants: int) -> bool:
    """Whether this group dies here: its kill's place, from its step on, with the whole
    quorum (so any replacement of an earlier kill has joined), after the earlier kills."""
    if not kill or kill[1] != where or step < kill[0] or \
            participants != int(os.environ.get("LIVE_GROUPS", "3")):
        return False
    if len(list(run_dir.glob("spare-*"))) < int(os.environ.get("LIVE_WAIT_SPARE", "1")):
        return False  # no warm spare yet: the replacement would import torch
    earlier = read(run_dir / "kills.jsonl")
    # a whole quorum after the previous kill's step: its replacement has joined
    return len(earlier) == kill[2] and all(step > k["step"] for k in earlier)


def _die(run_dir: Path, group: int, named: int, step: int, where: str, rank: int = 0
         ) -> None:
    """SIGKILL this process (at ``step``), once per job for (group, named step, where)."""
    marker = run_dir / f"killed-{group}-{named}-{where}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # the replacement passes this point again
    with open(run_dir / "kills.jsonl", "a") as f:
        f.write(json.dumps({"group": group, "rank": rank, "step": step, "where": where,
                            "pid": os.getpid(), "time": time.time()}) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    import torch
    from torch.utils.data import TensorDataset

    from trainer.live import LiveConfig, LiveTrainer, run
    from trainer.live.config import SPARE_ENV

    run_dir = Path(os.environ["LIVE_RUN_DIR"])
    # a warm spare (imports paid) says so while it waits for its group
    ready = run_dir / f"spare-{os.getpid()}"
    if os.environ.get(SPARE_ENV) == "1":
        ready.touch()
    live = LiveConfig.from_env()
    ready.unlink(missing_ok=True)
    group, rank = live.replica_group, live.group_rank
    kill = _kills().get((group, rank))
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (SAMPLES,), generator=g)

    pause = float(os.environ.get("LIVE_STEP_PAUSE", "0"))
    stop_file = run_dir / "stop_at"
    hold_file = run_dir / "hold_at"

    class Job(LiveTrainer):
        def issue_allreduce(self, flat: torch.Tensor) -> Any:
            step = self.manager.current_step() + 1
            # the first step from the one named on at which the quorum is whole
            if _due(run_dir, kill, "allreduce", step, self.manager.num_participants()):
                time.sleep(0.3)
                _die(run_dir, group, kill[0], step, "allreduce", rank)
            return super().issue_allreduce(flat)

        def train_step(self) -> bool:
            step = self.manager.current_step()
            try:
                hold = int(hold_file.read_text() or -1)
            except (FileNotFoundError, ValueError):
                hold = -1
            if 0 <= hold <= step:
                (run_dir / f"held-{group}-{hold}").touch()
                while hold_file.exists():
                    time.sleep(0.005)
            time.sleep(pause)  # leaves the CPU to the processes importing torch
            return super().train_step()

        def last_step(self, total_steps: int) -> int:
            # the test may end the job sooner: a step every group reads before it
            if stop_file.exists():
                return min(total_steps, int(stop_file.read_text() or total_steps))
            return total_steps

    holder: dict[str, Job] = {}

    def step_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        step = holder["t"].manager.current_step() + 1
        if _due(run_dir, kill, "forward", step, holder["t"].manager.num_participants()):
            _die(run_dir, group, kill[0], step, "forward", rank)
        return loss

    def model_fn() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
        if os.environ.get("LIVE_LAYOUT") == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=init_device_mesh("cpu", (live.group_size,)))
        return model

    trainer = Job(
        model_fn,
        lambda params: torch.optim.AdamW(params, lr=0.01),
        TensorDataset(x, y), step_fn,
        scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.9),
        checkpoint_root=os.environ["LIVE_CKPT_ROOT"],
        checkpoint_every=int(os.environ.get("LIVE_CKPT_EVERY", "4")),
        global_batch_size=GLOBAL_BATCH, live=live, seed=7, record_dir=run_dir,
        digests=True, manager_options={
            "async_save": False, "keep_last": int(os.environ.get("LIVE_KEEP_LAST", "3"))})
    holder["t"] = trainer
    run(trainer, int(os.environ["LIVE_TOTAL_STEPS"]))


# -- the test side ------------------------------------------------------------------------
def netns_ok() -> bool:
    """Whether this machine lets the job run in a network namespace of its own
    (``unshare -n``, as root, with ``ip``)."""
    import shutil

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"],
                           capture_output=True)
    return probe.returncode == 0


def start_job(tmp: Path, *, steps: int, kill: str = "", heartbeat_timeout: float = 1.0,
              quorum_timeout: float = 30.0, quorum_retries: int = 3, timeout: float = 15.0,
              respawn_delay: float = 0.0, extra: list[str] | None = None,
              groups: int = 3, group_size: int = 1, layout: str = "ddp",
              min_replicas: int | None = None, checkpoint_every: int = 4,
              wait_spare: int = 1, keep_last: int = 3, step_pause: float = 0.0
              ) -> subprocess.Popen:
    """The supervisor of a job of ``groups`` groups (``group_size`` ranks each, ``layout``
    ``"ddp"`` or ``"hsdp"`` inside a group) in a network namespace of its own (torchft's
    manager server listens on every interface: nothing outside can reach it there).
    ``wait_spare``: a kill waits for that many warm spares (start the job with
    ``--spares``). ``step_pause``: seconds each rank sleeps before a step (a test's
    job on a small machine: the training loops leave the CPU to the processes that
    import torch meanwhile, the spares and replacements)."""
    run_dir, root = tmp / "run", tmp / "ckpt"
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LIVE_RUN_DIR": str(run_dir), "LIVE_CKPT_ROOT": str(root),
           "LIVE_TOTAL_STEPS": str(steps), "LIVE_KILL": kill, "LIVE_GROUPS": str(groups),
           "LIVE_LAYOUT": layout, "LIVE_CKPT_EVERY": str(checkpoint_every),
           "LIVE_WAIT_SPARE": str(int(wait_spare)), "LIVE_KEEP_LAST": str(keep_last),
           "LIVE_STEP_PAUSE": str(step_pause),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    sizes = ["--groups", str(groups), "--group-size", str(group_size)]
    if min_replicas is not None:
        sizes += ["--min-replicas", str(min_replicas)]
    supervisor = [sys.executable, "-m", "trainer.live.supervisor", *sizes,
                  "--host", "127.0.0.1", "--heartbeat-timeout", str(heartbeat_timeout),
                  "--quorum-timeout", str(quorum_timeout),
                  "--quorum-retries", str(quorum_retries), "--timeout", str(timeout),
                  # a process's first quorum waits for its peers' imports (minutes on a
                  # busy machine)
                  "--start-timeout", "600",
                  "--join-timeout", "5", "--respawn-delay", str(respawn_delay),
                  "--run-dir", str(run_dir),
                  "--job-timeout", "3000", *(extra or []), "--",
                  sys.executable, "-m", "tests.support.live_job"]
    script = 'ip link set lo up && exec "$@"'
    # To a file, not a pipe: torchft logs every quorum, and a full pipe nobody reads
    # would block the lighthouse and the groups.
    with open(tmp / "job.log", "ab") as log:
        proc = subprocess.Popen(["unshare", "-n", "sh", "-c", script, "sh", *supervisor],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = tmp / "job.log"  # type: ignore[attr-defined]
    return proc


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by SIGKILL
    return out


def group_records(run_dir: Path, groups: int = 3) -> dict[int, list[dict[str, Any]]]:
    """group -> its records (one process per group)."""
    return {g: read(run_dir / f"group-{g}.jsonl") for g in range(groups)}


def rank_records(run_dir: Path, groups: int, group_size: int
                 ) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(group, rank) -> that rank's records (groups of several ranks)."""
    return {(g, r): read(run_dir / f"group-{g}-rank-{r}.jsonl")
            for g in range(groups) for r in range(group_size)}


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def committed_at_least(run_dir: Path, step: int) -> bool:
    return any(r["event"] == "commit" and r["step"] >= step
               for recs in group_records(run_dir).values() for r in recs)


def stop_soon(run_dir: Path, ahead: int = 4) -> int:
    """End the job ``ahead`` steps after the newest commit; returns that step."""
    newest = max((r["step"] for recs in group_records(run_dir).values() for r in recs
                  if r["event"] == "commit"), default=0)
    (run_dir / "stop_at.tmp").write_text(str(newest + ahead))
    os.replace(run_dir / "stop_at.tmp", run_dir / "stop_at")
    return newest + ahead


def hold(run_dir: Path, ahead: int = 6) -> int:
    """Hold every group after the step ``ahead`` past the newest commit (a step none of
    them has passed yet); returns that step."""
    newest = max((r["step"] for recs in group_records(run_dir).values() for r in recs
                  if r["event"] == "commit"), default=0)
    (run_dir / "hold_at.tmp").write_text(str(newest + ahead))
    os.replace(run_dir / "hold_at.tmp", run_dir / "hold_at")
    return newest + ahead


def held(run_dir: Path, step: int) -> bool:
    """Whether every group waits at the hold of ``step``."""
    return all((run_dir / f"held-{g}-{step}").exists() for g in range(3))


def release(run_dir: Path) -> None:
    (run_dir / "hold_at").unlink()


def uninterrupted(group: int, step: int, rank: int = 0) -> tuple[str, dict[str, Any]]:
    """The RNG digest and data position ``group``'s ``rank`` starts ``step`` with in a run
    without failures: the streams keyed by (seed, group, rank, step), the sampler after
    step - 1 global batches (the job's seed 7)."""
    import random

    import numpy as np
    import torch

    from trainer.data import ResumableSampler
    from trainer.live.worker import key_rng, rng_state, state_digest

    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        key_rng(7, group, step, rank)
        rng = state_digest(rng_state())
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])
    sampler = ResumableSampler(SAMPLES, seed=7)
    for _ in range(step - 1):
        sampler.next_indices(GLOBAL_BATCH)
    return rng, sampler.state_dict()


def stop_after(run_dir: Path, records: dict[Any, list[dict[str, Any]]], ahead: int = 4) -> int:
    """End the job ``ahead`` steps after the newest commit in ``records``; returns that
    step."""
    newest = max((r["step"] for recs in records.values() for r in recs
                  if r["event"] == "commit"), default=0)
    (run_dir / "stop_at.tmp").write_text(str(newest + ahead))
    os.replace(run_dir / "stop_at.tmp", run_dir / "stop_at")
    return newest + ahead


def stop(proc: subprocess.Popen) -> None:
    """Stop a job's supervisor (SIGTERM: it stops its groups and lighthouse first)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def finish(proc: subprocess.Popen, timeout: float = 3000) -> None:
    """Wait for the job; AssertionError with the log's tail unless it ended well."""
    try:
        proc.wait(timeout=timeout)
    finally:
        stop(proc)
    if proc.returncode != 0:
        tail = Path(proc.log_path).read_text(errors="replace")[-6000:]  # type: ignore
        raise AssertionError(f"supervisor exited {proc.returncode}:\n{tail}")


if __name__ == "__main__":
    main()
