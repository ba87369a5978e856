"""``ckpt gc``: a root's retention policy (the one its writer recorded, rules given as flags
replacing the recorded ones), applied by :func:`ckpt._retention.gc.collect_root`; or, with
``--memory``, this user's memory-tier segments that no live process owns."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any

import verify
from ckpt.inspect import Checkpoints
from ckpt.tools import (GcResult, KeepBest, RetentionPolicy, collect_root, committed_steps,
                        recorded_policy)

from ._console import echo, open_path, sibling_of
from .integration_keys import FRAMEWORK_STEPS
from .report import EXIT_FAILED, EXIT_OK, count, size, with_status


class _RetentionNotes(logging.Filter):
    """Drops the retention's log records (``ckpt.retention ...``: a manifest it could not
    read for the policy or the metrics) while gc runs: gc reports those steps itself, in
    its own lines, so the library's line would only say it twice. Other records of the
    ``ckpt`` logger (a planted link ignored) and the storage's (retries) still print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("ckpt.retention")


def cmd_gc(args: argparse.Namespace) -> int:
    if args.memory:
        return _gc_memory(args)
    notes, logger = _RetentionNotes(), logging.getLogger("ckpt")
    logger.addFilter(notes)
    try:
        return _gc_root(args)
    finally:
        logger.removeFilter(notes)


def _gc_root(args: argparse.Namespace) -> int:
    if args.root is None:
        raise verify.UsageError("gc needs ROOT (or --memory for shared-memory segments)")
    cps = open_path(args.root, files=False)  # a root: never a file
    sibling = sibling_of(args.root) if "://" not in args.root else None
    if sibling is not None:  # Lightning's ckpts/, HF's out/: as ls and verify read them
        echo(f"ckpt: {args.root} is a Lightning or HF folder: collecting its steps in "
             f"{sibling}", file=sys.stderr)
        cps = open_path(sibling, files=False)
    if not cps.is_root:
        raise verify.UsageError(
            f"{cps.url} is one checkpoint directory, not a root: gc collects the steps of a "
            "root (the directory holding step-XXXXXXXX directories)")
    _refuse_rules_on_framework_root(cps, args)
    policy, source = gc_policy(cps, args)
    before = committed_steps(cps.storage)
    result = collect_root(cps.storage, policy, check=digest_check(cps, args.threads),
                          delete=args.yes)
    # What every rule together keeps (keep_best's steps too), so none is a surprise.
    kept = sorted(set(before) - set(result.retired_steps))
    code = EXIT_OK if result.ok else EXIT_FAILED
    if args.json:
        echo(verify.to_json(with_status({**dataclasses.asdict(result), "kept_steps": kept,
                                         "policy": {**policy.to_record(), "source": source}},
                                        code)))
    else:
        echo(f"policy: {policy.describe()} ({source})\n{render_gc(result, kept)}")
    return code


def _refuse_rules_on_framework_root(cps: Checkpoints, args: argparse.Namespace) -> None:
    """Retention rules on the root of a framework integration are refused: there a step is
    deleted once no file of the framework names it (its save_top_k, save_total_limit), and
    retiring one by count would leave a framework file (a top-k ``.ckpt``, a
    ``checkpoint-N`` folder) that no longer loads."""
    if all(v is None for v in (args.keep_last, args.keep_every, args.keep_best)):
        return
    for step in reversed(committed_steps(cps.storage)):
        try:
            metadata = cps.manifest(step).metadata
        except (ValueError, OSError):  # CorruptCheckpointError, unreadable or gone
            continue  # the one before says whose root this is
        for key, (framework, rule) in FRAMEWORK_STEPS.items():
            if key in metadata:
                raise verify.UsageError(
                    f"{cps.url} holds the steps of {framework}'s checkpoints, whose "
                    f"retention is the framework's ({rule}): a step goes once no checkpoint "
                    "of the framework names it. Delete the framework's checkpoints instead, "
                    "or run gc without --keep-last/--keep-every/--keep-best to remove only "
                    "what crashed saves left")
        return


def gc_policy(cps: Checkpoints, args: argparse.Namespace) -> tuple[RetentionPolicy, str]:
    """The policy gc applies, and where it came from: the one the root's newest readable
    manifest records (unless ``--ignore-recorded``), each rule given as a flag replacing the
    recorded one (``--keep-best 0``/``--keep-every 0``: that rule dropped)."""
    recorded, step = (None, None) if args.ignore_recorded else recorded_policy(
        cps.storage, committed_steps(cps.storage))
    base = recorded or RetentionPolicy()
    flags = {name: value for name, value in (("keep_last", args.keep_last),
                                             ("keep_every", args.keep_every)) if value is not None}
    if "keep_every" in flags and flags["keep_every"] == 0:
        flags["keep_every"] = None
    if args.keep_best is not None:
        flags["keep_best"] = _keep_best(args, base.keep_best)
    policy = dataclasses.replace(base, **flags)
    if policy.keep_every is not None and policy.keeps_all:
        raise verify.UsageError("--keep-every only adds to --keep-last or --keep-best (given "
                                "or recorded): give both")
    given = ", ".join("--" + name.replace("_", "-") for name in flags)
    if recorded is not None:
        source = f"recorded in step {step}" + (f"; {given} given" if given else "")
    elif given:
        source = f"{given} given"
    elif args.ignore_recorded:
        source = "the recorded policy ignored, no rules given"
    else:
        source = "no policy recorded in the root, no rules given"
    return policy, source


def _keep_best(args: argparse.Namespace, recorded: KeepBest | None) -> KeepBest | None:
    """The keep_best rule of the flags: the recorded metric and mode unless named."""
    if args.keep_best == 0:
        return None
    metric = args.best_metric or (recorded.metric if recorded else None)
    if metric is None:
        raise verify.UsageError("--keep-best needs --best-metric NAME (the root records no "
                                "metric to rank by)")
    same = recorded is not None and recorded.metric == metric
    mode = args.best_mode or (recorded.mode if same else "min")
    return KeepBest(args.keep_best, metric, mode)


def digest_check(cps: Checkpoints, threads: int) -> Callable[[int], str | None]:
    """A step check for :func:`collect_root`: None when the step passes the digest level,
    else the problems found."""
    def check(step: int) -> str | None:
        checked = verify.verify_step(cps, step, "digest", threads=threads)
        if checked.ok:
            return None
        return "; ".join([str(p) for p in checked.problems] + [checked.error or ""]).strip("; ")
    return check


def render_gc(result: GcResult, kept: list[int]) -> str:
    verb = "would remove" if result.dry_run else "removed"
    lines = [f"step {s} does not verify: {why}" for s, why in result.failed.items()]
    if result.note:
        lines.append(result.note)
    lines.append(f"{'would keep' if result.dry_run else 'kept'}: {kept}")
    lines.append(f"{verb}: {count(len(result.retired_steps), 'step')} "
                 f"{result.retired_steps}, {count(len(result.deleted_files), 'file')} "
                 f"({size(result.freed_bytes)}), "
                 f"{count(len(result.uncommitted), 'uncommitted leftover')}; kept "
                 f"{count(len(result.kept_files), 'file')} that kept steps still use")
    if result.dry_run:
        lines.append("dry run: nothing was deleted; add --yes to delete")
    return "\n".join(lines)


def _gc_memory(args: argparse.Namespace) -> int:
    from ckpt.tools import gc_segments

    paths = gc_segments(job=args.job, dry_run=not args.yes)
    if getattr(args, "json", False):
        echo(verify.to_json(with_status({"dry_run": not args.yes, "segments": paths},
                                        EXIT_OK)))
    else:
        verb = "removed" if args.yes else "would remove (pass --yes)"
        echo(f"{verb} {count(len(paths), 'memory segment')}" + "".join(f"\n  {p}"
                                                                      for p in paths))
    return EXIT_OK


def add_gc_parser(sub: Any, count: Callable[[str], int]) -> None:
    """The ``gc`` subcommand's arguments (``count``: the parser of a whole number >= 0)."""
    p = sub.add_parser(
        "gc", help="retire old steps, delete unreferenced data (dry run unless --yes)",
        description="Deletes what crashed saves left and the files of retired steps that no "
        "kept step uses. Retires the steps the root's retention policy drops: the policy its "
        "writer (a CheckpointManager) recorded in the newest step, each rule given below "
        "replacing the recorded one. The newest step that verifies (digest level) is always "
        "kept, so steps are verified newest first before anything is deleted.")
    p.add_argument("root", metavar="ROOT", nargs="?")
    p.add_argument("--memory", action="store_true",
                   help="instead: remove this user's memory-tier segments (in /dev/shm/"
                   "ckpt-uid<uid>/) that no live process owns (dead jobs); never another "
                   "user's; not while a job's workers are restarting")
    p.add_argument("--job", metavar="JOB", help="with --memory: only this job's segments")
    p.add_argument("--keep-last", type=count, metavar="N",
                   help="keep the newest N steps (0: none by count; the newest step that "
                   "verifies stays)")
    p.add_argument("--keep-every", type=count, metavar="K",
                   help="also keep every step divisible by K (0: none by this rule)")
    p.add_argument("--keep-best", type=count, metavar="N",
                   help="also keep the N steps with the best --best-metric (0: none by "
                   "this rule)")
    p.add_argument("--best-metric", metavar="NAME",
                   help="with --keep-best: a metric saved with mgr.save(..., metrics=...) "
                   "(default: the recorded one)")
    p.add_argument("--best-mode", choices=("min", "max"),
                   help="with --keep-best: lower (min, the default) or higher is better")
    p.add_argument("--ignore-recorded", action="store_true",
                   help="apply only the rules given here, not the policy the root records")
    p.add_argument("--yes", action="store_true", help="really delete")
    p.set_defaults(func=cmd_gc)


def check_gc_combinations(args: argparse.Namespace) -> None:
    """gc's options that mean nothing with the others given are refused, not ignored."""
    rules = (args.keep_last, args.keep_every, args.keep_best, args.best_metric,
             args.best_mode)
    if args.memory and (args.root is not None or any(v is not None for v in rules)
                        or args.ignore_recorded):
        raise verify.UsageError("gc --memory collects shared-memory segments and takes no "
                                "ROOT or --keep-last/--keep-every/--keep-best: run it "
                                "separately")
    if args.job is not None and not args.memory:
        raise verify.UsageError("--job is for gc --memory")
    if (args.best_metric is not None or args.best_mode is not None) and not args.keep_best:
        raise verify.UsageError("--best-metric and --best-mode are for --keep-best N (N >= 1)")
