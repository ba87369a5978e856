"""The restart path of bench_live.py: the live job's training under real torchrun agents.

Three agents on this machine, each a "node" with one worker running
tests/support/live_torchrun_job.py (``trainer.ElasticTrainer``), joined by a c10d
rendezvous on a store hosted here (an agent hosting it would take the job down with it).
A kill SIGKILLs every process of one node at once (agent, worker, and with warm restarts
its launcher and zygote) and wipes that node's memory-tier directory (its RAM is gone);
a replacement node's agent is started at once, as the live supervisor starts a
replacement group. Warm restarts: the agents start the workers through ``-m trainer.warm``
(docs/warm-restarts.md).

The processes of a node are found by their environment (``LIVE_BENCH_JOB``, unique per
job, and ``LIVE_BENCH_NODE``), which torchrun, the warm launcher and the zygote pass on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tests" / "support" / "live_torchrun_job.py")

#: torchrun's c10d rendezvous settings, shortened from its defaults (last call 30 s, a
#: node's keep-alive 5 s x 3) to the shortest that docs/elastic.md finds safe: a dead node
#: leaves the round about 4 s after its last keep-alive (a live one's can be nearly two
#: intervals old), and a round short of the maximum waits 3 s for more nodes. This gives
#: the restart path its best showing.
RDZV_CONF = ("is_host=false,last_call_timeout=3,keep_alive_interval=1,"
             "keep_alive_max_attempt=4,join_timeout=600")
#: torchrun's own rendezvous timings (the store still hosted here).
RDZV_DEFAULTS = "is_host=false"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by SIGKILL
    return out


class TorchrunJob:
    """Local torchrun agents (``--nnodes=2:3``) training the live job's model."""

    def __init__(self, work: Path, *, warm: bool, rdzv_conf: str = RDZV_CONF) -> None:
        import torch.distributed as dist

        self.work, self.warm, self.rdzv_conf = work, warm, rdzv_conf
        self.run_dir = work / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   multi_tenant=True)
        self.job = f"{os.getpid()}-{time.time_ns()}"
        self.nodes: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def add_node(self) -> str:
        name = f"node{len(self.nodes)}"
        shm = self.work / "shm" / name
        shm.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, LIVE_BENCH_JOB=self.job, LIVE_BENCH_NODE=name,
                   LIVE_BENCH_SHM=str(shm), CKPT_NODE=name,
                   # every node may die, that of rank 0 too (../shared/FINDINGS.md)
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PET_LOG_DIR=str(self.work / "torchelastic"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        if self.warm:
            env["CKPT_WARM_DIR"] = str(self.work / "warm")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3",
               "--nproc-per-node=1", "--max-restarts=1000", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{self.store.port}", "--rdzv-id=live-bench",
               f"--rdzv-conf={self.rdzv_conf}", "--local-addr=127.0.0.1",
               *(["-m", "trainer.warm"] if self.warm else []), SCRIPT,
               "--root", str(self.work / "ckpt"), "--run-dir", str(self.run_dir)]
        with open(self.work / f"{name}.log", "w") as log:
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True))
        self.nodes.append(name)
        return name

    def pids(self, node: str | None = None) -> list[int]:
        """This job's processes (of ``node`` only, if given)."""
        want = f"LIVE_BENCH_JOB={self.job}".encode()
        node_want = f"LIVE_BENCH_NODE={node}".encode() if node else None
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if want in env and (node_want is None or node_want in env):
                out.append(int(entry))
        return out

    def kill(self, node: str) -> float:
        """SIGKILL every process of ``node`` at once; returns the time of the kill."""
        pids = self.pids(node)
        killed = time.time()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.work / "shm" / node, ignore_errors=True)
        return killed

    def close(self) -> None:
        for _ in range(20):  # a zygote may fork a worker while we kill
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # -- what the workers recorded ---------------------------------------------------------
    def attempts(self) -> dict[int, dict[str, Any]]:
        """{attempt: {"world", "ranks": {rank: pid}, "restored", "steps": [records]}}."""
        out: dict[int, dict[str, Any]] = {}
        for adir in sorted(self.run_dir.glob("attempt-*")):
            info = out[int(adir.name.split("-")[1])] = {"world": None, "ranks": {},
                                                        "restored": None, "steps": []}
            for path in adir.glob("rank-*.jsonl"):
                for r in read_jsonl(path):
                    if r["event"] == "start":
                        info["world"] = r["world"]
                        info["ranks"][r["rank"]] = r["pid"]
                    elif r["event"] == "restored":
                        info["restored"] = r["step"]
                    elif r["event"] == "step":
                        info["steps"].append(r)
        for info in out.values():  # each step record with its process
            for r in info["steps"]:
                r["pid"] = info["ranks"].get(r["rank"])
        return out

    def node_of(self, pid: int | None) -> str | None:
        try:
            return json.loads((self.run_dir / "procs" / f"{pid}.json").read_text())["node"]
        except (OSError, ValueError, KeyError):
            return None


def _whole(job: TorchrunJob, since: float, steps: int, dead: set[str]) -> int | None:
    """The newest attempt if it runs at world 3 on live nodes and each of its ranks
    committed ``steps`` steps after ``since``; else None."""
    attempts = job.attempts()
    if not attempts:
        return None
    n = max(attempts)
    a = attempts[n]
    if a["world"] != 3 or len(a["ranks"]) < 3:
        return None
    if any(job.node_of(pid) in dead or job.node_of(pid) is None for pid in a["ranks"].values()):
        return None
    recent = [r for r in a["steps"] if r["time"] > since]
    if all(sum(r["rank"] == rank for r in recent) >= steps for rank in a["ranks"]):
        return n
    return None


def _past(job: TorchrunJob, whole: int, last: int) -> bool | None:
    """Whether an attempt after ``whole`` committed a step past ``last``."""
    return any(r["step"] > last for n, a in job.attempts().items() if n > whole
               for r in a["steps"]) or None


def _wait(predicate: Any, timeout: float, what: str, job: TorchrunJob) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value is not None:
            return value
        time.sleep(0.05)
    logs = "\n".join((job.work / f"{n}.log").read_text(errors="replace")[-3000:]
                     for n in job.nodes)
    raise TimeoutError(f"timed out waiting for {what}\n{logs}")


def _survivors_stepped(job: TorchrunJob, whole: int, dead: set[str]) -> bool | None:
    """Whether a worker on a surviving node committed a step in an attempt after ``whole``."""
    return any(job.node_of(r["pid"]) not in dead
               for n, a in job.attempts().items() if n > whole for r in a["steps"]) or None


def _starts(job: TorchrunJob, attempt: int) -> list[dict[str, Any]]:
    return [r for p in (job.run_dir / f"attempt-{attempt:04d}").glob("rank-*.jsonl")
            for r in read_jsonl(p) if r["event"] in ("start", "failure")]


def run_torchrun(work: Path, trials: int, *, warm: bool, late: bool = False,
                 rdzv_conf: str = RDZV_CONF) -> list[dict[str, Any]]:
    """One torchrun job of three nodes; ``trials`` node kills; one timeline per kill.

    The lost node's replacement (a new agent) starts at once, or with ``late`` once the
    survivors have committed a step without it (a node that takes longer to come than the
    survivors to restart). A timeline has bench_live's keys, plus ``worlds`` (the world
    sizes of the attempts until the job was whole again) and the survivors' restart:
    ``detect_s`` (the first survivor's failure record), ``spawn_s`` (their first new
    worker process; a warm one: its launcher) and ``group_s`` (their process group formed).
    """
    job = TorchrunJob(work, warm=warm, rdzv_conf=rdzv_conf)
    timelines = []
    dead: set[str] = set()
    try:
        for _ in range(3):
            job.add_node()
        since = 0.0
        for trial in range(trials):
            whole = _wait(lambda: _whole(job, since, 3, dead), 900, "a whole job", job)
            ranks = job.attempts()[whole]["ranks"]
            victim = job.node_of(ranks[1 + trial % 2])
            killed = job.kill(victim)
            dead.add(victim)
            if late:
                _wait(lambda: _survivors_stepped(job, whole, dead), 900,
                      "the survivors' first step", job)
            replacement = job.add_node()
            again = _wait(lambda: _whole(job, killed, 1, dead), 900, "the recovery", job)
            last = max(r["step"] for n, a in job.attempts().items() if n <= whole
                       for r in a["steps"])
            _wait(lambda: _past(job, whole, last), 900, f"a step past {last}", job)
            attempts = job.attempts()
            after = sorted((r for n, a in attempts.items() if n > whole for r in a["steps"]),
                           key=lambda r: r["time"])
            first = next(r for r in after if job.node_of(r["pid"]) not in dead | {replacement})
            # steps trained again: each restart's restored step against the newest step
            # committed before it
            lost, reached = 0, last
            for n in range(whole + 1, max(attempts) + 1):
                a = attempts.get(n)
                if a is None or a["restored"] is None:
                    continue
                lost += max(0, reached - a["restored"])
                reached = max([reached, *(r["step"] for r in a["steps"])])
            nxt = [r for n in range(whole + 1, max(attempts) + 1) for r in _starts(job, n)
                   if r["event"] == "start" and job.node_of(r["pid"]) not in dead]
            nxt_attempt = min(r["attempt"] for r in nxt)
            nxt = [r for r in nxt if r["attempt"] == nxt_attempt]
            failures = [r["time"] for r in _starts(job, whole) if r["event"] == "failure"]
            timelines.append({
                "survivors_next_step_s": first["time"] - killed,
                "past_kill_step_s": next(r["time"] for r in after if r["step"] > last)
                - killed,
                "replacement_first_step_s": next(
                    r["time"] for r in after if job.node_of(r["pid"]) == replacement)
                - killed,
                "steps_lost": lost,
                "restarts": again - whole,
                "worlds": [attempts[n]["world"] for n in range(whole + 1, again + 1)
                           if n in attempts],
                "detect_s": min(failures, default=float("nan")) - killed,
                "spawn_s": min(r.get("launcher_start") or r["process_start"] for r in nxt)
                - killed,
                "group_s": max(r["group_ready"] for r in nxt) - killed,
            })
            since = killed
    finally:
        job.close()
        job.store = None
    return timelines


__all__ = ["RDZV_CONF", "RDZV_DEFAULTS", "TorchrunJob", "run_torchrun"]
