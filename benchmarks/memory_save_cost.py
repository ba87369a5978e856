"""What a save into the memory tier costs training (``bench_memory_tier.py --save-cost``).

Four ways to keep an in-memory copy of the same state (a GPT-like set of fp32 tensors,
``common.make_state``), each run beside a training-like CPU loop (an MLP's forward, backward
and AdamW step, a few milliseconds, torch's default intra-op threads):

- **copy floor**: ``copy_`` of every tensor into preallocated host buffers; nothing after.
- **copy + digest floor**: the memory tier's own copy with its digests and nothing else
  (``Slab.fill``: each 1 MiB block copied with non-temporal stores, then digested from the
  source while it is still in the caches, on torch's thread count) into an anonymous
  mapping laid out as a slab: no segment, no planning, no publish. What a save that
  digests every chunk cannot avoid.
- **ckpt memory tier**: ``CheckpointManager(memory_tier=MemoryTierOptions(persist_every=
  10**6), async_save=True).save()``: memory only (the root is never written), so the save is
  the copy into ``/dev/shm`` plus what the background writer does to publish it there. The
  copy outlives the process.
- **GEMINI** (lm-resiliency 0.2.0): ``InMemoryCheckpointManager(InMemoryCkptConfig(
  interval=1, disk_flush_interval=0)).save(state, step)`` as its docs say, after the optimizer
  step, and ``maybe_wait()`` before the next save; on CPU its capture is a ``copy_`` into its
  own buffers. Its copy dies with the process.

First, without timing the training loop, where a save's time goes (``bench_save_parts``):
each method's blocking wall and CPU time and, for the memory tier, the CPU time of its
background publish, interleaved, three times the repetitions; then the same for a model
and its AdamW state saved as items (``bench_model_parts``: 1024 tensors of several sizes,
the copy floor taking both ``state_dict()``\ s too), where the save's work per tensor
shows. Every case of both tables starts after ``LEAD_IN`` untimed training steps, as a
save in a training loop does.

Per save: **blocking** (the call's wall time), **training time lost**: the wall time of
the save plus a window of ``W`` training steps, minus the ``W`` steps run just before the
save (paired within the case: drifts of the machine between cases cancel; the "idle" case,
with no save between its windows, shows the noise left), and **CPU added**: the same
difference in the process's CPU time (every thread's), which other processes on a loaded
machine disturb less than the wall time; ``W`` is three times the memory tier's background
work, at most 150 steps or 10 s (the table says how often a method's background work still
ran when the window ended: its cost is then undercounted). Cases interleaved (idle, copy,
copy + digest, ckpt, GEMINI; each repetition starting one further), medians.

lm-resiliency registers a torchrun rendezvous plugin (an entry point) that every torchrun
agent of the environment then imports, seconds of CPU each, and that fails to register with
torch 2.13 (a warning in every agent's log): install it where no torchrun jobs run, e.g.
``pip install --no-deps --target DIR lm-resiliency==0.2.0`` and ``PYTHONPATH=DIR`` for this
benchmark. Then, each in a fresh process after four saves: bytes
resident in ``/dev/shm`` (allocated blocks) and the growth of the process's resident set
(anonymous and shared pages apart).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Callable

import common
import torch

import ckpt

COPY, CKPT, GEMINI, IDLE = "copy floor", "ckpt memory tier", "GEMINI capture", "idle"
DIGEST = "copy + digest floor"
METHODS = (COPY, DIGEST, CKPT, GEMINI)
GOAL = 1.2  # training time lost by a memory-tier save, at most this times the copy floor's
# Untimed training steps before each timed case: a save is called between training steps,
# not on a machine that idled (the quiet gate's wait). After an idle spell a VM's cores wake
# slowly, which costs threads that hand the GIL to each other (the memory tier's fill) more
# than OpenMP's threads (torch's copy_): docs/memory-tier.md, "How fast".
LEAD_IN = 3


class Training:
    """A training-like CPU loop: a 4-layer MLP (512 wide, batch 32) with AdamW."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(32, 512)

    def step(self) -> None:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()


def _gemini(workdir: str):
    from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig

    config = InMemoryCkptConfig(interval=1, disk_flush_interval=0,
                                disk_folder=os.path.join(workdir, "gemini"),
                                run_id=f"bench{uuid.uuid4().hex[:8]}")
    return InMemoryCheckpointManager(config)


def _ckpt(workdir: str) -> ckpt.CheckpointManager:
    tier = ckpt.MemoryTierOptions(persist_every=1_000_000, job=f"bench{uuid.uuid4().hex[:10]}")
    return ckpt.CheckpointManager(tempfile.mkdtemp(prefix="ckpt-root-", dir=workdir),
                                  memory_tier=tier, async_save=True,
                                  schedule=ckpt.Schedule(handle_sigterm=False))


def _digest_floor(state: dict[str, torch.Tensor]):
    """A slab over anonymous memory, laid out for ``state`` (see DIGEST), and its helper
    threads' pool (to shut down)."""
    from ckpt._memory import slabs

    boxes = [(k, (0,) * t.dim(), t) for k, t in state.items()]
    header, placements = slabs.plan(boxes, ckpt.SaveOptions().chunk_bytes)
    size = len(header) + sum(p.nbytes for p in placements.values())
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    slab = slabs.Slab("", header, placements, size, mapping, (0, 0))
    pool = cf.ThreadPoolExecutor(max(1, torch.get_num_threads() - 1))
    slab.workers = lambda n: pool
    return slab, pool


def _close_ckpt(mgr: ckpt.CheckpointManager) -> None:
    segment = mgr._publisher.tier.path if mgr._publisher else None
    mgr.close()
    if segment:  # memory-only steps: close() keeps the segment for a restart
        shutil.rmtree(segment, ignore_errors=True)


def bench_save_cost(size: int, reps: int, workdir: str) -> str:
    state = common.make_state(size, "many")
    buffers = common.empty_like_state(state)
    for k in state:
        buffers[k].copy_(state[k])  # resident before any timed copy
    training = Training()
    training.steps(5)
    mgr, gem = _ckpt(workdir), _gemini(workdir)
    floor_slab, floor_pool = _digest_floor(state)
    floor_slab.fill(state, threads=torch.get_num_threads())  # its pages written once
    step = [0]
    handles: list = []

    def save_ckpt() -> float:
        step[0] += 1
        t0 = time.perf_counter()
        handles.append(mgr.save(step[0], state))
        return time.perf_counter() - t0

    # Warm up: the memory tier's first saves make its slabs, GEMINI allocates its buffers;
    # then size the window to cover the memory tier's background work.
    for _ in range(3):
        save_ckpt()
        handles[-1].wait()
        gem.save(state, step[0])
        gem.maybe_wait()
    t0 = time.perf_counter()
    one = time.perf_counter()
    training.steps(10)
    step_s = (time.perf_counter() - one) / 10
    save_ckpt()
    blocking0 = time.perf_counter() - t0
    while not handles[-1].done():
        training.step()
    background = time.perf_counter() - t0 - blocking0
    window = max(20, min(math.ceil(3 * background / step_s) + 5, 150, math.ceil(10 / step_s)))
    print(f"  [save cost {common.format_size(size)}] step {step_s * 1e3:.1f} ms, background "
          f"{background * 1e3:.0f} ms: window {window} steps", file=sys.stderr, flush=True)
    outlasted = {CKPT: 0, GEMINI: 0}

    def paired(save: Callable[[], float]) -> dict[str, float]:
        """``W`` training steps, then the save and ``W`` steps: the second window's wall
        and CPU time minus the first's, and the save's blocking time."""
        training.steps(LEAD_IN)
        with common.Stopwatch() as before:
            training.steps(window)
        with common.Stopwatch() as sw:
            block = save()
            training.steps(window)
        return {"lost": sw.seconds - before.seconds, "block": block,
                "cpu": sw.cpu_seconds - before.cpu_seconds}

    def timed(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def idle(rep: int) -> dict[str, float]:
        return paired(lambda: 0.0)

    def copy(rep: int) -> dict[str, float]:
        def save() -> None:
            for k, t in state.items():
                buffers[k].copy_(t)
        return paired(lambda: timed(save))

    def copy_digest(rep: int) -> dict[str, float]:
        return paired(lambda: timed(lambda: floor_slab.fill(
            state, threads=torch.get_num_threads())))

    def memory_tier(rep: int) -> dict[str, float]:
        handles[-1].wait()
        out = paired(save_ckpt)
        outlasted[CKPT] += not handles[-1].done()
        handles[-1].wait()
        return out

    def gemini(rep: int) -> dict[str, float]:
        step[0] += 1
        out = paired(lambda: timed(lambda: gem.save(state, step[0])))
        thread = getattr(gem, "_completion_thread", None)
        outlasted[GEMINI] += bool(thread is not None and thread.is_alive())
        gem.maybe_wait()
        return out

    label = f"save cost {common.format_size(size)}"
    timings = common.run_interleaved([(IDLE, idle), (COPY, copy), (DIGEST, copy_digest),
                                      (CKPT, memory_tier), (GEMINI, gemini)], reps,
                                     progress=label)
    _close_ckpt(mgr)
    gem.close()
    floor_pool.shutdown()
    lost = {name: common.median(timings[name]["lost"]) for name in METHODS}
    cpu = {name: common.median(timings[name]["cpu"]) for name in METHODS}
    noise = sorted(abs(x) for x in timings[IDLE]["lost"])
    block = {name: common.median(timings[name]["block"]) for name in METHODS}
    rows = []
    for name in METHODS:
        rows.append([name, f"{block[name] * 1e3:.0f}", f"{block[name] / block[COPY]:.2f}",
                     f"{lost[name] * 1e3:.0f}", f"{lost[name] / lost[COPY]:.2f}",
                     f"{cpu[name] * 1e3:.0f}", f"{cpu[name] / cpu[COPY]:.2f}",
                     f"{outlasted.get(name, 0)}/{reps}"])
    # Judged on the larger of the two ratios: the blocking time is steady but misses what a
    # save leaves running after it returns; the training time lost counts that, within the
    # noise the idle case shows.
    ratio = lost[CKPT] / lost[COPY] if lost[COPY] > 0 else float("nan")
    judged = max(ratio, block[CKPT] / block[COPY])
    verdict = ("met" if judged <= GOAL else "NOT met") if ratio == ratio else \
        "not resolved (the copy floor's loss is within the noise)"
    return "\n".join([
        f"### Save cost: {common.format_size(common.state_bytes(state))} in {len(state)} "
        f"tensors, {reps} interleaved repetitions, medians", "",
        f"Training loop: {step_s * 1e3:.1f} ms per step idle, {torch.get_num_threads()} "
        f"intra-op threads; window {window} steps (the memory tier's background work took "
        f"{background * 1e3:.0f} ms in the sizing run). The windows with no save between "
        f"them (idle) differ by {common.median(noise) * 1e3:.0f} ms in the median, "
        f"{noise[-1] * 1e3:.0f} ms at most: the training-lost column's noise.", "",
        common.markdown_table(["method", "blocking ms", "/ copy floor", "training lost ms",
                               "/ copy floor", "CPU added ms", "/ copy floor",
                               "background outlasted the window"], rows), "",
        f"Goal: the memory tier's training time lost <= {GOAL}x the copy floor's, judged on "
        f"the larger of that ratio ({ratio:.2f}x) and the blocking time's "
        f"({block[CKPT] / block[COPY]:.2f}x): {verdict} (in CPU time added, which other "
        f"processes on a loaded machine disturb less, {cpu[CKPT] / cpu[COPY]:.2f}x). Against "
        f"the copy + digest floor (what keeping every chunk's digest costs): training time lost "
        f"{lost[CKPT] / lost[DIGEST]:.2f}x, CPU added {cpu[CKPT] / cpu[DIGEST]:.2f}x; the "
        f"floor itself {lost[DIGEST] / lost[COPY]:.2f}x and {cpu[DIGEST] / cpu[COPY]:.2f}x "
        "the copy floor's.", "",
    ])


def bench_save_parts(size: int, reps: int, workdir: str) -> str:
    """Where a memory-tier save's time goes, the training loop untimed: the copy floor, the
    copy + digest floor, and the save's blocking part (wall and CPU) and background part
    (the process's CPU while the caller waits for it: the writer's), interleaved."""
    state = common.make_state(size, "many")
    buffers = common.empty_like_state(state)
    mgr = _ckpt(workdir)
    floor_slab, floor_pool = _digest_floor(state)
    threads = torch.get_num_threads()
    training = Training()
    step = [0]

    def copy(rep: int) -> dict[str, float]:
        training.steps(LEAD_IN)
        with common.Stopwatch() as sw:
            for k, t in state.items():
                buffers[k].copy_(t)
        return {"wall": sw.seconds, "cpu": sw.cpu_seconds, "background": 0.0}

    def copy_digest(rep: int) -> dict[str, float]:
        training.steps(LEAD_IN)
        with common.Stopwatch() as sw:
            floor_slab.fill(state, threads=threads)
        return {"wall": sw.seconds, "cpu": sw.cpu_seconds, "background": 0.0}

    def memory_tier(rep: int) -> dict[str, float]:
        step[0] += 1
        training.steps(LEAD_IN)
        with common.Stopwatch() as sw:
            handle = mgr.save(step[0], state)
        with common.Stopwatch() as waited:
            handle.wait()
        return {"wall": sw.seconds, "cpu": sw.cpu_seconds, "background": waited.cpu_seconds}

    cases = [(COPY, copy), (DIGEST, copy_digest), (CKPT, memory_tier)]
    timings = _warm_then_interleaved(cases, reps, f"save parts {common.format_size(size)}")
    _close_ckpt(mgr)
    floor_pool.shutdown()
    rows, total_copy = [], None
    for name, _ in cases:
        t = timings[name]
        total = common.median([c + b for c, b in zip(t["cpu"], t["background"])])
        total_copy = total_copy or total
        rows.append([name, f"{common.median(t['wall']) * 1e3:.1f} ({min(t['wall']) * 1e3:.1f})",
                     f"{common.median(t['cpu']) * 1e3:.1f} ({min(t['cpu']) * 1e3:.1f})",
                     f"{common.median(t['background']) * 1e3:.1f}", f"{total * 1e3:.1f}",
                     f"{total / total_copy:.2f}"])
    return "\n".join([
        f"### Where a save's time goes: {common.format_size(common.state_bytes(state))} in "
        f"{len(state)} tensors, {threads} threads, {LEAD_IN} untimed training steps before "
        f"each, {reps} interleaved repetitions, medians (minimum)", "",
        common.markdown_table(["method", "blocking wall ms", "blocking CPU ms",
                               "background CPU ms", "CPU in all ms", "/ copy floor"], rows),
        "",
    ])


def _warm_then_interleaved(cases: list, reps: int, progress: str) -> common.Timings:
    """Each case three times untimed (the slabs made, every page written once), then
    ``reps`` interleaved repetitions."""
    for _ in range(3):
        for _, fn in cases:
            fn(0)
    return common.run_interleaved(cases, reps, progress=progress)


def _model_and_optimizer(size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of 128 linear layers (1024 inputs, a bias each) with AdamW after one step:
    ``size`` bytes in all, a third parameters, two thirds the optimizer's moments, 1024
    tensors (the moments, a step count per parameter, the parameters)."""
    rows = max(1, size // (3 * MODEL_LAYERS * (COLUMNS_IN + 1) * 4))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(COLUMNS_IN, rows)
                                  for _ in range(MODEL_LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


MODEL_LAYERS, COLUMNS_IN = 128, 1024


def bench_model_parts(size: int, reps: int, workdir: str) -> str:
    """A training state as a loop saves it (a module and its optimizer as items, each taken
    apart through ``state_dict()``, many tensors of several sizes): the copy floor is both
    ``state_dict()`` calls and a ``copy_`` of each of their tensors into warm buffers (what
    any capture of them does); the memory tier's save, its blocking wall and CPU time."""
    model, optimizer = _model_and_optimizer(size)

    def tensors() -> list[torch.Tensor]:
        moments = [v for s in optimizer.state_dict()["state"].values() for v in s.values()]
        return list(model.state_dict().values()) + moments

    buffers = [torch.empty_like(t) for t in tensors()]
    total = sum(t.numel() * t.element_size() for t in buffers)
    mgr = _ckpt(workdir)
    training = Training()
    step = [0]

    def copy(rep: int) -> dict[str, float]:
        training.steps(LEAD_IN)
        with common.Stopwatch() as sw:
            for b, t in zip(buffers, tensors()):
                b.copy_(t)
        return {"wall": sw.seconds, "cpu": sw.cpu_seconds}

    def memory_tier(rep: int) -> dict[str, float]:
        step[0] += 1
        training.steps(LEAD_IN)
        with common.Stopwatch() as sw:
            mgr.save(step[0], {"model": model, "optimizer": optimizer}).wait()
        return {"wall": sw.seconds, "cpu": sw.cpu_seconds}

    cases = [(COPY, copy), (CKPT, memory_tier)]
    timings = _warm_then_interleaved(cases, reps, f"model parts {common.format_size(size)}")
    _close_ckpt(mgr)
    wall = {name: common.median(timings[name]["wall"]) for name, _ in cases}
    cpu = {name: common.median(timings[name]["cpu"]) for name, _ in cases}
    rows = [[name, f"{wall[name] * 1e3:.1f} ({min(timings[name]['wall']) * 1e3:.1f})",
             f"{wall[name] / wall[COPY]:.2f}", f"{cpu[name] * 1e3:.1f}",
             f"{cpu[name] / cpu[COPY]:.2f}"] for name, _ in cases]
    per_tensor = (wall[CKPT] - wall[COPY]) / len(buffers)
    return "\n".join([
        f"### A model and AdamW: {common.format_size(total)} in {len(buffers)} tensors "
        f"({MODEL_LAYERS} linear layers), {reps} interleaved repetitions, medians (minimum)",
        "", common.markdown_table(["method", "blocking wall ms", "/ copy floor",
                                   "blocking CPU ms", "/ copy floor"], rows), "",
        f"The memory tier's save took {per_tensor * 1e6:.1f} us a tensor more than the copy "
        "floor (its bookkeeping: the state taken apart, the slab's plan and digests, the "
        "manifest and the publish).", "",
    ])


# -- resident memory, one fresh process per method --------------------------------------------

def _status_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssShmem", "RssFile"):
                out[name] = int(value.split()[0])
    return out


def _allocated(path: str) -> int:
    """Bytes allocated (blocks) under ``path``."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def memory_probe(method: str, size: int, workdir: str) -> dict:
    """In a fresh process: four saves, then /dev/shm bytes and the resident set's growth."""
    state = common.make_state(size, "many")
    before = _status_kib()
    shm = 0
    if method == COPY:
        buffers = common.empty_like_state(state)
        for _ in range(4):
            for k, t in state.items():
                buffers[k].copy_(t)
        after = _status_kib()
    elif method == CKPT:
        mgr = _ckpt(workdir)
        for s in range(1, 5):
            mgr.save(s, state).wait()
        after = _status_kib()
        shm = _allocated(mgr._publisher.tier.path)
        _close_ckpt(mgr)
    else:
        gem = _gemini(workdir)
        for s in range(1, 5):
            gem.save(state, s)
            gem.maybe_wait()
        after = _status_kib()
        gem.close()
    return {"shm": shm, **{k: (after[k] - before[k]) * 1024 for k in before}}


def bench_memory(size: int, workdir: str) -> str:
    rows = []
    for method in (COPY, CKPT, GEMINI):
        out = subprocess.run(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "bench_memory_tier.py"),
             "--save-memory-probe", method, "--sizes", str(size), "--dir", workdir],
            check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append([method, f"{r['shm'] / size:.2f}", f"{r['RssAnon'] / size:.2f}",
                     f"{r['RssShmem'] / size:.2f}",
                     f"{(r['shm'] + r['RssAnon']) / size:.2f}"])
    return "\n".join([
        f"### Resident memory after four saves of {common.format_size(size)} (x the state; "
        "a fresh process each)", "",
        common.markdown_table(["method", "/dev/shm", "RSS anonymous", "RSS shared (mapped "
                               "/dev/shm, counted in /dev/shm already)",
                               "RAM in all (/dev/shm + anonymous)"], rows), "",
    ])


def run(args) -> str:
    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="save-cost-", dir=args.dir)
    parts = []
    try:
        for size in args.sizes:
            parts.append(bench_save_parts(size, 3 * args.reps, workdir))
            parts.append(bench_model_parts(size, 3 * args.reps, workdir))
            parts.append(bench_save_cost(size, args.reps, workdir))
            parts.append(bench_memory(size, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return "\n".join(parts)
