"""What ``restore(state, verify="forward")`` costs over the default ``verify="digest"``.

Two models, each saved once with a ``ckpt.Probe``, then restored ``--reps`` times per level,
interleaved (structure, digest, forward, ...), into the same live state:

* the demo: trainer/tiny_lm.py's training state (TinyLM, AdamW with its moments, scheduler,
  sampler), probe of 8 x 64 tokens;
* a ~1 GiB model: TinyLM widened to d_model 1024 and 21 layers (264 M fp32 parameters),
  model only (the worst case for the share: an optimizer's moments would add restore time
  and no forward time), probe of ``--big-probe`` tokens (default 2 x 16).

The forward check's parts are timed inside the real restores (by wrapping them): the copy
of the model kept to put back on failure, the probe's forward, and the NaN/Inf scan of the
weights (comparing the outputs is the rest). The page cache is warm unless ``--cold`` (root
only): a cold read makes restores slower and the check's share smaller.

Run from the repository root::

    python benchmarks/bench_forward_gate.py [--reps 5] [--only demo,1g] [--cold] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402

import ckpt  # noqa: E402
import ckpt._load.levels  # noqa: E402
import ckpt._load.probe  # noqa: E402
from trainer import tiny_lm  # noqa: E402

LEVELS = ("structure", "digest", "forward")
PARTS = {"model copy (put back on failure)": (ckpt._load.levels, "_copy_modules"),
         "probe forward": (ckpt._load.probe, "run_forward"),
         "NaN/Inf scan of the weights": (ckpt._load.probe, "nonfinite_weights")}


class PartTimer:
    """Wraps the gate's parts so each restore reports the seconds spent in each."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        for name, (module, attr) in PARTS.items():
            setattr(module, attr, self._wrap(name, getattr(module, attr)))

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def demo_state() -> tuple[dict, torch.Tensor, str]:
    tr = tiny_lm.make_training(0)
    tiny_lm.train_step(tr)  # AdamW's moments exist, as in a resumed run
    state = {"model": tr.model, "optim": tr.optimizer, "sched": tr.scheduler,
             "data": tr.sampler}
    inputs = tiny_lm.collate(tr.dataset, list(range(8)))[0]
    return state, inputs, "demo: TinyLM training state (model, AdamW, scheduler, sampler)"


def big_state(probe_shape: tuple[int, int]) -> tuple[dict, torch.Tensor, str]:
    torch.manual_seed(0)
    model = tiny_lm.TinyLM(d_model=1024, n_layers=21, n_heads=16)
    inputs = torch.randint(0, tiny_lm.VOCAB, probe_shape)
    return {"model": model}, inputs, "~1 GiB: TinyLM d_model 1024, 21 layers, model only"


def measure(label: str, state: dict, inputs: torch.Tensor, root: str, reps: int,
            cold: bool, timer: PartTimer) -> str:
    model = state["model"]
    params = sum(p.numel() for p in model.parameters())
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(probe=ckpt.Probe(inputs=inputs))) as mgr:
        mgr.save(1, state, force=True)
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    mgr = ckpt.CheckpointManager(root, read_only=True, metrics=False)
    dropped = []

    def case(level: str) -> Callable[[int], dict[str, float]]:
        def run(rep: int) -> dict[str, float]:
            if cold:
                dropped.append(common.drop_page_cache())
            timer.take()
            t0 = time.perf_counter()
            assert mgr.restore(state, verify=level) == 1
            out = {"s": time.perf_counter() - t0}
            out.update(timer.take())
            return out
        return run

    timings = common.run_interleaved([(f"restore verify={lv}", case(lv)) for lv in LEVELS],
                                     reps, progress=label.split(":")[0])
    mgr.close()
    rows = [common.Row(name, t["s"]) for name, t in timings.items()]
    forward = timings["restore verify=forward"]
    rows += [common.Row(f"  of which {part}", forward[part]) for part in PARTS if part in forward]
    digest = common.median(timings["restore verify=digest"]["s"])
    check = common.median(forward["s"]) - digest
    cache = ("cold page cache" if cold and all(dropped) else "warm page cache")
    return (f"\n### {label}: {params / 1e6:.1f} M parameters, {nbytes / common.MiB:.1f} MiB "
            f"on disk, probe {list(inputs.shape)} tokens; {cache}; median of {reps}, "
            f"interleaved\n\n" + common.time_table(rows, ["restore verify=digest"]) +
            f"\n\nThe forward check adds {check * 1e3:.1f} ms (median forward - median digest):"
            f" {check / common.median(forward['s']):.0%} of a forward-verified restore.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default="demo,1g", help="demo, 1g or both (default)")
    parser.add_argument("--big-probe", default="2x16", help="probe batch x tokens for 1g")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before each restore (needs root)")
    parser.add_argument("--dir", default=common.DEFAULT_DIR)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default). On a machine "
                             "shared with other busy processes, 1 avoids OpenMP threads "
                             "waiting on each other, which slows small forwards 10x or more")
    parser.add_argument("--quiet-wait", type=float, default=5.0,
                        help="before each timed case, wait up to this many seconds for the "
                             "CPUs to go idle (0: do not wait; default: 5)")
    args = parser.parse_args()
    common.GATE.max_wait = args.quiet_wait
    if args.threads:
        torch.set_num_threads(args.threads)
    only = {s for s in args.only.split(",") if s}
    shape = tuple(int(n) for n in args.big_probe.lower().split("x"))
    timer = PartTimer()
    base = common.fresh_dir(os.path.join(args.dir, "forward_gate"))
    out = []
    try:
        if "demo" in only:
            out.append(_run(demo_state(), base, "demo", args, timer))
        if "1g" in only:
            out.append(_run(big_state(shape), base, "1g", args, timer))
    finally:
        common.remove(base)
    print(f"machine: {common.machine_description()}; load {common.load_average()}; "
          f"code {common.code_version()}")
    print("".join(out))
    print(common.GATE.summary())


def _run(made: tuple[dict, torch.Tensor, str], base: str, name: str,
         args: argparse.Namespace, timer: PartTimer) -> str:
    state, inputs, label = made
    return measure(label, state, inputs, os.path.join(base, name), args.reps, args.cold, timer)


if __name__ == "__main__":
    main()
