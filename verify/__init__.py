"""Checks that a checkpoint is whole and loadable: ``verify.verify(root, step, level)``."""

from .integrity import LEVELS, StepReport, verify, verify_step

__all__ = ["LEVELS", "StepReport", "verify", "verify_step"]
