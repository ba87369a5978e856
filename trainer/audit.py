"""The elastic trainer's audit log: which samples each rank trained at each step.

With an audit directory (``audit_dir``, or env ``CKPT_ELASTIC_AUDIT_DIR``) every rank of
every attempt writes ``audit-a<attempt>-r<rank>.jsonl``: one record per step with the
sample indices of its share of the global batch and its micro-batch sizes, and one per
global batch the health guards skipped (``"skipped": True``). :func:`read_audit` reduces
the log to the records whose state survived; :func:`read_skips` lists the skipped batches.
See docs/elastic.md and docs/observability.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.progress import JsonLines, read_jsonl

AUDIT_DIR_ENV = "CKPT_ELASTIC_AUDIT_DIR"


def open_audit(audit_dir: str | os.PathLike, attempt: int, rank: int) -> JsonLines:
    """This rank's audit log of ``attempt``."""
    return JsonLines(Path(audit_dir) / f"audit-a{attempt:04d}-r{rank:05d}.jsonl")


def next_audit_attempt(audit_dir: str | os.PathLike | None) -> int:
    """One past the newest attempt with an audit file in ``audit_dir`` (0: none), to number
    the attempts of a job that has no run directory."""
    if audit_dir is None:
        return 0
    numbers = [int(p.name[len("audit-a"):].split("-")[0])
               for p in Path(audit_dir).glob("audit-a*-r*.jsonl")
               if p.name[len("audit-a"):].split("-")[0].isdigit()]
    return max(numbers, default=-1) + 1


def _records(audit_dir: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every record of every attempt and rank, file by file."""
    for path in sorted(Path(audit_dir).glob("audit-*.jsonl")):
        yield from read_jsonl(path)


def read_audit(audit_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """The audit log reduced to what counts: per step, the records of the newest attempt.

    A step trained again after a failure (it came after the checkpoint the job resumed
    from) appears in several attempts; the newest attempt's records are the ones whose
    state survived. Returns ``{step: {"attempt", "world", "ranks": {rank: indices},
    "micro": {rank: [sizes]}}}``. Batches skipped by the health guards are not in it (see
    :func:`read_skips`).
    """
    best: dict[int, dict[str, Any]] = {}
    for r in _records(audit_dir):
        if r.get("skipped"):
            continue
        step, attempt = r["step"], r["attempt"]
        cur = best.get(step)
        if cur is None or attempt > cur["attempt"]:
            cur = best[step] = {"attempt": attempt, "world": r["world"], "ranks": {},
                                "micro": {}}
        if attempt == cur["attempt"]:
            cur["ranks"][r["rank"]] = r["indices"]
            cur["micro"][r["rank"]] = r["micro"]
    return dict(sorted(best.items()))


def read_skips(audit_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The audit log's records of skipped batches: ``{"step", "attempt", "rank", "world",
    "offset", "indices", "skipped": True}``, one per rank and skip, oldest first."""
    out = [r for r in _records(audit_dir) if r.get("skipped")]
    return sorted(out, key=lambda r: (r["attempt"], r["step"], r["rank"]))


__all__ = ["AUDIT_DIR_ENV", "next_audit_attempt", "open_audit", "read_audit", "read_skips"]
