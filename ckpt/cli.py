"""The ``ckpt`` command: ``ls``, ``inspect``, ``verify``, ``diff``, ``export`` and ``gc``.

Exit codes: 0 all good; 1 a check failed; 2 usage or environment error (missing root...).
Every subcommand takes ``--json`` for machine-readable output on stdout. This module parses
arguments and prints; the checks, comparisons, exports and their renderings live in the
``verify`` package (usable as a library).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

import verify
from verify.report import EXIT_FAILED, EXIT_OK, EXIT_USAGE, size, table

from .errors import CheckpointError, CheckpointLockedError, CheckpointNotFoundError
from .format import step_dir
from .manager import CheckpointManager


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
    print(table(["STEP", "CREATED", "SIZE", "FILES", "TENSORS", "WORLD", "STATUS"], [
        [r["step"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"]))
         if r["created"] else "-", size(r["bytes"]) if r["bytes"] is not None else "-",
         r["files"] or "-", r["tensors"] or "-", r["world_size"] or "-",
         r["status"][:60]] for r in rows]))
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    with _open(args.root) as mgr:
        step = _steps(mgr, args)[0]
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
          f"{len(tensors)} tensors  {size(sum(t['bytes'] for t in tensors))}")
    print(table(["TENSOR", "DTYPE", "SHAPE", "CHUNKS", "SIZE"],
                 [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                   t["chunks"], size(t["bytes"])] for t in tensors]))
    for alias, target in m.aliases.items():
        print(f"{alias} -> {target} (same storage)")
    values = {k: v["tree"] for k, v in m.items.items() if v["kind"] == "value"}
    if values:
        print("values:", json.dumps(values)[:2000])
    return EXIT_OK


def _steps(mgr: CheckpointManager, args: argparse.Namespace) -> list[int]:
    """The steps a command asks for: ``--all``, ``--step N`` or the newest."""
    if getattr(args, "all", False):
        steps = mgr.steps()
    elif args.step is not None:
        _check_step(mgr, args.step)
        steps = [args.step]
    else:
        latest = mgr.latest_step()
        steps = [] if latest is None else [latest]
    if not steps:
        raise CheckpointNotFoundError(f"{mgr.root} holds no committed step", path=mgr.root)
    return steps


def _check_step(mgr: CheckpointManager, step: int) -> None:
    steps = mgr.steps()
    if step not in steps:
        have = steps if len(steps) <= 8 else [*steps[:3], "...", *steps[-3:]]
        raise CheckpointNotFoundError(
            f"{mgr.root} has no committed step {step}; it has {have} (see `ckpt ls`)",
            path=mgr.root)


def cmd_verify(args: argparse.Namespace) -> int:
    if args.level != "forward" and (args.model or args.loss or args.rtol is not None
                                    or args.atol is not None):
        raise verify.UsageError("--model, --loss, --rtol and --atol are for --level forward")
    reports = []
    with _open(args.root) as mgr:
        for step in _steps(mgr, args):
            progress = None
            if args.level != "structure":  # drawn only when stderr is a terminal
                try:
                    total = sum(c.length for e in mgr.manifest(step).tensors.values()
                                for c in e.chunks)
                    progress = verify.ProgressBar(total, f"step {step}")
                except CheckpointError:
                    pass  # the verifier reports it
            reports.append(verify.verify_step(
                mgr, step, args.level, progress, model=args.model, loss=args.loss,
                rtol=args.rtol, atol=args.atol, threads=args.threads))
        report = verify.Report(mgr.root, reports)
    print(verify.to_json(report.to_dict()) if args.json else verify.render_verify(report))
    return report.exit_code


def cmd_diff(args: argparse.Namespace) -> int:
    with _open(args.root) as mgr:
        for step in (args.a, args.b):
            _check_step(mgr, step)
        result = verify.diff_steps(mgr, args.a, args.b, threads=args.threads)
    print(verify.to_json(result.to_dict()) if args.json else verify.render_diff(result))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    if args.to == "hf":
        return _export_hf(args)
    with _open(args.root) as mgr:
        step = _steps(mgr, args)[0]
        result = verify.export_step(mgr, step, args.to, args.file, item=args.item,
                                    force=args.force, threads=args.threads)
    print(verify.to_json(vars(result)) if args.json else verify.render_export(result))
    return EXIT_OK


def _export_hf(args: argparse.Namespace) -> int:
    from verify.export_hf import DEFAULT_SHARD_BYTES, export_hf, parse_size, render_hf_export

    shard = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_SHARD_BYTES
    with _open(args.root) as mgr:
        result = export_hf(mgr, _steps(mgr, args)[0], args.file, item=args.item,
                           force=args.force, max_shard_bytes=shard, threads=args.threads)
    print(verify.to_json(vars(result)) if args.json else render_hf_export(result))
    return EXIT_OK


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
            raise CheckpointLockedError(f"{args.root} is in use by a writer ({e.holder}); "
                                        "gc --yes needs the root to itself",
                                        path=args.root) from None
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
          f"{len(report.deleted_files)} files ({size(report.freed_bytes)}), "
          f"{len(leftovers)} uncommitted leftovers; kept {len(report.kept_files)} files "
          "that kept steps still use")
    if not args.yes:
        print("dry run: nothing was deleted; add --yes to delete")
    return EXIT_OK


EPILOG = """\
exit status:
  0  success: every check passed (verify), or the command did what was asked
  1  a check failed: a damaged or inconsistent checkpoint (the message names the file
     and the check: manifest, structure, header, digest, weights, output, loss)
  2  usage or environment error: a missing root or step, no probe recorded for
     --level forward, a model factory that cannot be imported or does not fit,
     a root locked by a writer (gc --yes), bad arguments

examples:
  ckpt ls /ckpt/run1
  ckpt inspect /ckpt/run1 --step 500
  ckpt verify /ckpt/run1                               # newest step, digest level
  ckpt verify /ckpt/run1 --all --level structure --json
  ckpt verify /ckpt/run1 --level forward --model mypkg.models:build
  ckpt diff /ckpt/run1 400 500
  ckpt export /ckpt/run1 --step 500 --to safetensors model.safetensors --item model
  ckpt gc /ckpt/run1 --keep-last 3 --yes

With --json every subcommand prints one JSON document on stdout, errors included
({"ok": false, "exit_code": 2, "error": "..."}).
"""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt", description="List, inspect, verify, compare, export and collect "
        "checkpoints.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ls", help="list committed steps")
    p.add_argument("root")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="tensors, shapes, dtypes and values of a step")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="default: the newest")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check a step's integrity (newest by default)",
                       description="Each level includes the ones before it. structure: "
                       "manifest, files, sizes, safetensors headers. digest: every chunk's "
                       "xxh3 digest. forward: load into a fresh model, weights finite, "
                       "rerun the recorded probe and compare.")
    p.add_argument("root")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--step", type=int)
    group.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--level", choices=verify.LEVELS, default="digest",
                   help="default: digest")
    p.add_argument("--model", metavar="MOD:FACTORY",
                   help="forward: builds a fresh model (default: the probe's recorded factory)")
    p.add_argument("--loss", metavar="MOD:FN",
                   help="forward: loss_fn(output, inputs), to recheck a recorded loss")
    p.add_argument("--rtol", type=float, help="forward: relative tolerance (default by dtype)")
    p.add_argument("--atol", type=float, help="forward: absolute tolerance (default by dtype)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("diff", help="which tensors and values changed between two steps")
    p.add_argument("root")
    p.add_argument("a", type=int, help="the older step")
    p.add_argument("b", type=int, help="the newer step")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("export", help="write a step as one safetensors or torch file")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="default: the newest")
    p.add_argument("--to", choices=(*verify.FORMATS, "hf"), required=True,
                   help="hf: a from_pretrained folder (sharded safetensors, index, config)")
    p.add_argument("file", help="the file (the folder, for hf) to write")
    p.add_argument("--max-shard-size", help="hf: the largest shard (default 5GB)")
    p.add_argument("--item", help="only this item's tensors, named as inside it "
                   "(a module's state_dict names)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("gc", help="delete unreferenced data (dry run unless --yes)")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, help="also retire all but the newest N steps")
    p.add_argument("--keep-every", type=int, help="with --keep-last, also keep every K-th step")
    p.add_argument("--yes", action="store_true", help="really delete")
    p.set_defaults(func=cmd_gc)

    for name, p in sub.choices.items():
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        if name in ("verify", "diff", "export"):
            p.add_argument("--threads", type=_positive, default=4,
                           help="parallel reads (default 4)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (see the epilog)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointNotFoundError, CheckpointLockedError, verify.UsageError) as e:
        return _error(args, e, EXIT_USAGE)
    except CheckpointError as e:
        return _error(args, e, EXIT_FAILED)


def _error(args: argparse.Namespace, error: Exception, code: int) -> int:
    print(f"ckpt {args.command}: {error}", file=sys.stderr)
    if getattr(args, "json", False):
        print(verify.to_json({"ok": False, "exit_code": code, "error": str(error),
                              "path": getattr(error, "path", None)}))
    return code


if __name__ == "__main__":
    sys.exit(main())
