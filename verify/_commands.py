"""The ``ckpt`` subcommands that read: ``ls``, ``inspect``, ``verify``, ``diff`` and
``export``. Checkpoints are read through :mod:`ckpt.inspect` only; the checks, comparisons,
exports and their renderings live in the ``verify`` package."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import verify
from ckpt import inspect
from ckpt.errors import CheckpointError, CheckpointNotFoundError
from ckpt.inspect import Checkpoints

from ._console import FileStepGoneError, echo, gone_step, open_path, open_target
from .lightning_file import (FILES_KEY, LightningFile, claim, claims_in, files_of, folder_of,
                             untrusted_root)
from .lightning_file import check as check_file
from .report import EXIT_FAILED, EXIT_OK, count, size, table, with_status

MAX_VALUE_LINES = 200  # saved values listed by `ckpt inspect` before "... (see --json)"


def cmd_ls(args: argparse.Namespace) -> int:
    cps = open_path(args.root)
    rows = []
    for step in cps.steps():
        try:
            m = cps.manifest(step)
            rows.append({"step": step, "created": m.created, "bytes": sum(m.files.values()),
                         "files": len(m.files), "tensors": len(m.tensors),
                         "world_size": m.world_size, "status": "committed",
                         **_verified(cps, step)})
        except CheckpointNotFoundError:
            continue  # retired by a live writer since the listing
        except CheckpointError as e:
            rows.append({"step": step, "created": None, "bytes": None, "files": None,
                         "tensors": None, "world_size": None, "status": f"bad: {e}",
                         "verified": None})
    if args.json:
        echo(verify.to_json(with_status({"root": cps.url, "steps": rows}, EXIT_OK)))
        return EXIT_OK
    if not rows:
        echo(f"{cps.url}: no committed steps")
        return EXIT_OK
    echo(table(["STEP", "CREATED", "SIZE", "FILES", "TENSORS", "WORLD", "VERIFIED", "STATUS"], [
        [r["step"], _when(r["created"]), size(r["bytes"]) if r["bytes"] is not None else "-",
         r["files"] or "-", r["tensors"] or "-", r["world_size"] or "-",
         _verified_cell(r), r["status"] if r["status"] == "committed" else "bad (below)"]
        for r in rows]))
    for r in rows:  # in full: the reason follows a long path
        if r["status"] != "committed":
            echo(f"step {r['step']}: {r['status']}")
        elif r.get("verified_problem"):
            echo(f"step {r['step']}: verified marker ignored: {r['verified_problem']}")
    return EXIT_OK


def _verified(cps: Checkpoints, step: int) -> dict[str, Any]:
    """A step's verified state for ``ls``: ``verified`` ("verified", "unverified" or
    "untrusted"), and the evidence, or why a marker there is not trusted."""
    try:
        marker = cps.marker(step)
    except CheckpointError as e:  # retired meanwhile, or the storage failed: not known
        return {"verified": "unknown", "verified_problem": str(e)}
    out: dict[str, Any] = {"verified": marker.status}
    if marker.verification is not None:
        out["verified_at"] = marker.verification.time
        out["verified_evidence"] = dict(marker.verification.evidence)
    if marker.problem is not None:
        out["verified_problem"] = marker.problem
    return out


def _verified_cell(row: Mapping[str, Any]) -> str:
    state = row.get("verified")
    if state == "verified":
        confirmed = row.get("verified_evidence", {}).get("confirmed_at")
        return "yes" if not _is_int(confirmed) else f"yes (at {confirmed})"
    return {"unverified": "-", "untrusted": "ignored (below)", None: "-"}.get(state, str(state))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _when(created: float | None) -> str:
    """A manifest's creation time for a table; a hand-edited one may be NaN or 1e300."""
    if created is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
    except (ValueError, OverflowError, OSError):
        return f"invalid ({created:g})"


def cmd_inspect(args: argparse.Namespace) -> int:
    cps = open_path(args.root)
    step = _steps(cps, args)[0]
    m = cps.manifest(step)
    tensors = [{"key": k, "dtype": e.dtype, "shape": list(e.shape), "chunks": len(e.chunks),
                "bytes": e.nbytes, "files": sorted({c.file for c in e.chunks})}
               for k, e in m.tensors.items()]
    values = {k: inspect.item_tree(v) for k, v in m.items.items() if v.get("kind") == "value"}
    saved = saved_values(m)
    if args.json:
        echo(verify.to_json(with_status({
            "path": cps.step_url(step), "step": m.step, "world_size": m.world_size,
            "created": m.created, "tensors": tensors, "aliases": m.aliases,
            "items": {k: v.get("kind") for k, v in m.items.items()}, "values": values,
            "state": saved, "parameter_names": inspect.parameter_names(m),
            "metadata": m.metadata}, EXIT_OK)))
        return EXIT_OK
    echo(f"{cps.step_url(step)}  step {m.step}  world size {m.world_size}  "
         f"{count(len(tensors), 'tensor')}  {size(sum(t['bytes'] for t in tensors))}")
    echo(table(["TENSOR", "DTYPE", "SHAPE", "CHUNKS", "SIZE"],
               [[t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                 t["chunks"], size(t["bytes"])] for t in tensors]))
    for alias, target in m.aliases.items():
        echo(f"{alias} -> {target} (same storage)")
    lines = [f"  {path}: {_short(value)}" for path, value in
             (inspect.plain_values(values) if values else {}).items()]
    lines += [f"  {item}/{path}: {_short(value)}" for item, found in saved.items()
              for path, value in found.items()]
    lines += [f"  {path}: {_short(value)}" for path, value in verify.user_metadata(m).items()]
    if lines:
        echo("saved values:")
        echo("\n".join(lines[:MAX_VALUE_LINES]))
        if len(lines) > MAX_VALUE_LINES:
            echo(f"  ... and {len(lines) - MAX_VALUE_LINES} more (see --json)")
    return EXIT_OK


def saved_values(manifest: inspect.Manifest) -> dict[str, dict[str, Any]]:
    """The plain values inside each stateful item (an optimizer's learning rates, a
    scheduler's step, a sampler's position, a scaler's scale) and module (extra state):
    item -> {path: value}. A per-rank item is listed once per saved rank, as ``ITEM@RANK``,
    the manifest's spelling of its tensors (``rng@0/torch``). Items of a single value are
    listed as values, not here."""
    out = {}
    for name, item in manifest.items.items():
        if item.get("kind") not in ("stateful", "module"):
            continue
        per_rank = item.get("per_rank")
        trees = ({f"{name}@{rank}": tree for rank, tree in per_rank.items()}
                 if isinstance(per_rank, Mapping) else {name: item.get("tree")})
        for label, tree in trees.items():
            found = {p: v for p, v in inspect.plain_values(tree).items()
                     if v != {} and v != []}
            if found:
                out[label] = found
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
    try:
        cps, lightning = open_target(args.root)
    except FileStepGoneError as e:  # the file is there, its state is not: damage, as --all
        if e.found is None:
            raise
        report = verify.Report(e.found.root, [_gone_step_report(e.found, args.level)])
        echo(verify.to_json(report.to_dict()) if args.json else verify.render_verify(report))
        return report.exit_code
    # a Lightning folder's sibling root: its steps' .ckpt files are checked too
    folder = folder_of(cps.url) if lightning is None and cps.is_root and \
        "://" not in cps.url else None
    # --all of a Lightning folder: its files are checked too, so a folder whose files all
    # name steps that are gone is reported (below), not refused as holding no step
    steps = cps.steps() if args.all and folder is not None else _steps(cps, args)
    for step in steps:
        progress = None
        if args.level != "structure":  # drawn only when stderr is a terminal
            try:
                total = sum(c.length for e in cps.manifest(step).tensors.values()
                            for c in e.chunks)
                progress = verify.ProgressBar(total, f"step {step}")
            except CheckpointError:
                pass  # the verifier reports it
        try:
            report = verify.verify_step(
                cps, step, args.level, progress, model=args.model, loss=args.loss,
                rtol=args.rtol, atol=args.atol, threads=args.threads,
                trust_recorded=args.trust_recorded)
            if lightning is not None:
                _check_lightning_file(cps, lightning, report)
            elif folder is not None:
                _check_lightning_files(cps, folder, step, report)
            reports.append(report)
        except CheckpointNotFoundError as e:
            if not args.all:
                raise
            echo(f"ckpt verify: skipped step {step}, no longer committed: {e}",
                 file=sys.stderr)  # a live writer's retention deleted it after the listing
    if args.all and folder is not None:
        reports = sorted(reports + _files_of_gone_steps(cps, folder, args.level),
                         key=lambda r: r.step)
    if not reports:
        _steps(cps, args)  # raises: the root holds no committed step (exit 2)
    report = verify.Report(cps.url, reports)
    echo(verify.to_json(report.to_dict()) if args.json else verify.render_verify(report))
    return report.exit_code


def _files_of_gone_steps(cps: Checkpoints, folder: str, level: str) -> list[verify.StepReport]:
    """A failed ``file`` check for each step that ``.ckpt`` files of ``folder`` name and the
    root does not hold: loading such a file falls back to an earlier step."""
    claimed = claims_in(folder, cps.url)
    # Listed again after the files: on a live run a step commits just before its file is
    # renamed into place, so a file seen here has its step in this listing if it has one.
    committed = set(cps.steps())
    reports = []
    for step, files in sorted(claimed.items()):
        # (a file deleted meanwhile, by Lightning rotating its checkpoints, is not reported)
        files = [f for f in files if step not in committed and claim(f.path) == step]
        if not files:
            continue
        report = verify.StepReport(step, level, checks=["file"], location=folder,
                                   files=len(files))
        report.problems += [verify.Problem("file", gone_step(found, cps.url), found.path)
                            for found in files]
        reports.append(report)
    return reports


def _gone_step_report(found: LightningFile, level: str) -> verify.StepReport:
    """``ckpt verify FILE.ckpt`` of a file whose step its sibling root does not hold: the
    failed ``file`` check that ``--all`` of its folder reports for it."""
    return verify.StepReport(
        found.step, level, checks=["file"], location=f"{found.path} (step {found.step} of "
        f"{found.root})", files=1, problems=[verify.Problem("file", gone_step(found, found.root),
                                                              found.path)])


def _check_lightning_file(cps: Checkpoints, found: LightningFile, report: verify.StepReport,
                          *, location: bool = True) -> None:
    """Add the ``file`` check to a Lightning step's report: the ``.ckpt`` file against the
    size (structure level) or the digests (digest level and up) its step recorded; runs
    after the step's own checks passed (the manifest holds the records). ``location``: the
    report is about this file (``ckpt verify FILE.ckpt``)."""
    if location:
        report.location = f"{found.path} (step {found.step} of {found.root})"
    if any(p.check != "file" for p in report.problems) or report.error is not None:
        return
    untrusted = untrusted_root(found)
    if untrusted is not None:
        report.ok = False
        report.error = (f"{found.root} {untrusted}: it cannot vouch for {found.path} (someone "
                        "else may have planted its digests); check it as the files' owner")
        return
    t0 = time.perf_counter()
    records = cps.manifest(found.step).metadata.get(FILES_KEY)
    if "file" not in report.checks:
        report.checks.append("file")
    failed, nbytes = check_file(found, records, digest=report.level != "structure")
    report.files += 1
    report.bytes += nbytes
    if failed is not None:
        report.problems.append(verify.Problem("file", failed, found.path))
        report.ok = False
    report.seconds += time.perf_counter() - t0


def _check_lightning_files(cps: Checkpoints, folder: str, step: int,
                           report: verify.StepReport) -> None:
    """The ``file`` check of each ``.ckpt`` in ``folder`` that claims ``step``, when the
    step records Lightning files; one that none claims has lost its state."""
    if report.problems or report.error is not None:
        return
    if FILES_KEY not in cps.manifest(step).metadata:
        return  # not a Lightning step
    files = files_of(folder, step, cps.url)
    if not files:
        report.checks.append("file")
        report.problems.append(verify.Problem(
            "file", f"no .ckpt file in {folder} names step {step}: its state is gone "
            "(its files were deleted or moved outside Lightning, which retires a step with "
            "its last file)", folder))
        report.ok = False
        return
    for found in files:
        _check_lightning_file(cps, found, report, location=False)


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
        side_a = side_b = open_path(operands[0])
    elif len(operands) == 2:  # PATH_A PATH_B: two runs or two checkpoint directories
        if operands[1].isdigit() and not os.path.lexists(operands[1]):
            raise verify.UsageError(
                f"{operands[1]} is no path: to compare two steps of {operands[0]} give both "
                "(ckpt diff ROOT A B), to compare two runs give two paths (ckpt diff PATH_A "
                "PATH_B)")
        side_a, side_b = open_path(operands[0]), open_path(operands[1])
        a = _step_of(side_a, args.step_a)
        b = _step_of(side_b, args.step_b)
    else:
        raise verify.UsageError("ckpt diff takes ROOT A B (two steps of one root) or PATH_A "
                                "PATH_B (two roots or checkpoint directories)")
    result = verify.diff_steps(side_a, a, b, threads=args.threads,
                               other=None if side_b is side_a else side_b,
                               filters=args.filter or ())
    if result.unmatched:  # else "nothing differs" would answer a typo
        raise verify.UsageError(
            f"--filter {' '.join(repr(f) for f in result.unmatched)} matches no tensor, value "
            "or item of either step; `ckpt inspect` lists their names (model/weight, "
            "optim/param_groups/0/lr...)")
    code = EXIT_FAILED if args.exit_code and result.differs else EXIT_OK
    echo(verify.to_json(with_status(result.to_dict(), code)) if args.json else
         verify.render_diff(result))
    return code


def _step_of(cps: Checkpoints, step: int | None) -> int:
    if step is not None:
        cps.require(step)
        return step
    return _steps(cps, argparse.Namespace())[0]


def cmd_export(args: argparse.Namespace) -> int:
    if args.to == "hf":
        return _export_hf(args)
    cps = open_path(args.root)
    step = _steps(cps, args)[0]
    if args.to == "dcp":
        from ._interop import export_to_dcp

        return export_to_dcp(args, step)
    result = verify.export_step(cps, step, args.to, args.file, item=args.item,
                                force=args.force, threads=args.threads)
    echo(verify.to_json(with_status(vars(result), EXIT_OK)) if args.json else
         verify.render_export(result))
    return EXIT_OK


def _export_hf(args: argparse.Namespace) -> int:
    from verify.export_hf import DEFAULT_SHARD_BYTES, export_hf, parse_size, render_hf_export

    shard = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_SHARD_BYTES
    cps = open_path(args.root)
    result = export_hf(cps, _steps(cps, args)[0], args.file, item=args.item,
                       force=args.force, max_shard_bytes=shard, threads=args.threads)
    echo(verify.to_json(with_status(vars(result), EXIT_OK)) if args.json else
         render_hf_export(result))
    return EXIT_OK
