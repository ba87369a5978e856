"""``ckpt import`` (a PyTorch DCP directory or a Hugging Face folder as a step of a root)
and ``ckpt export --to dcp`` (a step as a DCP directory that
``torch.distributed.checkpoint.load`` reads)."""

from __future__ import annotations

import argparse
import os

import verify
from ckpt.interop import export_dcp, import_dcp, import_hf

from ._console import echo
from .report import EXIT_OK, count, size, with_status


def add_import_parser(sub: argparse._SubParsersAction, path_help: str) -> None:
    p = sub.add_parser("import", help="write a PyTorch DCP checkpoint or a Hugging Face "
                       "folder as a step of a root")
    p.add_argument("source", metavar="SOURCE", help="a DCP checkpoint directory (.metadata "
                   "and .distcp files; a path or an fsspec URL) or, with --from hf, a folder "
                   "of safetensors shards and their index")
    p.add_argument("root", metavar="ROOT", help=path_help)
    p.add_argument("--from", dest="source_format", choices=("dcp", "hf"), default="dcp",
                   help="the source's format (default dcp)")
    p.add_argument("--step", type=int, help="the step to write (default: the number the "
                   "source's name ends with, step-1000 -> 1000, else 0)")
    p.add_argument("--item", help="dcp: put the checkpoint's top-level keys under this one "
                   "item (train, for {'train': ckpt.ModelOptimizer(model, opt)}); hf: the "
                   "module item's name (default model)")
    p.add_argument("--allow-pickle", action="store_true", help="load non-tensor values that "
                   "need pickle (only for a checkpoint you trust)")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    if args.step is not None and args.step < 0:
        raise verify.UsageError(f"--step must be >= 0, not {args.step}")
    if "://" not in args.source and not os.path.isdir(args.source):
        what = "does not exist" if not os.path.lexists(args.source) else "is not a folder"
        raise verify.UsageError(
            f"SOURCE {args.source} {what}: give the folder to import (a DCP checkpoint "
            "directory, or with --from hf a folder of safetensors shards)")
    if args.source_format == "hf":
        if args.allow_pickle:
            raise verify.UsageError("--allow-pickle is for --from dcp (safetensors hold no "
                                    "pickle)")
        result = import_hf(args.source, args.root, step=args.step or 0,
                           item=args.item or "model")
    else:
        result = import_dcp(args.source, args.root, step=args.step, item=args.item,
                            allow_pickle=args.allow_pickle)
    echo(verify.to_json(with_status(vars(result), EXIT_OK)) if args.json else
         f"imported {result.source} as step {result.step} of {result.target}: "
         f"{count(result.tensors, 'tensor')}, {size(result.bytes)} in {result.seconds:.1f}s "
         f"(`ckpt verify {result.target} --step {result.step}` checks it)")
    return EXIT_OK


def export_to_dcp(args: argparse.Namespace, step: int) -> int:
    """``ckpt export PATH --to dcp DIR``: consolidated, loadable on any world size."""
    if os.path.lexists(args.file) and not args.force:
        raise verify.UsageError(f"{args.file} exists; pass --force to replace it")
    try:
        result = export_dcp(args.root, args.file, step=step, item=args.item,
                            force=args.force)
    except FileExistsError as e:  # --force given a folder that is no earlier export
        raise verify.UsageError(str(e)) from None
    echo(verify.to_json(with_status(vars(result), EXIT_OK)) if args.json else
         f"exported step {result.step} of {result.source} to {result.target} (DCP): "
         f"{count(result.tensors, 'tensor')}, {size(result.bytes)} in {result.seconds:.1f}s")
    return EXIT_OK


