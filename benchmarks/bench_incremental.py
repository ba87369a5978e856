"""Incremental saves and zstd compression: bytes written and save time.

Part 1, incremental: a 256 MiB state of 256 fp32 tensors (1 MiB chunks, so 256 chunks) is
saved once in full, then a given fraction of its chunks is changed and it is saved again, either in full or incrementally
(0%, 50% and 99% of chunks unchanged). Reported: bytes written, their ratio to the changed
fraction of the state (goal: within 2%), and save time, beside raw write+fsync of the state.

Part 2, compression: bf16 and fp32 weights (randn * 0.02) and Adam optimizer state
(exp_avg, exp_avg_sq after a few steps) saved with compression off, plain zstd (no byte
grouping, measured on the same chunks with zstandard directly) and ckpt's byte-grouped zstd
(level 1). Reported: size ratio (goals: bf16 >= 1.4x, fp32 >= 1.15x byte-grouped) and save
time against an uncompressed save, with the disk's write speed measured in the same run.

Run from the repository root::

    python benchmarks/bench_incremental.py [--reps 3]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402
import zstandard  # noqa: E402

import ckpt  # noqa: E402
from ckpt.options import DEFAULT_CHUNK_BYTES  # noqa: E402

MiB = common.MiB
INC_CHUNK = 1 * MiB  # small enough that "99% unchanged" means something on 256 MiB


def changed_copy(state: dict[str, torch.Tensor], unchanged: float, seed: int) -> dict:
    """``state`` with (1 - unchanged) of its chunks modified, chunk-aligned."""
    out = {k: v.clone() for k, v in state.items()}
    rows_per_chunk = INC_CHUNK // (common.COLUMNS * 4)
    chunks = [(k, r) for k, v in out.items() for r in range(0, v.shape[0], rows_per_chunk)]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(chunks), generator=g).tolist()
    n_changed = round(len(chunks) * (1 - unchanged))
    for i in order[:n_changed]:
        k, r = chunks[i]
        out[k][r:r + rows_per_chunk] += 1.0
    return out, n_changed / len(chunks)


def bench_incremental(args, root: str) -> str:
    size = 256 * MiB
    base = common.make_state(size, "many")
    nbytes = common.state_bytes(base)
    rows = []
    for unchanged in (0.0, 0.5, 0.99):
        new, changed = changed_copy(base, unchanged, seed=int(unchanged * 100))

        def run(incremental: bool):
            def case(rep: int) -> dict[str, float]:
                path = common.fresh_dir(os.path.join(root, "inc"))
                options = ckpt.SaveOptions(chunk_bytes=INC_CHUNK, incremental=incremental)
                with ckpt.CheckpointManager(path, async_save=False, options=options) as mgr:
                    mgr.save(1, base, force=True)
                    with common.Stopwatch() as sw:
                        r = mgr.save(2, new, force=True).wait()
                case.written = r.bytes_written
                return {"save": sw.seconds}
            return case

        def raw(rep: int) -> dict[str, float]:
            path = os.path.join(root, "raw.bin")
            with common.Stopwatch() as sw:
                common.raw_save(new, path)
            common.remove(path)
            return {"save": sw.seconds}

        full, inc = run(False), run(True)
        t = common.run_interleaved([("raw", raw), ("full", full), ("incremental", inc)],
                                   args.reps, progress=f"{unchanged:.0%} unchanged")
        raw_s = common.median(t["raw"]["save"])
        for name, case in (("full", full), ("incremental", inc)):
            s = common.median(t[name]["save"])
            rows.append([f"{unchanged:.0%}", name, f"{case.written / MiB:.1f}",
                         f"{case.written / nbytes:.3f}", f"{changed:.3f}",
                         f"{case.written / nbytes / max(changed, 1e-9):.3f}" if name ==
                         "incremental" else "-", f"{s:.3f}", f"{s / raw_s:.2f}"])
    return common.markdown_table(
        ["unchanged", "save", "MiB written", "written/state", "changed fraction",
         "written/changed", "median s", "/ raw write+fsync"], rows)


def adam_state(n: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    opt = torch.optim.Adam([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(n) * 1e-3
        opt.step()
    s = opt.state[p]
    return {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}


def plain_zstd_ratio(state: dict[str, torch.Tensor]) -> float:
    raw = stored = 0
    for t in state.values():
        view = common.byte_view(t.contiguous())
        for start in range(0, len(view), DEFAULT_CHUNK_BYTES):
            chunk = view[start:start + DEFAULT_CHUNK_BYTES]
            raw += len(chunk)
            stored += min(len(chunk), len(zstandard.ZstdCompressor(level=1).compress(chunk)))
    return raw / stored


def bench_compression(args, root: str) -> str:
    n = 32 * MiB  # elements
    states = {
        "bf16 weights": {"w": (torch.randn(n) * 0.02).to(torch.bfloat16)},
        "fp32 weights": {"w": torch.randn(n // 2) * 0.02},
        "Adam state (fp32)": adam_state(n // 4),
    }
    rows = []
    for label, state in states.items():
        nbytes = common.state_bytes(state)
        sizes = {}

        def saver(compression):
            def case(rep: int) -> dict[str, float]:
                path = os.path.join(root, "c")
                common.remove(path)
                opts = ckpt.SaveOptions(compression=compression)
                with common.Stopwatch() as sw:
                    r = ckpt.save(state, path, options=opts)
                sizes[compression] = r.bytes_written
                common.remove(path)
                return {"save": sw.seconds}
            return case

        def raw(rep: int) -> dict[str, float]:
            path = os.path.join(root, "raw.bin")
            with common.Stopwatch() as sw:
                common.raw_save(state, path)
            common.remove(path)
            return {"save": sw.seconds}

        t = common.run_interleaved([("raw", raw), ("off", saver(None)), ("zstd", saver("zstd"))],
                                   args.reps, progress=label)
        raw_s, off_s = (common.median(t[k]["save"]) for k in ("raw", "off"))
        zstd_s = common.median(t["zstd"]["save"])
        rows.append([label, f"{nbytes / MiB:.0f}", f"{common.gbps(nbytes, raw_s):.2f}",
                     f"{plain_zstd_ratio(state):.3f}", f"{nbytes / sizes['zstd']:.3f}",
                     f"{off_s:.3f}", f"{zstd_s:.3f}", f"{zstd_s / off_s:.2f}"])
    return common.markdown_table(
        ["state", "MiB", "disk GB/s (raw write+fsync)", "plain zstd ratio",
         "grouped zstd ratio", "save off s", "save zstd s", "zstd / off time"], rows)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], default_reps=3)
    root = common.fresh_dir(os.path.join(args.dir, "incremental"))
    print(f"# {common.machine_description()}; load {common.load_average()}; "
          f"code {common.code_version()}\n")
    print("## Incremental saves (256 MiB, 256 tensors, 1 MiB chunks)\n")
    print(bench_incremental(args, root) + "\n")
    print("## Compression (level 1, one writer thread per file, 2 threads)\n")
    print(bench_compression(args, root) + "\n")
    print(common.GATE.summary())
    common.remove(root)


if __name__ == "__main__":
    main()
