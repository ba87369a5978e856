"""The ``ckpt`` command: ``ls``, ``inspect``, ``verify`` and ``gc`` a checkpoint root.

Exit codes: 0 all good; 1 a check failed; 2 usage or environment error (missing root...).
Every subcommand takes ``--json`` for machine-readable output on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from .errors import CheckpointError, CheckpointNotFoundError
from .format import step_dir
from .manager import CheckpointManager

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = max(total, 1), 0, label
        self.enabled = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {_size(self.done)}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _open(root: str) -> CheckpointManager:
    return CheckpointManager(root, read_only=True)


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args.root) as mgr:
        rows = []
        for step in mgr.steps():
            try:
                m = mgr.manifest(step)
                rows.append({"step": step, "created": m.created, "bytes": sum(m.files.values()),
                             "files": len(m.files), "tensors": len(m.tensors),
                             "world_size": m.world_size, "status": "committed"})
            except CheckpointError as e:
                rows.append({"step": step, "created": None, "bytes": None, "files": None,
                             "tensors": None, "world_size": None, "status": f"bad: {e}"})
    if args.json:
        print(json.dumps({"root": mgr.root, "steps": rows}, indent=2))
        return EXIT_OK
    if not rows:
        print(f"{mgr.root}: no committed steps")
        return EXIT_OK
    print(_table(["STEP", "CREATED", "SIZE", "FILES", "TENSORS", "WORLD", "STATUS"], [
        [r["step"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"]))
         if r["created"] else "-", _size(r["bytes"]) if r["bytes"] is not None else "-",
         r["files"] or "-", r["tensors"] or "-", r["world_size"] or "-",
         r["status"][:60]] for r in rows]))
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    with _open(args.root) as mgr:
        step = args.step if args.step is not None else mgr.latest_step()
        if step is None:
            raise CheckpointNotFoundError(f"{mgr.root} holds no committed step", path=mgr.root)
        m = mgr.manifest(step)
    tensors = [{"key": k, "dtype": e.dtype, "shape": list(e.shape), "chunks": len(e.chunks),
                "bytes": e.nbytes, "files": sorted({c.file for c in e.chunks})}
               for k, e in m.tensors.items()]
    if args.json:
        print(json.dumps({"step": m.step, "world_size": m.world_size, "created": m.created,
                          "tensors": tensors, "aliases": m.aliases,
                          "items": {k: v["kind"] for k, v in m.items.items()},
                          "values": {k: v["tree"] for k, v in m.items.items()
                                     if v["kind"] == "value"},
                          "metadata": m.metadata}, indent=2))
        return EXIT_OK
    print(f"{mgr.root}/{step_dir(step)}  step {m.step}  world size {m.world_size}  "
          f"{len(tensors)} tensors  {_size(sum(t['bytes'] for t in tensors))}")
    print(_table(["TENSOR", "DTYPE", "SHAPE", "CHUNKS", "SIZE"],
                 [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                   t["chunks"], _size(t["bytes"])] for t in tensors]))
    for alias, target in m.aliases.items():
        print(f"{alias} -> {target} (same storage)")
    values = {k: v["tree"] for k, v in m.items.items() if v["kind"] == "value"}
    if values:
        print("values:", json.dumps(values)[:2000])
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    import verify  # the command is the one place in ckpt that reaches verify/

    with _open(args.root) as mgr:
        steps = mgr.steps() if args.all else [args.step if args.step is not None
                                              else mgr.latest_step()]
        if steps == [None] or not steps:
            raise CheckpointNotFoundError(f"{mgr.root} holds no committed step", path=mgr.root)
        reports = []
        for step in steps:
            total = 0
            if args.level == "digest":
                try:
                    total = sum(c.length for e in mgr.manifest(step).tensors.values()
                                for c in e.chunks)
                except CheckpointError:
                    pass
            progress = _Progress(total, f"step {step}") if total else None
            reports.append(verify.verify_step(mgr, step, args.level, progress))
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"root": mgr.root, "ok": ok, "steps": [vars(r) for r in reports]},
                         indent=2))
    else:
        for r in reports:
            status = "OK" if r.ok else "FAILED"
            print(f"step {r.step}: {status} ({r.level}; {r.tensors} tensors, {_size(r.bytes)}, "
                  f"{r.seconds:.2f}s)")
            for p in r.problems:
                print(f"  - {p}")
    return EXIT_OK if ok else EXIT_FAILED


def cmd_gc(args: argparse.Namespace) -> int:
    from storage_backends import LockHeldError, open_storage
    from storage_backends.locks import describe_owner

    from .incremental import collect
    from .manager import list_steps, retention

    storage = open_storage(args.root, create=False)
    if not storage.exists(""):
        raise CheckpointNotFoundError(f"checkpoint root {args.root} does not exist", path=args.root)
    lock = None
    if args.yes:
        try:
            lock = storage.lock(describe_owner())
        except LockHeldError as e:
            print(f"ckpt: {args.root} is in use by a writer ({e.holder}); gc needs the root "
                  "to itself", file=sys.stderr)
            return EXIT_FAILED
    try:
        steps = list_steps(storage)
        keep = (retention(steps, args.keep_last, args.keep_every)
                if args.keep_last is not None or args.keep_every is not None else None)
        leftovers = storage.uncommitted()
        report = collect(storage, keep, dry_run=not args.yes)
        for name in leftovers:
            if args.yes:
                storage.delete(name)
    finally:
        if lock is not None:
            lock.release()
    if args.json:
        print(json.dumps({**vars(report), "uncommitted": leftovers}, indent=2))
        return EXIT_OK
    verb = "removed" if args.yes else "would remove"
    print(f"{verb}: {len(report.retired_steps)} steps {report.retired_steps}, "
          f"{len(report.deleted_files)} files ({_size(report.freed_bytes)}), "
          f"{len(leftovers)} uncommitted leftovers; kept {len(report.kept_files)} files "
          "that kept steps still use")
    if not args.yes:
        print("dry run: nothing was deleted; add --yes to delete")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt", description="Inspect and verify checkpoints.",
                                     epilog="exit codes: 0 ok, 1 a check failed, 2 usage error")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list committed steps")
    p.add_argument("root")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("inspect", help="tensors, shapes, dtypes and values of a step")
    p.add_argument("root")
    p.add_argument("--step", type=int)
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check a step's integrity (newest by default)")
    p.add_argument("root")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--step", type=int)
    group.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--level", choices=["structure", "digest"], default="digest")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("gc", help="delete unreferenced data (dry run unless --yes)")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, help="also retire all but the newest N steps")
    p.add_argument("--keep-every", type=int, help="with --keep-last, also keep every K-th step")
    p.add_argument("--yes", action="store_true", help="really delete")
    p.set_defaults(func=cmd_gc)
    for p in sub.choices.values():
        p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CheckpointNotFoundError as e:
        print(f"ckpt: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as e:
        print(f"ckpt: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
