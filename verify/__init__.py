"""Checks that a checkpoint is whole and loadable, and the tools of the ``ckpt`` command
built on them, usable as a library::

    import verify
    report = verify.verify("/ckpt/run1", level="digest")       # newest step
    if not report.ok:
        print(verify.render_verify(verify.Report(report.location, [report])))

Levels (each includes the ones before): ``structure`` (manifest, files, sizes, safetensors
headers), ``digest`` (every chunk's xxh3), ``forward`` (load into a fresh model, check the
weights are finite, rerun the recorded :class:`ckpt.Probe`).
"""

from .diff import StepDiff, TensorDiff, ValueDiff, diff_steps, user_metadata
from .export import FORMATS, ExportResult, export_step
from .forward import TOLERANCES, check_forward, tolerance_for
from .integrity import LEVELS, check_digests, check_structure, verify, verify_step
from .report import (EXIT_FAILED, EXIT_OK, EXIT_USAGE, Problem, ProgressBar, Report,
                     StepReport, UsageError, render_diff, render_export, render_verify, to_json)

__all__ = [
    "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "FORMATS", "LEVELS", "TOLERANCES",
    "ExportResult", "Problem", "ProgressBar", "Report", "StepDiff", "StepReport", "TensorDiff",
    "UsageError", "ValueDiff",
    "check_digests", "check_forward", "check_structure", "diff_steps", "export_step",
    "render_diff", "render_export", "render_verify", "to_json", "tolerance_for", "verify",
    "user_metadata", "verify_step",
]
