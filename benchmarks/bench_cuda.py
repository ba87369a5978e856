"""Saving from and restoring onto a CUDA device, against the copy floor and DCP, in one run.

A model of linear layers with Adam (state = parameters + two moments) lives on the GPU. For
each state size this prints:

1. The copy floor: device-to-host copy of every tensor into pinned buffers, and the reverse.
2. ckpt's asynchronous save, with the device copy overlapped (the default) and without
   (``overlap_device_copy=False``): how long ``save()`` blocks the CPU, how much longer the
   next training step is than a step without a save, and the step time while the
   background writer runs.
3. DCP ``async_save`` blocking time (default, and with its pinned ``DefaultStager``).
4. Restore onto the GPU with the page cache dropped (when root): a one-thread raw read of
   ckpt's files, ckpt ``restore``, ``dcp.load``; and the ratio to min(disk, host-to-device).

Goals (reported, not asserted): the step after a save longer by <= 0.2x the device-to-host
copy; restore >= 0.8x min(disk read, host-to-device bandwidth).

Without a CUDA device it says so and exits 0. ``--device cpu`` runs every measurement on
the CPU instead, as a dry run of this script (the figures mean nothing; the page cache is
not dropped): tests/gpu/test_device_check.py runs it, so that a mistake here shows before a GPU
is lent. Run from the repository root::

    python benchmarks/bench_cuda.py [--sizes 2G] [--reps 3] [--device cpu]
"""

from __future__ import annotations

import glob
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402

import ckpt  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
WIDTH = 4096
DEVICE = torch.device("cuda")  # main() sets it from --device


def sync() -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make_training(state_bytes: int):
    """Linear layers of fp32 with Adam (state = 3x the parameter bytes): WIDTH x WIDTH, or
    narrower where one such layer would exceed ``state_bytes`` (a dry run's small sizes)."""
    width = WIDTH
    while width > 64 and 3 * width * width * 4 > state_bytes:
        width //= 2
    layers = max(1, state_bytes // 3 // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width)
                                  for _ in range(layers)]).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(256, width, device=DEVICE)
    step(model, optimizer, batch)  # creates Adam's moments
    return model, optimizer, batch


def step(model, optimizer, batch) -> float:
    sync()
    t0 = time.perf_counter()
    optimizer.zero_grad()
    model(batch).square().mean().backward()
    optimizer.step()
    sync()
    return time.perf_counter() - t0


def tensors_of(model, optimizer) -> list[torch.Tensor]:
    out = list(model.parameters())
    for s in optimizer.state.values():
        # by type: torch.device("cuda") != the tensors' torch.device("cuda", 0)
        out += [v for v in s.values()
                if isinstance(v, torch.Tensor) and v.device.type == DEVICE.type]
    return out


@torch.no_grad()  # the host-to-device copy writes into parameters
def copy_floor(tensors: list[torch.Tensor], reps: int) -> tuple[list[float], list[float]]:
    pin = DEVICE.type == "cuda"
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
    d2h, h2d = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for b, t in zip(pinned, tensors):
            b.copy_(t, non_blocking=True)
        sync()
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b, t in zip(pinned, tensors):
            t.copy_(b, non_blocking=True)
        sync()
        h2d.append(time.perf_counter() - t0)
    return d2h, h2d


def ckpt_saves(model, optimizer, batch, root: str, reps: int, overlap: bool) -> dict:
    options = ckpt.SaveOptions(overlap_device_copy=overlap)
    state = {"model": model, "optim": optimizer}
    out: dict[str, list[float]] = {"block": [], "next": [], "during": []}
    with ckpt.CheckpointManager(common.fresh_dir(root), keep_last=1, options=options,
                                schedule=ckpt.Schedule(handle_sigterm=False), metrics=False) as mgr:
        mgr.prepare(state)
        for i in range(1, reps + 1):
            sync()
            t0 = time.perf_counter()
            mgr.save(i, state)
            out["block"].append(time.perf_counter() - t0)
            out["next"].append(step(model, optimizer, batch))
            handle = mgr._saver.inflight
            while handle is not None and not handle.done():
                out["during"].append(step(model, optimizer, batch))
            mgr.wait()
    return out


def dcp_blocking(model, optimizer, root: str, reps: int,
                 stager: bool) -> tuple[list[float], str | None]:
    """The seconds each ``dcp.async_save`` call blocked, and what stopped the calls (or None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    kwargs = {}
    times: list[float] = []
    try:
        if stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = DEVICE.type == "cuda"  # pinned memory and non-blocking copies need one
            # pinned memory, shared memory, staging in the background, non-blocking copies
            kwargs["async_stager"] = DefaultStager(StagingOptions(gpu, True, True, gpu))
        for i in range(reps):
            model_sd, optim_sd = get_state_dict(model, optimizer)
            sync()
            t0 = time.perf_counter()
            result = dcp.async_save({"model": model_sd, "optim": optim_sd},
                                    checkpoint_id=common.fresh_dir(f"{root}/{i}"), **kwargs)
            times.append(time.perf_counter() - t0)
            future = getattr(result, "upload_completion", result)
            future.result()
    except Exception as e:  # report, do not hide: DCP's stager has failed here before
        return times, (f"failed after {len(times)} calls (torch {torch.__version__}): "
                       f"{type(e).__name__}: {e}")
    finally:
        if "async_stager" in kwargs:
            kwargs["async_stager"].close()
    return times, None


def restores(model, optimizer, root: str, dcp_root: str, reps: int, drop: bool) -> dict:
    """Cold reads (``drop``: the page cache dropped before each) of ckpt's files, ckpt
    ``restore`` and ``dcp.load``, interleaved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = {"model": model, "optim": optimizer}
    with ckpt.CheckpointManager(common.fresh_dir(root), async_save=False, metrics=False,
                                schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        mgr.save(1, state)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=common.fresh_dir(dcp_root))
    files = sorted(glob.glob(f"{root}/step-00000001/data-*"))
    nbytes = sum(os.path.getsize(f) for f in files)
    out: dict[str, list[float]] = {"raw read": [], "ckpt restore": [], "dcp.load": []}
    buf = bytearray(64 << 20)
    cold = common.drop_page_cache if drop else (lambda: None)
    for _ in range(reps):
        cold()
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
        out["raw read"].append(time.perf_counter() - t0)
        cold()
        with ckpt.CheckpointManager(root, read_only=True, metrics=False) as mgr:
            sync()
            t0 = time.perf_counter()
            mgr.restore(state, step=1)
            sync()
            out["ckpt restore"].append(time.perf_counter() - t0)
        cold()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sync()
        t0 = time.perf_counter()
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_root)
        sync()
        out["dcp.load"].append(time.perf_counter() - t0)
    out["bytes"] = [nbytes]
    return out


def bench(size: int, reps: int, workdir: str, drop: bool) -> str:
    model, optimizer, batch = make_training(size)
    tensors = tensors_of(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    base = [step(model, optimizer, batch) for _ in range(max(5, reps))]
    d2h, h2d = copy_floor(tensors, reps)
    over = ckpt_saves(model, optimizer, batch, f"{workdir}/ckpt", reps, overlap=True)
    wait = ckpt_saves(model, optimizer, batch, f"{workdir}/ckpt", reps, overlap=False)
    dcp_default = dcp_blocking(model, optimizer, f"{workdir}/dcp", reps, stager=False)
    dcp_staged = dcp_blocking(model, optimizer, f"{workdir}/dcp", reps, stager=True)
    back = restores(model, optimizer, f"{workdir}/restore", f"{workdir}/dcp-restore", reps,
                    drop)
    step_s = common.median(base)
    rows = [common.Row("training step, no save", base),
            common.Row("device-to-host copy floor (pinned)", d2h),
            common.Row("host-to-device copy floor (pinned)", h2d)]
    for name, r in (("overlapped", over), ("overlap off", wait)):
        rows += [common.Row(f"ckpt save() blocks ({name})", r["block"]),
                 common.Row(f"ckpt next step ({name})", r["next"]),
                 common.Row(f"ckpt step during the write ({name})", r["during"] or [float("nan")])]
    notes = []
    for name, (times, note) in (("DCP async_save blocks (default)", dcp_default),
                                ("DCP async_save blocks (DefaultStager, pinned)", dcp_staged)):
        if times:
            rows.append(common.Row(name, times))
        if note:
            notes.append(f"{name}: {note}")
    cache = "cold" if drop else "warm"
    for name in ("raw read", "ckpt restore", "dcp.load"):
        rows.append(common.Row(f"{name} ({cache})" if name != "raw read"
                               else f"raw read of ckpt's files, one thread ({cache})", back[name]))
    table = common.time_table(rows, anchors=[rows[0].name, rows[1].name])
    d2h_s = common.median(d2h)
    disk = back["bytes"][0] / common.median(back["raw read"])
    h2d_bw = nbytes / common.median(h2d)
    summary = [
        f"State {nbytes / 1e9:.2f} GB on {device_name()}; {reps} reps.",
        f"Next step longer by {(common.median(over['next']) - step_s) / d2h_s:.2f}x the "
        f"device-to-host copy overlapped, {(common.median(wait['next']) - step_s) / d2h_s:.2f}x "
        "without (goal <= 0.2x).",
        f"Restore {back['bytes'][0] / common.median(back['ckpt restore']) / 1e9:.2f} GB/s = "
        f"{back['bytes'][0] / common.median(back['ckpt restore']) / min(disk, h2d_bw):.2f}x "
        f"min(disk {disk / 1e9:.2f}, host-to-device {h2d_bw / 1e9:.2f} GB/s) (goal >= 0.8x); "
        f"dcp.load {back['bytes'][0] / common.median(back['dcp.load']) / 1e9:.2f} GB/s.",
    ] + notes
    if abs(nbytes - back["bytes"][0]) > 0.02 * back["bytes"][0]:
        summary.append(f"WARNING: the copy floor moved {nbytes / 1e9:.3f} GB, ckpt's files hold "
                       f"{back['bytes'][0] / 1e9:.3f} GB: the ratios above compare unlike things.")
    return f"### {common.format_size(size)} state on the GPU\n\n{table}\n\n" + "\n".join(summary)


def device_name() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name(DEVICE)
    return "the CPU (a dry run of the script: the figures mean nothing)"


def code_version() -> str:
    """common.code_version, or CKPT_COMMIT where the tree was copied without its .git
    (benchmarks/device_check.sh on a device machine)."""
    version = common.code_version()
    if version.startswith("unknown") and os.environ.get("CKPT_COMMIT"):
        return f"{os.environ['CKPT_COMMIT']} (from CKPT_COMMIT: no .git here)"
    return version


def main() -> None:
    global DEVICE
    args = common.parse_args(
        __doc__.splitlines()[0], default_reps=3, extra=lambda p: p.add_argument(
            "--device", choices=["cuda", "cpu"], default="cuda",
            help="cpu: a dry run of every measurement on the CPU (default: cuda)"))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("No CUDA device: bench_cuda.py measured nothing (skipped; --device cpu runs "
              "the script's code on the CPU as a dry run).")
        return
    DEVICE = torch.device(args.device)
    workdir = common.fresh_dir(os.path.join(args.dir, "cuda"))
    print(f"Machine: {common.machine_description()}")
    print(f"Data directory: {common.describe_dir(workdir)}")
    print(f"ckpt code: commit {code_version()}")
    # a dry run leaves the page cache alone: other processes of a shared machine use it
    drop = DEVICE.type == "cuda" and common.drop_page_cache()
    print(f"Page cache {'dropped before each read' if drop else 'WARM (not dropped)'}\n")
    for size in args.sizes:
        print(bench(size, args.reps, workdir, drop) + "\n", flush=True)
    common.remove(workdir)


if __name__ == "__main__":
    main()
