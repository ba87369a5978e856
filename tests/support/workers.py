"""Subprocess workers for the crash, resume, lock and signal tests, plus shared helpers.

Run a worker as ``python tests/support/workers.py <command> <args...>`` from the repository
root with ``PYTHONPATH=<repo root>`` (the repository is not installed); :class:`Worker` does exactly
that. The tests import this module for the deterministic state builders and comparisons, so
the worker and the test agree on what "the values that were saved" are.
"""

from __future__ import annotations

import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).resolve()


# --------------------------------------------------------------------------- test-side helpers


def worker_env(fault: str | None = None) -> dict[str, str]:
    """The environment of a worker: the repo importable, CKPT_FAULT only when asked for."""
    env = dict(os.environ)
    env.pop("CKPT_FAULT", None)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + old if old else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    if fault is not None:
        env["CKPT_FAULT"] = fault
    return env


class Worker:
    """A running worker process; its stdout and stderr are collected line by line."""

    def __init__(self, *args: Any, fault: str | None = None, script: Path = WORKER_SCRIPT) -> None:
        self.args = [str(a) for a in args]
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *self.args], cwd=str(REPO_ROOT),
            env=worker_env(fault), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def _drain(self, timeout: float) -> str | None:
        line = self._queue.get(timeout=timeout)
        if line is not None:
            self.lines.append(line)
        return line

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """Wait for the next output line starting with ``prefix``; return it."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line {prefix!r} within {timeout}s:\n{self.output}")
            try:
                line = self._drain(left)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait()
                raise AssertionError(
                    f"worker exited ({self.proc.returncode}) before printing {prefix!r}:\n"
                    f"{self.output}")
            if line.startswith(prefix):
                return line

    def finish(self, timeout: float = 120.0) -> int:
        """Wait for the process to end and for all of its output; return its status."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"worker did not finish within {timeout}s:\n{self.output}")
        self._reader.join(10)
        while True:
            try:
                if self._drain(0) is None:
                    break
            except queue.Empty:
                break
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


class ForkedProcess:
    """The parts of subprocess.Popen that Worker uses, for a multiprocessing.Process."""

    def __init__(self, process) -> None:
        self.process = process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.process.exitcode


class ForkedLines(Worker):
    """A Worker whose process is forked from the suite's fork server (tests/support/ranks.py:
    torch, torch._dynamo and ckpt imported once) instead of a fresh Python: ``target(*targs,
    out)`` writes its output lines to the pipe ``out``; SIGKILL and exit status as for a
    Worker. ``args`` names the run in messages."""

    def __init__(self, target: Any, targs: tuple, args: list[str]) -> None:
        from tests.support.ranks import forkserver

        ctx = forkserver()
        read, write = ctx.Pipe(duplex=False)
        self.args = args
        process = ctx.Process(target=target, args=(*targs, write))
        process.start()
        write.close()  # the child's copy is the only writer: its end is our EOF
        self.proc = ForkedProcess(process)
        self._stream = open(os.dup(read.fileno()), errors="replace")
        read.close()
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)


class ForkedWorker(ForkedLines):
    """A Worker run forked from the fork server: the same command, environment (CKPT_FAULT
    included), output lines, SIGKILL and exit status as ``Worker(*args, fault=fault)``."""

    def __init__(self, *args: Any, fault: str | None = None) -> None:
        argv = [str(a) for a in args]
        super().__init__(run_forked, (argv, worker_env(fault)), argv)


def run_forked(args: list[str], environ: dict[str, str], out) -> None:
    """ForkedWorker's process: ``workers.py ARGS...`` with ``environ``, output to ``out``."""
    import importlib

    import storage_backends.faults

    os.environ.clear()
    os.environ.update(environ)
    importlib.reload(storage_backends.faults)  # CKPT_FAULT is read at import
    for fd in (1, 2):
        os.dup2(out.fileno(), fd)
    out.close()
    COMMANDS[args[0]](*args[1:])


class ForkedCode(ForkedProcess):
    """``python -c CODE ARGS...`` with environment ``env``, in a process forked from the suite's
    fork server (no second import of torch): poll, wait, pid and returncode as a Popen's;
    ``communicate`` waits and returns its stdout and stderr."""

    def __init__(self, code: str, *args: Any, env: dict[str, str]) -> None:
        from tests.support.ranks import forkserver

        ctx = forkserver()
        pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
        super().__init__(ctx.Process(target=run_code, args=(
            code, [str(a) for a in args], env, *(w for _, w in pipes))))
        self.process.start()
        self._text: list[list[str]] = [[], []]
        self._readers = []
        for (read, write), text in zip(pipes, self._text):
            write.close()  # the child's copy is the only writer: its end is our EOF
            stream = open(os.dup(read.fileno()), errors="replace")
            read.close()
            reader = threading.Thread(target=lambda f=stream, t=text: t.append(f.read()),
                                      daemon=True)
            reader.start()
            self._readers.append(reader)

    def communicate(self, timeout: float) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.join()
            raise
        for reader in self._readers:
            reader.join(10)
        return "".join(self._text[0]), "".join(self._text[1])


def run_code(code: str, args: list[str], environ: dict[str, str], out, err) -> None:
    """ForkedCode's process: ``code`` as ``__main__`` with ``sys.argv == ["-c", *args]``."""
    import importlib

    import storage_backends.faults

    os.environ.clear()
    os.environ.update(environ)
    importlib.reload(storage_backends.faults)  # CKPT_FAULT is read at import
    for fd, conn in ((1, out), (2, err)):
        os.dup2(conn.fileno(), fd)
        conn.close()
    sys.argv = ["-c", *args]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact, type-exact equality of nested states (tensors, arrays, containers, scalars)."""
    import numpy as np
    import torch

    where = path or "<root>"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert tensor_bytes(a) == tensor_bytes(b), f"{where}: tensor bytes differ"
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{where}: ndarray vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{where}: array bytes differ"
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert sorted(map(repr, a)) == sorted(map(repr, b)), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def tensor_bytes(t) -> bytes:
    """The raw bytes of a tensor (any dtype, any layout), for bit-exact comparisons."""
    import torch

    c = t.detach().contiguous().reshape(-1)
    if c.numel() == 0:
        return b""
    return c.view(torch.uint8).numpy().tobytes()


def zeroed(state: dict) -> dict:
    """A restore template of the same layout: tensors zero-filled, plain values None."""
    import torch

    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


# --------------------------------------------------------------------------- shared states


def crash_state(step: int) -> dict:
    """What the crash worker saves as ``step``.

    Step 1 is one small tensor (one chunk, hence exactly one data file: the fault counter's
    first hit of every point in step 2 is then its 2nd hit in the process). Step 2 adds eight
    16 KiB tensors, cut into 4 KiB chunks written as several files in parallel.
    """
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    state: dict[str, Any] = {"a": torch.randn(16, generator=g),
                             "meta": {"step": step, "tag": f"s{step}"}}
    if step >= 2:
        for i in range(8):
            state[f"w{i}"] = torch.randn(64, 64, generator=g)
    return state


CRASH_OPTIONS = dict(write_threads=4, chunk_bytes=4096)


def cmd_crash_save(root: str) -> None:
    """Commit step 1, then save step 2 (where CKPT_FAULT, with nth=2, strikes)."""
    import ckpt

    mgr = ckpt.CheckpointManager(root, options=ckpt.SaveOptions(**CRASH_OPTIONS))
    mgr.save(1, crash_state(1))
    mgr.wait()
    print(f"committed 1 files={len(mgr.manifest(1).files)}", flush=True)
    mgr.save(2, crash_state(2))
    mgr.wait()
    print("committed 2", flush=True)
    mgr.close()


# -- deterministic training ---------------------------------------------------------------

TRAIN_STEPS = 60
TRAIN_EVERY = 5


def build_training():
    import torch

    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
    return model, opt, sched


def train_one(model, opt, sched) -> float:
    import random

    import numpy as np
    import torch

    x = torch.randn(32, 8)  # torch's RNG: data and dropout
    noise = random.random() + float(np.random.rand())  # Python's and NumPy's RNGs
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * noise
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss)


def cmd_train(root: str, out: str, sleep: str = "0") -> None:
    """Train TRAIN_STEPS steps, checkpointing every TRAIN_EVERY (async), resuming if it can.

    Prints ``start S`` once restored and ``step N`` after each step; writes the final model,
    optimizer, scheduler, progress and the next random numbers to ``out`` (torch.save).
    """
    import random

    import numpy as np
    import torch

    import ckpt

    torch.set_num_threads(1)
    random.seed(7)
    np.random.seed(7)
    model, opt, sched = build_training()
    state = {"model": model, "opt": opt, "sched": sched, "rng": ckpt.RNGState(),
             "progress": {"step": 0, "loss": None}}
    mgr = ckpt.CheckpointManager(root, every_steps=TRAIN_EVERY, keep_last=3,
                                 options=ckpt.SaveOptions(write_threads=2, chunk_bytes=4096))
    start = mgr.restore(state) or 0
    if state["progress"]["step"] != start:
        raise SystemExit(f"restored step {start} but the progress says {state['progress']}")
    print(f"start {start}", flush=True)
    for step in range(start + 1, TRAIN_STEPS + 1):
        loss = train_one(model, opt, sched)
        state["progress"] = {"step": step, "loss": loss}
        mgr.save(step, state)
        print(f"step {step}", flush=True)
        if float(sleep):
            time.sleep(float(sleep))
    mgr.close()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "progress": state["progress"],
                "next": (torch.rand(4), random.random(), np.random.rand(3))}, out)
    print("done", flush=True)


# -- locks and signals ----------------------------------------------------------------------


def cmd_hold_lock(root: str) -> None:
    """Hold the root's writer lock until killed."""
    import ckpt

    mgr = ckpt.CheckpointManager(root)  # noqa: F841 (held by this frame until the kill)
    print(f"locked pid={os.getpid()}", flush=True)
    while True:
        time.sleep(1)


def preempt_state(step: int) -> dict:
    import torch

    return {"x": torch.arange(1000, dtype=torch.float32) + step, "meta": {"step": step}}


def cmd_preempt(root: str) -> None:
    """save_on_preemption: the schedule never saves; SIGTERM makes the next save() save."""
    import ckpt

    mgr = ckpt.CheckpointManager(root, every_steps=10**9,
                                 schedule=ckpt.Schedule(save_on_preemption=True))
    print("ready", flush=True)
    step = 0
    while step < 10**6:
        step += 1
        print(f"saving {step}", flush=True)
        mgr.save(step, preempt_state(step))
        time.sleep(0.02)
    print("loop ended", flush=True)


def cmd_inflight(root: str, gate: str) -> None:
    """Start an async save whose writes block until the file ``gate`` exists, then idle."""
    import ckpt
    from storage_backends import PosixStorage

    class GatedStorage(PosixStorage):
        def write(self, path, buffers):
            while not os.path.exists(gate):
                time.sleep(0.01)
            return super().write(path, buffers)

    mgr = ckpt.CheckpointManager(GatedStorage(root))
    mgr.save(1, preempt_state(1))
    print("inflight", flush=True)
    for _ in range(6000):
        time.sleep(0.01)
    print("idle loop ended", flush=True)


COMMANDS = {
    "crash_save": cmd_crash_save,
    "train": cmd_train,
    "hold_lock": cmd_hold_lock,
    "preempt": cmd_preempt,
    "inflight": cmd_inflight,
}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](*sys.argv[2:])
