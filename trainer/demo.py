"""The main job: train the tiny LM, SIGKILL it mid-run, resume it, prove nothing changed.

    python -m trainer.demo [--steps 300] [--every 25] [--root DIR] [--seed S]

1. A reference run trains uninterrupted (no checkpoints) and saves its final state.
2. A checkpointed run is killed with SIGKILL at a random moment (25%-75% of the reference
   run's training time), then restarted; it resumes from its newest checkpoint by itself.
3. Both final states are loaded into fresh objects and compared tensor by tensor.

Exit status 0 only if the states are bit-identical and every kept checkpoint verifies.
Workers are this same module with ``--worker``; they talk to the parent through stdout lines.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # RNGState only holds NumPy's state when NumPy is installed
    np = None

# Bit-exact CPU results need the same intra-op thread count in every process.
THREADS = 1
KEEP_LAST = 3
WORKER_TIMEOUT_S = 300.0


def _build_state(tr: Any, rng: Any, meta: Any) -> dict[str, Any]:
    return {"model": tr.model, "optim": tr.optimizer, "sched": tr.scheduler, "rng": rng,
            "data": tr.sampler, "meta": meta}


def _dir_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _step_path(root: Path, step: int) -> Path:
    from ckpt.inspect import step_dir

    return root / step_dir(step)


def _say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> int:
    """Train for ``args.steps`` steps; with a CheckpointManager unless ``--no-checkpoint``."""
    import ckpt
    from trainer.tiny_lm import make_training, train_step

    torch.set_num_threads(THREADS)
    tr = make_training(args.seed, total_steps=args.steps)
    state = _build_state(tr, ckpt.RNGState(), {"step": 0, "loss": None})

    if args.no_checkpoint:
        _say("ready start=0")
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            state["meta"] = {"step": step, "loss": train_step(tr)}
            _say(f"step {step} loss={state['meta']['loss']:.4f}")
        _say(f"loop_s={time.perf_counter() - t0:.4f}")
        ckpt.save(state, args.out)
        _say("done")
        return 0

    root = Path(args.root)
    with ckpt.CheckpointManager(root, every_steps=args.every, keep_last=KEEP_LAST) as mgr:
        start = mgr.restore(state)
        _say(f"ready start={start or 0}")
        if start is not None:  # the killed run never got to report this step's size
            _say(f"ckpt step={start} bytes={_dir_bytes(_step_path(root, start))}")
        pending: tuple[int, Any] | None = None
        for step in range((start or 0) + 1, args.steps + 1):
            state["meta"] = {"step": step, "loss": train_step(tr)}
            _say(f"step {step} loss={state['meta']['loss']:.4f}")
            t0 = time.perf_counter()
            handle = mgr.save(step, state)
            blocking = time.perf_counter() - t0
            if handle is None:
                continue
            _say(f"save step={step} blocking_ms={blocking * 1e3:.2f}")
            # Size the previous checkpoint now: mgr.save let at most one save be in flight, so
            # it is committed, and keep_last has not pruned it yet.
            if pending is not None:
                _report_size(root, *pending)
            pending = (step, handle)
        mgr.wait()
        if pending is not None:
            _report_size(root, *pending)
    ckpt.save(state, args.out)
    _say("done")
    return 0


def _report_size(root: Path, step: int, handle: Any) -> None:
    result = handle.wait()
    write_s = getattr(result, "write_seconds", None)
    _say(f"ckpt step={step} bytes={_dir_bytes(_step_path(root, step))}"
         + ("" if write_s is None else f" write_ms={write_s * 1e3:.1f}"))


# ---------------------------------------------------------------------------- parent


@dataclass
class WorkerRun:
    """What one worker process printed and how it ended."""

    lines: list[str] = field(default_factory=list)
    returncode: int | None = None
    killed: bool = False
    kill_after_s: float | None = None

    def values(self, prefix: str) -> list[str]:
        return [ln[len(prefix):] for ln in self.lines if ln.startswith(prefix)]

    @property
    def last_step(self) -> int | None:
        steps = self.values("step ")
        return int(steps[-1].split()[0]) if steps else None

    def loss(self, which: int) -> float | None:
        losses = [float(f["loss"]) for f in self.fields("step ")]
        return losses[which] if losses else None

    @property
    def start(self) -> int | None:
        starts = self.values("ready start=")
        return int(starts[0]) if starts else None

    def fields(self, prefix: str) -> list[dict[str, str]]:
        """Parse ``prefix k=v k=v`` lines into dicts (words without ``=`` are skipped)."""
        return [dict(kv.split("=", 1) for kv in ln.split() if "=" in kv)
                for ln in self.values(prefix)]

    def tail(self, n: int = 20, cap: int = 80) -> str:
        """The last ``n`` lines, or from the first traceback on (its root cause is there)."""
        first_tb = next((i for i, ln in enumerate(self.lines) if ln.startswith("Traceback")), None)
        shown = self.lines[-n:] if first_tb is None else self.lines[first_tb:first_tb + cap]
        return "\n".join("    | " + ln for ln in shown)


def run_worker(extra: list[str], kill_after_s: float | None = None) -> WorkerRun:
    """Run ``python -m trainer.demo --worker ...``; SIGKILL it ``kill_after_s`` after it is
    ready."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS),
               PYTHONUNBUFFERED="1")
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.demo", "--worker", *extra], cwd=repo, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run = WorkerRun(kill_after_s=kill_after_s)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.lines.append(line.rstrip("\n"))
            if line.startswith("ready "):
                ready.set()
        ready.set()  # EOF: never wait on a worker that died before it was ready

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if kill_after_s is not None:
            ready.wait(WORKER_TIMEOUT_S)
            try:
                proc.wait(timeout=kill_after_s)
            except subprocess.TimeoutExpired:
                # The whole process group: a background writer process must die too.
                os.killpg(proc.pid, signal.SIGKILL)
                run.killed = True
        proc.wait(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join()
    run.returncode = proc.returncode
    return run


def _load_final(path: Path, seed: int, steps: int) -> dict[str, Any]:
    """Load a final state saved by a worker into freshly built objects; return plain data."""
    import copy

    import ckpt
    from trainer.tiny_lm import make_training

    tr = make_training(seed, total_steps=steps)
    rng = ckpt.RNGState()
    state = _build_state(tr, rng, None)
    ckpt.load(state, path)
    if tr.model.lm_head.weight is not tr.model.embed.weight:
        raise AssertionError(f"{path}: after ckpt.load, lm_head.weight is no longer tied")
    return copy.deepcopy({
        "model": tr.model.state_dict(), "optim": tr.optimizer.state_dict(),
        "sched": tr.scheduler.state_dict(), "rng": rng.state_dict(),
        "data": tr.sampler.state_dict(), "meta": state["meta"],
    })


def diff(a: Any, b: Any, path: str = "", counts: dict[str, int] | None = None) -> list[str]:
    """Paths where ``a`` and ``b`` differ; tensors must match in dtype, shape and every bit."""
    counts = counts if counts is not None else {}
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        counts["tensors"] = counts.get("tensors", 0) + 1
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [path or "<root>"]
    if np is not None and (isinstance(a, np.ndarray) or isinstance(b, np.ndarray)):
        counts["arrays"] = counts.get("arrays", 0) + 1
        same = (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype == b.dtype and np.array_equal(a, b))
        return [] if same else [path or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} on one side only"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}/{k}", counts)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}/{i}", counts)]
    counts["values"] = counts.get("values", 0) + 1
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} vs {b!r}"]


def _verifier() -> tuple[Any, str] | None:
    """``ckpt.verify_step(root, step)`` if ckpt has it, else the ``ckpt verify`` command's."""
    import ckpt

    if callable(getattr(ckpt, "verify_step", None)):
        return ckpt.verify_step, "ckpt.verify_step"
    try:
        from verify import verify
    except ImportError:
        return None
    return (lambda root, step: verify(str(root), step, level="digest")), "verify.verify (digest)"


def _verify(root: Path, steps: list[int]) -> tuple[bool | None, list[str]]:
    """Verify every kept step; None (and a note) when no verifier exists yet."""
    found = _verifier()
    if found is None:
        return None, ["neither ckpt.verify_step nor verify.verify exists yet: skipped"]
    verify_step, name = found
    ok, notes = True, []
    for step in steps:
        try:
            result = verify_step(root, step)
        except Exception as e:  # any failure to verify is a failed check, reported by step
            ok = False
            notes.append(f"step {step}: FAILED: {type(e).__name__}: {e}")
            continue
        good = result is not False and getattr(result, "ok", True) is not False
        ok = ok and good
        problems = getattr(result, "problems", None) or []
        notes.append(f"step {step}: {'ok' if good else 'FAILED'} ({name})"
                     + "".join(f"\n    - {p}" for p in problems))
    return ok, notes


def _fail(msg: str, *runs: WorkerRun) -> int:
    _say(f"FAILED: {msg}")
    for run in runs:
        _say(f"  worker exit status {run.returncode}; last output:\n{run.tail()}")
    return 1


def main_job(args: argparse.Namespace) -> int:
    """Reference run, killed run, resumed run, comparison, summary."""
    import ckpt

    t_start = time.perf_counter()
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="ckpt-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        _say(f"--root {root} is not empty; give an empty or new directory")
        return 2
    ckpt_root, ref_out, final_out = root / "checkpoints", root / "reference", root / "resumed"
    common = ["--steps", str(args.steps), "--every", str(args.every), "--seed", str(args.seed)]
    _say(f"ckpt demo: tiny LM, {args.steps} steps, checkpoint every {args.every}, seed "
         f"{args.seed}, root {root}")

    _say("[1/4] reference run (no checkpoints) ...")
    ref = run_worker([*common, "--no-checkpoint", "--out", str(ref_out)])
    if ref.returncode != 0 or not ref.values("loop_s="):
        return _fail("reference run failed", ref)
    loop_s = float(ref.values("loop_s=")[0])
    _say(f"      {args.steps} steps in {loop_s:.2f}s ({loop_s / args.steps * 1e3:.1f} ms/step)")

    kill_rng = random.Random(args.kill_seed)
    kill_after = kill_rng.uniform(0.25, 0.75) * loop_s
    _say(f"[2/4] checkpointed run, SIGKILL after {kill_after:.2f}s of training ...")
    worker_args = [*common, "--root", str(ckpt_root), "--out", str(final_out)]
    first = run_worker(worker_args, kill_after_s=kill_after)
    if not first.killed:
        return _fail("the checkpointed run ended before it could be killed", first)
    killed_at = first.last_step or 0
    _say(f"      killed after step {killed_at}")

    _say("[3/4] restarting; the worker resumes from its newest checkpoint ...")
    second = run_worker(worker_args)
    if second.returncode != 0 or second.start is None:
        return _fail("resumed run failed", second)
    restored = second.start
    _say(f"      restored step {restored}, trained to step {second.last_step}")

    _say("[4/4] comparing final states and verifying checkpoints ...")
    torch.set_num_threads(THREADS)
    counts: dict[str, int] = {}
    differences = diff(_load_final(ref_out, args.seed, args.steps),
                       _load_final(final_out, args.seed, args.steps), counts=counts)
    with ckpt.CheckpointManager(ckpt_root, read_only=True) as mgr:
        kept = mgr.steps()
    verified, verify_notes = _verify(ckpt_root, kept)

    saves = [(run_name, f) for run_name, run in (("killed", first), ("resumed", second))
             for f in run.fields("save ")]
    written = [f for run in (first, second) for f in run.fields("ckpt ")]
    sizes = {int(f["step"]): int(f["bytes"]) for f in written}
    write_ms = {int(f["step"]): float(f["write_ms"]) for f in written if "write_ms" in f}
    for step in kept:
        sizes.setdefault(step, _dir_bytes(_step_path(ckpt_root, step)))

    _say("")
    _say("=== summary ===")
    def fmt(loss: float | None) -> str:
        return "-" if loss is None else f"{loss:.4f}"

    _say(f"loss {fmt(ref.loss(0))} at step 1 -> {fmt(ref.loss(-1))} at step {args.steps} "
         f"(reference); the resumed run ends at {fmt(second.loss(-1))}")
    _say(f"killed at step {killed_at}, restored from step {restored}: "
         f"{killed_at - restored} steps lost and redone")
    _say(f"{'run':8} {'step':>6} {'blocking ms':>12} {'write ms':>9} {'bytes on disk':>15}")
    for run_name, f in saves:
        step = int(f["step"])
        if step in sizes:
            size = f"{sizes[step]:,}"
        else:  # the kill came before this save committed, or it was pruned unsized
            size = "(not committed)" if run_name == "killed" and step > restored else "(pruned)"
        wms = f"{write_ms[step]:.1f}" if step in write_ms else "-"
        _say(f"{run_name:8} {step:>6} {float(f['blocking_ms']):>12.2f} {wms:>9} {size:>15}")
    blocking = [float(f["blocking_ms"]) for _, f in saves]
    if blocking:
        _say(f"{len(saves)} saves; blocking ms: mean {sum(blocking) / len(blocking):.2f}, "
             f"max {max(blocking):.2f}")
    _say(f"bytes written by completed saves: {sum(sizes.values()):,}; on disk now "
         f"({len(kept)} kept: {kept}): {_dir_bytes(ckpt_root):,}")
    _say(f"compared {counts.get('tensors', 0)} tensors, {counts.get('arrays', 0)} arrays and "
         f"{counts.get('values', 0)} values "
         f"(model, optimizer, scheduler, RNG, sampler, meta)")
    if differences:
        _say(f"final state DIFFERS from the reference in {len(differences)} places:")
        for d in differences[:20]:
            _say(f"  {d}")
    else:
        _say("final state is bit-identical to the uninterrupted reference run")
    for note in verify_notes:
        _say(f"verify: {note}")
    _say(f"demo took {time.perf_counter() - t_start:.1f}s")
    ok = not differences and verified is not False
    _say("PASS" if ok else f"FAIL (files kept in {root})")
    if ok and not args.root:
        shutil.rmtree(root)  # the temp dir made above; a failed run's is kept to inspect
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps (default 25)")
    p.add_argument("--root", help="empty directory for checkpoints (default: a new temp dir)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument("--kill-seed", type=int, default=None, help="seed for the kill moment")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-checkpoint", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps <= 0 or args.every <= 0:
        p.error("--steps and --every must be positive")
    if args.worker and (not args.out or (not args.no_checkpoint and not args.root)):
        p.error("--worker needs --out, and --root unless --no-checkpoint")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else main_job(args)


if __name__ == "__main__":
    sys.exit(main())
