"""Integrity levels of ``ckpt verify``, composed from ckpt's own primitives."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import ckpt
from ckpt.format import step_dir
from ckpt.integrity import check_digests, check_structure, read_manifest

LEVELS = ("structure", "digest")


@dataclass
class StepReport:
    """The outcome of verifying one step."""

    step: int
    level: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def verify_step(mgr: ckpt.CheckpointManager, step: int, level: str = "structure",
                progress: Callable[[int], None] | None = None) -> StepReport:
    """Verify one committed step of an open (read-only) manager at ``level``."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    t0 = time.perf_counter()
    report = StepReport(step, level, ok=False)
    location = step_dir(step)
    try:
        manifest = read_manifest(mgr.storage, location, step)
        report.tensors = len(manifest.tensors)
        report.bytes = sum(c.length for e in manifest.tensors.values() for c in e.chunks)
        check_structure(mgr.storage, location, manifest)
        if level == "digest":
            report.problems = check_digests(mgr.storage, location, manifest, progress=progress)
    except ckpt.CheckpointError as e:
        report.problems.append(str(e))
    report.ok = not report.problems
    report.seconds = time.perf_counter() - t0
    return report


def verify(root: str, step: int | None = None, level: str = "structure") -> StepReport:
    """Verify ``step`` (the newest when None) of the checkpoints under ``root``.

    Raises:
        CheckpointNotFoundError: the root does not exist or holds no committed step.
    """
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        if step is None:
            step = mgr.latest_step()
            if step is None:
                raise ckpt.CheckpointNotFoundError(f"{root} holds no committed step", path=root)
        return verify_step(mgr, step, level)
