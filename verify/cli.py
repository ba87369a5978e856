"""The ``ckpt`` command: ``ls``, ``inspect``, ``verify``, ``diff``, ``export`` and ``gc``.

Exit codes: 0 all good; 1 a check failed; 2 usage or environment error (missing root...).
Every subcommand takes ``--json`` for machine-readable output on stdout, and a root or one
checkpoint directory (a step directory, or what ``ckpt.save`` wrote). This module parses
arguments, prints, and runs ``gc``; checkpoints are read through :mod:`ckpt.inspect` only,
and the checks, comparisons, exports and their renderings live in the ``verify`` package
(usable as a library).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import select
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from collections.abc import Mapping
from typing import Any, Sequence

import verify
from verify.report import EXIT_FAILED, EXIT_OK, EXIT_USAGE, size, table

from ckpt import inspect
from ckpt.errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError,
                     StorageError)
from ckpt._format.manifest import step_dir
from ckpt.inspect import Checkpoints
from ckpt._step.pointer import POINTER_NAME, read_pointer

MAX_VALUE_LINES = 200  # saved values listed by `ckpt inspect` before "... (see --json)"
# Output cut short by a closed pipe (`ckpt ls ROOT | head -1`): quiet, with the status a shell
# shows for a process killed by SIGPIPE.
EXIT_PIPE = 128 + signal.SIGPIPE
EXIT_INTERNAL = 3  # a bug in ckpt: still one line (or one JSON document), not a traceback
EXIT_INTERRUPTED = 128 + signal.SIGINT
TRACEBACK_VARIABLE = "CKPT_TRACEBACK"  # set (to anything) to see a bug's traceback instead
# Control characters (but newline and tab), lone surrogates, zero-width characters and
# bidirectional overrides, as tensor keys, item names and file names read from a checkpoint
# may hold: printed escaped, so a hostile name can neither rewrite the terminal, hide in it,
# nor make the output encoder raise.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e"
                          "\u2066-\u2069\ufeff\ud800-\udfff]")


def _print(text: str, file: Any = None) -> None:
    """print() of text for people or machines, unprintable characters escaped (``\\x1b``)."""
    print(_UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), text),
          file=file if file is not None else sys.stdout)


def _open(path: str) -> Checkpoints:
    """:func:`ckpt.inspect.open`, following a framework integration's pointer (Lightning's
    ``last.ckpt``, HF's ``checkpoint-N/``, Accelerate's ``checkpoint_N/``) to its step."""
    if not path.strip():  # an unset shell variable: never the current directory by accident
        raise verify.UsageError("PATH is empty: give a checkpoint root or directory")
    if "://" in path:
        return inspect.open(path)
    step = read_pointer(os.path.join(path, POINTER_NAME) if os.path.isdir(path) else path)
    if step is None:
        return inspect.open(path)
    root = os.path.dirname(os.path.abspath(path))
    target = os.path.join(root, step_dir(step))
    if not os.path.isdir(target):
        raise CheckpointNotFoundError(
            f"{path} points to step {step} of {root}, which is not committed (its save never "
            f"finished, or it was retired); `ckpt ls {root}` lists the steps there", path=path)
    _print(f"ckpt: {path} points to step {step}: reading {target}", file=sys.stderr)
    return inspect.open(target)


def cmd_ls(args: argparse.Namespace) -> int:
    cps = _open(args.root)
    rows = []
    for step in cps.steps():
        try:
            m = cps.manifest(step)
            rows.append({"step": step, "created": m.created, "bytes": sum(m.files.values()),
                         "files": len(m.files), "tensors": len(m.tensors),
                         "world_size": m.world_size, "status": "committed"})
        except CheckpointNotFoundError:
            continue  # retired by a live writer since the listing
        except CheckpointError as e:
            rows.append({"step": step, "created": None, "bytes": None, "files": None,
                         "tensors": None, "world_size": None, "status": f"bad: {e}"})
    if args.json:
        _print(verify.to_json({"root": cps.url, "steps": rows}))
        return EXIT_OK
    if not rows:
        _print(f"{cps.url}: no committed steps")
        return EXIT_OK
    _print(table(["STEP", "CREATED", "SIZE", "FILES", "TENSORS", "WORLD", "STATUS"], [
        [r["step"], _when(r["created"]), size(r["bytes"]) if r["bytes"] is not None else "-",
         r["files"] or "-", r["tensors"] or "-", r["world_size"] or "-",
         r["status"] if r["status"] == "committed" else "bad (below)"] for r in rows]))
    for r in rows:  # in full: the reason follows a long path
        if r["status"] != "committed":
            _print(f"step {r['step']}: {r['status']}")
    return EXIT_OK


def _when(created: float | None) -> str:
    """A manifest's creation time for a table; a hand-edited one may be NaN or 1e300."""
    if created is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
    except (ValueError, OverflowError, OSError):
        return f"invalid ({created:g})"


def cmd_inspect(args: argparse.Namespace) -> int:
    cps = _open(args.root)
    step = _steps(cps, args)[0]
    m = cps.manifest(step)
    tensors = [{"key": k, "dtype": e.dtype, "shape": list(e.shape), "chunks": len(e.chunks),
                "bytes": e.nbytes, "files": sorted({c.file for c in e.chunks})}
               for k, e in m.tensors.items()]
    values = {k: inspect.item_tree(v) for k, v in m.items.items() if v.get("kind") == "value"}
    saved = saved_values(m)
    if args.json:
        _print(verify.to_json({
            "path": cps.step_url(step), "step": m.step, "world_size": m.world_size,
            "created": m.created, "tensors": tensors, "aliases": m.aliases,
            "items": {k: v.get("kind") for k, v in m.items.items()}, "values": values,
            "state": saved, "parameter_names": inspect.parameter_names(m),
            "metadata": m.metadata}))
        return EXIT_OK
    _print(f"{cps.step_url(step)}  step {m.step}  world size {m.world_size}  "
          f"{len(tensors)} tensors  {size(sum(t['bytes'] for t in tensors))}")
    _print(table(["TENSOR", "DTYPE", "SHAPE", "CHUNKS", "SIZE"],
                 [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                   t["chunks"], size(t["bytes"])] for t in tensors]))
    for alias, target in m.aliases.items():
        _print(f"{alias} -> {target} (same storage)")
    lines = [f"  {path}: {_short(value)}" for path, value in
             (inspect.plain_values(values) if values else {}).items()]
    lines += [f"  {item}/{path}: {_short(value)}" for item, found in saved.items()
              for path, value in found.items()]
    lines += [f"  {path}: {_short(value)}" for path, value in verify.user_metadata(m).items()]
    if lines:
        _print("saved values:")
        _print("\n".join(lines[:MAX_VALUE_LINES]))
        if len(lines) > MAX_VALUE_LINES:
            _print(f"  ... and {len(lines) - MAX_VALUE_LINES} more (see --json)")
    return EXIT_OK


def saved_values(manifest: inspect.Manifest) -> dict[str, dict[str, Any]]:
    """The plain values inside each stateful item (an optimizer's learning rates, a
    scheduler's step, a sampler's position, a scaler's scale) and module (extra state):
    item -> {path: value}. Items of a single value are listed as values, not here."""
    out = {}
    for name, item in manifest.items.items():
        if item.get("kind") not in ("stateful", "module"):
            continue
        found = {}
        per_rank = item.get("per_rank")
        if isinstance(per_rank, Mapping):  # format 2: read from the rank tables
            for rank, tree in per_rank.items():
                found.update(inspect.plain_values(tree, f"rank{rank}"))
        else:
            found = inspect.plain_values(item.get("tree"))
        found = {p: v for p, v in found.items() if v != {} and v != []}
        if found:
            out[name] = found
    return out


def _short(value: Any, limit: int = 100) -> str:
    text = verify.to_json(value).replace("\n", "").replace("  ", "") if isinstance(
        value, (dict, list)) else json.dumps(value) if not isinstance(value, float) or (
        math.isfinite(value)) else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _steps(cps: Checkpoints, args: argparse.Namespace) -> list[int]:
    """The steps a command asks for: ``--all``, ``--step N`` or the newest."""
    if getattr(args, "all", False):
        steps = cps.steps()
    elif getattr(args, "step", None) is not None:
        cps.require(args.step)
        steps = [args.step]
    else:
        latest = cps.latest_step()
        steps = [] if latest is None else [latest]
    if not steps:
        raise CheckpointNotFoundError(f"{cps.url} holds no committed step", path=cps.url)
    return steps


def cmd_verify(args: argparse.Namespace) -> int:
    if args.level != "forward" and (args.model or args.loss or args.rtol is not None
                                    or args.atol is not None or args.trust_recorded):
        raise verify.UsageError("--model, --loss, --rtol, --atol and --trust-recorded are for "
                                "--level forward")
    reports = []
    cps = _open(args.root)
    for step in _steps(cps, args):
        progress = None
        if args.level != "structure":  # drawn only when stderr is a terminal
            try:
                total = sum(c.length for e in cps.manifest(step).tensors.values()
                            for c in e.chunks)
                progress = verify.ProgressBar(total, f"step {step}")
            except CheckpointError:
                pass  # the verifier reports it
        try:
            reports.append(verify.verify_step(
                cps, step, args.level, progress, model=args.model, loss=args.loss,
                rtol=args.rtol, atol=args.atol, threads=args.threads,
                trust_recorded=args.trust_recorded))
        except CheckpointNotFoundError as e:
            if not args.all:
                raise
            _print(f"ckpt verify: skipped step {step}, no longer committed: {e}",
                  file=sys.stderr)  # a live writer's retention deleted it after the listing
    report = verify.Report(cps.url, reports)
    _print(verify.to_json(report.to_dict()) if args.json else verify.render_verify(report))
    return report.exit_code


def cmd_diff(args: argparse.Namespace) -> int:
    operands = args.operands
    if len(operands) == 3:  # ROOT A B: two steps of one root
        if args.step_a is not None or args.step_b is not None:
            raise verify.UsageError("--step-a/--step-b are for comparing two paths "
                                    "(ckpt diff PATH_A PATH_B); here the steps are given")
        try:
            a, b = int(operands[1]), int(operands[2])
        except ValueError:
            raise verify.UsageError(f"ckpt diff ROOT A B takes two step numbers, not "
                                    f"{operands[1]!r} {operands[2]!r}") from None
        side_a = side_b = _open(operands[0])
    elif len(operands) == 2:  # PATH_A PATH_B: two runs or two checkpoint directories
        side_a, side_b = _open(operands[0]), _open(operands[1])
        a = _step_of(side_a, args.step_a)
        b = _step_of(side_b, args.step_b)
    else:
        raise verify.UsageError("ckpt diff takes ROOT A B (two steps of one root) or PATH_A "
                                "PATH_B (two roots or checkpoint directories)")
    result = verify.diff_steps(side_a, a, b, threads=args.threads,
                               other=None if side_b is side_a else side_b,
                               filters=args.filter or ())
    _print(verify.to_json(result.to_dict()) if args.json else verify.render_diff(result))
    return EXIT_OK


def _step_of(cps: Checkpoints, step: int | None) -> int:
    if step is not None:
        cps.require(step)
        return step
    return _steps(cps, argparse.Namespace())[0]


def cmd_export(args: argparse.Namespace) -> int:
    if args.to == "hf":
        return _export_hf(args)
    cps = _open(args.root)
    step = _steps(cps, args)[0]
    result = verify.export_step(cps, step, args.to, args.file, item=args.item,
                                force=args.force, threads=args.threads)
    _print(verify.to_json(vars(result)) if args.json else verify.render_export(result))
    return EXIT_OK


def _export_hf(args: argparse.Namespace) -> int:
    from verify.export_hf import DEFAULT_SHARD_BYTES, export_hf, parse_size, render_hf_export

    shard = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_SHARD_BYTES
    cps = _open(args.root)
    result = export_hf(cps, _steps(cps, args)[0], args.file, item=args.item,
                       force=args.force, max_shard_bytes=shard, threads=args.threads)
    _print(verify.to_json(vars(result)) if args.json else render_hf_export(result))
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    if args.memory:
        return _gc_memory(args)
    if args.root is None:
        raise verify.UsageError("gc needs ROOT (or --memory for shared-memory segments)")
    cps = _open(args.root)
    if not cps.is_root:
        raise verify.UsageError(
            f"{cps.url} is one checkpoint directory, not a root: gc collects the steps of a "
            "root (the directory holding step-XXXXXXXX directories)")
    result = collect_root(cps, keep_last=args.keep_last, keep_every=args.keep_every,
                          delete=args.yes, threads=args.threads)
    _print(verify.to_json(result.to_dict()) if args.json else result.render())
    return result.exit_code


@dataclass
class GcResult:
    """What ``ckpt gc`` did (or, in a dry run, would do)."""

    root: str
    dry_run: bool
    retired_steps: list[int] = field(default_factory=list)
    deleted_files: list[str] = field(default_factory=list)
    kept_files: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    uncommitted: list[str] = field(default_factory=list)
    newest_good: int | None = None  # kept whatever the options (None: not checked / none)
    failed: dict[int, str] = field(default_factory=dict)  # steps that did not verify
    note: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.note is not None and self.newest_good is None else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.exit_code == EXIT_OK, "exit_code": self.exit_code}

    def render(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        lines = [f"step {s} does not verify: {why}" for s, why in self.failed.items()]
        if self.note:
            lines.append(self.note)
        lines.append(f"{verb}: {len(self.retired_steps)} steps {self.retired_steps}, "
                     f"{len(self.deleted_files)} files ({size(self.freed_bytes)}), "
                     f"{len(self.uncommitted)} uncommitted leftovers; kept "
                     f"{len(self.kept_files)} files that kept steps still use")
        if self.dry_run:
            lines.append("dry run: nothing was deleted; add --yes to delete")
        return "\n".join(lines)


def collect_root(cps: Checkpoints, *, keep_last: int | None = None,
                 keep_every: int | None = None, delete: bool = False,
                 threads: int = 4) -> GcResult:
    """Retire the steps a keep_last/keep_every policy drops and delete unreferenced files
    (only with ``delete``; otherwise report what would go).

    Whatever the policy, the newest step that passes the digest check is kept: steps are
    verified from the newest down, before anything is deleted, until one passes. When none
    does, no step is retired (exit status 1). When the policy retires no committed step
    (or there is none) nothing is verified. With ``delete`` the root's writer lock is held
    throughout.

    Raises:
        CheckpointLockedError: ``delete`` and a writer holds the root.
        StorageError: the root cannot be written (read-only, permissions) or listed.
    """
    from storage_backends import LockHeldError
    from storage_backends.locks import describe_owner

    from ckpt._step.incremental import collect
    from ckpt._manager.manager import retention

    storage, root = cps.storage, cps.url
    lock = None
    if delete:
        try:
            lock = storage.lock(describe_owner())
        except LockHeldError as e:
            raise CheckpointLockedError(
                f"{root} is in use by a writer ({e.who}); gc --yes needs the root "
                "to itself: stop that job first, or run gc without --yes for a dry run",
                path=root) from None
        except OSError as e:
            raise StorageError(f"cannot take the writer lock of {root}: {e}; gc --yes needs "
                               "write access to the root", path=root) from e
    result = GcResult(root, dry_run=not delete)
    try:
        steps = cps.steps()
        keep = None if keep_last is None else retention(steps, keep_last, keep_every)
        if keep is not None and set(steps) - keep:  # a step would be retired: check first
            for step in reversed(steps):
                try:
                    checked = verify.verify_step(cps, step, "digest", threads=threads)
                except CheckpointNotFoundError:
                    continue  # a live writer retired it (a dry run holds no lock)
                if checked.ok:
                    result.newest_good = step
                    break
                result.failed[step] = "; ".join(
                    [str(p) for p in checked.problems] + [checked.error or ""]).strip("; ")
            if result.newest_good is None:
                keep = None
                if steps:
                    result.note = ("no committed step verifies, so none was retired: "
                                   "`ckpt verify --all` gives details")
            elif result.newest_good not in keep:
                keep.add(result.newest_good)
                result.note = (f"kept step {result.newest_good} too: the newest step that "
                               "verifies (gc always keeps one)")
        result.uncommitted = storage.uncommitted()
        report = collect(storage, keep, dry_run=not delete)
        for name in result.uncommitted:
            if delete:
                storage.delete(name)
    except CheckpointError:
        raise
    except OSError as e:
        raise StorageError(f"gc of {root} failed: {type(e).__name__}: {e}", path=root) from e
    finally:
        if lock is not None:
            lock.release()
    result.retired_steps, result.deleted_files = report.retired_steps, report.deleted_files
    result.kept_files, result.freed_bytes = report.kept_files, report.freed_bytes
    return result


EPILOG = """\
PATH is a checkpoint root (the directory holding step-XXXXXXXX directories), one step
directory of a root, or one checkpoint directory written by ckpt.save.

exit status:
  0  success: every check passed (verify), or the command did what was asked
  1  a check failed: a damaged or inconsistent checkpoint (the message names the file
     and the check: manifest, structure, header, digest, weights, output, loss); gc
     found no step that verifies, so it retired none
  2  usage or environment error: a missing root or step, no probe recorded for
     --level forward, a model factory that cannot be imported or does not fit,
     a root locked by a writer (gc --yes), storage that cannot be opened or written
     (a file, a read-only root, an unknown protocol, a missing backend library, an
     unreachable endpoint), bad arguments
  3    an internal error, a bug in ckpt (one line; CKPT_TRACEBACK=1 shows the traceback)
  130  interrupted (Ctrl-C)
  141  stdout closed by its reader (ckpt ls ROOT | head -1): quiet, as after SIGPIPE

examples:
  ckpt ls /ckpt/run1
  ckpt inspect /ckpt/run1 --step 500                   # tensors and saved values (LR...)
  ckpt verify /ckpt/run1                               # newest step, digest level
  ckpt verify /ckpt/run1 --all --level structure --json
  ckpt verify /ckpt/run1 --level forward --model mypkg.models:build
  ckpt verify /ckpt/run1 --level forward --trust-recorded   # the factory the probe names
  ckpt verify out/ckpt0                                # what ckpt.save wrote
  ckpt diff /ckpt/run1 400 500
  ckpt diff /ckpt/run1 /ckpt/run2 --filter 'optim/*'   # two runs, newest steps
  ckpt export /ckpt/run1 --step 500 --to safetensors model.safetensors --item model
  ckpt gc /ckpt/run1 --keep-last 3 --yes

With --json every subcommand prints one JSON document on stdout, errors included
({"ok": false, "exit_code": 2, "error": "..."}).
"""


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


MAX_THREADS = 256  # each reading thread holds a chunk buffer (8 MiB by default)


def _threads(text: str) -> int:
    value = _positive(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_THREADS}, not {value}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _count(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt", description="List, inspect, verify, compare, export and collect "
        "checkpoints.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    path_help = "a root, a step directory, or a ckpt.save directory"

    p = sub.add_parser("ls", help="list committed steps")
    p.add_argument("root", metavar="PATH", help=path_help)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="tensors, shapes, dtypes and saved values of a step")
    p.add_argument("root", metavar="PATH", help=path_help)
    p.add_argument("--step", type=int, help="default: the newest")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check a step's integrity (newest by default)",
                       description="Each level includes the ones before it. structure: "
                       "manifest, files, sizes, safetensors headers. digest: every chunk's "
                       "xxh3 digest. forward: load into a fresh model, weights finite, "
                       "rerun the recorded probe and compare.")
    p.add_argument("root", metavar="PATH", help=path_help)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--step", type=int)
    group.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--level", choices=verify.LEVELS, default="digest",
                   help="default: digest")
    p.add_argument("--model", metavar="MOD:FACTORY",
                   help="forward: builds a fresh model")
    p.add_argument("--trust-recorded", action="store_true",
                   help="forward: import and run the factory and loss function the probe "
                        "recorded (code the checkpoint names: only for checkpoints you trust)")
    p.add_argument("--loss", metavar="MOD:FN",
                   help="forward: loss_fn(output, inputs), to recheck a recorded loss")
    p.add_argument("--rtol", type=_tolerance,
                   help="forward: relative tolerance (default by dtype)")
    p.add_argument("--atol", type=_tolerance,
                   help="forward: absolute tolerance (default by dtype)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "diff", help="which tensors and values changed between two steps or two runs",
        usage="ckpt diff ROOT A B | ckpt diff PATH_A PATH_B [--step-a N] [--step-b N] "
        "[--filter PATTERN] [--json] [--threads N]",
        description="ROOT A B: step A against step B of one root. PATH_A PATH_B: two roots "
        "or checkpoint directories (two runs), the newest step of each unless --step-a/"
        "--step-b say otherwise.")
    p.add_argument("operands", nargs="+", metavar="ROOT A B | PATH_A PATH_B")
    p.add_argument("--step-a", type=int, help="with two paths: the step of PATH_A")
    p.add_argument("--step-b", type=int, help="with two paths: the step of PATH_B")
    p.add_argument("--filter", action="append", metavar="PATTERN",
                   help="only tensors (key, or optimizer state by parameter name) and values "
                   "matching this shell-style pattern, e.g. 'model/*' or '*exp_avg*' "
                   "(repeatable)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("export", help="write a step as one safetensors or torch file")
    p.add_argument("root", metavar="PATH", help=path_help)
    p.add_argument("--step", type=int, help="default: the newest")
    p.add_argument("--to", choices=(*verify.FORMATS, "hf"), required=True,
                   help="hf: a from_pretrained folder (sharded safetensors, index, config)")
    p.add_argument("file", help="the file (the folder, for hf) to write")
    p.add_argument("--max-shard-size", help="hf: the largest shard (default 5GB)")
    p.add_argument("--item", help="only this item's tensors, named as inside it "
                   "(a module's state_dict names)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("gc", help="retire old steps, delete unreferenced data (dry run unless "
                       "--yes)", description="Deletes what crashed saves left and the files "
                       "of retired steps that no kept step uses. With --keep-last, also "
                       "retires older steps; the newest step that verifies (digest level) is "
                       "always kept, so steps are verified newest first before anything is "
                       "deleted.")
    p.add_argument("root", metavar="ROOT", nargs="?")
    p.add_argument("--memory", action="store_true",
                   help="instead: remove the memory tier's /dev/shm/ckpt-* segments that no "
                   "live process owns (dead jobs); not while a job's workers are restarting")
    p.add_argument("--job", metavar="JOB", help="with --memory: only this job's segments")
    p.add_argument("--keep-last", type=_count, metavar="N",
                   help="retire all but the newest N steps (0: keep none by count; the newest "
                   "step that verifies stays)")
    p.add_argument("--keep-every", type=_positive, metavar="K",
                   help="with --keep-last, also keep every step divisible by K")
    p.add_argument("--yes", action="store_true", help="really delete")
    p.set_defaults(func=cmd_gc)

    for name, p in sub.choices.items():
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        if name in ("verify", "diff", "export", "gc"):
            p.add_argument("--threads", type=_threads, default=4,
                           help=f"parallel reads (default 4, at most {MAX_THREADS})")
    return parser


def _gc_memory(args: argparse.Namespace) -> int:
    from ckpt._memory.tier import gc_segments

    paths = gc_segments(job=args.job, dry_run=not args.yes)
    if getattr(args, "json", False):
        _print(verify.to_json({"ok": True, "dry_run": not args.yes, "segments": paths}))
    else:
        verb = "removed" if args.yes else "would remove (pass --yes)"
        _print(f"{verb} {len(paths)} memory segment(s)" + "".join(f"\n  {p}" for p in paths))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (see the epilog)."""
    args = build_parser().parse_args(argv)
    try:
        _check_combinations(args)
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return code
    except BrokenPipeError as e:
        if _stdout_closed():
            return EXIT_PIPE
        return _error(args, f"{type(e).__name__}: {e}", EXIT_USAGE)
    except (CheckpointNotFoundError, CheckpointLockedError, StorageError,
            verify.UsageError) as e:
        return _error(args, e, EXIT_USAGE)
    except CheckpointError as e:  # damage: say where the good steps are
        hint = "; `ckpt verify --all` tells which steps are good"
        if args.command in ("inspect", "export") and args.step is None:
            hint += " and --step N picks one"
        return _error(args, f"{e}{hint}", EXIT_FAILED, path=getattr(e, "path", None))
    except (OSError, ImportError) as e:  # the environment: permissions, a missing library
        hint = "; check the path and its permissions" if isinstance(e, OSError) else ""
        return _error(args, f"{type(e).__name__}: {e}{hint}", EXIT_USAGE,
                      path=getattr(e, "filename", None))
    except KeyboardInterrupt:
        return _error(args, "interrupted", EXIT_INTERRUPTED)
    except Exception as e:  # whatever a checkpoint holds, a bug's report stays one line
        if os.environ.get(TRACEBACK_VARIABLE):
            raise
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return _error(args, f"internal error (a bug in ckpt): {type(e).__name__}: {e} (in "
                      f"{os.path.basename(frame.filename)}:{frame.lineno}); rerun with "
                      f"{TRACEBACK_VARIABLE}=1 for the traceback and report it",
                      EXIT_INTERNAL)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) that its reader closed, as opposed to a broken
    connection of a storage backend; if so, point it at /dev/null so that Python's flush at
    exit prints no "Exception ignored" message."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        return True
    except (OSError, ValueError, AttributeError):
        return False  # not a real file descriptor (captured output)


def _check_combinations(args: argparse.Namespace) -> None:
    """Options that mean nothing with the others given are refused, not ignored."""
    if args.command == "gc":
        if args.keep_every is not None and args.keep_last is None:
            raise verify.UsageError("--keep-every only adds to --keep-last: give both")
        if args.memory and (args.root is not None or args.keep_last is not None):
            raise verify.UsageError("gc --memory collects shared-memory segments and takes no "
                                    "ROOT or --keep-last: run it separately")
        if args.job is not None and not args.memory:
            raise verify.UsageError("--job is for gc --memory")
    if args.command == "export" and args.max_shard_size and args.to != "hf":
        raise verify.UsageError("--max-shard-size is for --to hf")


def _error(args: argparse.Namespace, error: Exception | str, code: int,
           path: str | None = None) -> int:
    _print(f"ckpt {args.command}: {error}", file=sys.stderr)
    if getattr(args, "json", False):
        _print(verify.to_json({"ok": False, "exit_code": code, "error": str(error),
                              "path": path or getattr(error, "path", None)}))
    return code


if __name__ == "__main__":
    sys.exit(main())
