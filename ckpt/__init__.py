"""ckpt: fault-tolerant checkpoints for PyTorch training."""

from . import inspect
from ckpt._shared.adapters import ModelOptimizer
from ckpt.api import CheckpointExistsError, async_save, load, save
from ckpt._save.handle import SaveHandle, SaveResult
from ckpt.errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError,
                     CorruptCheckpointError, ForwardCheckError, PartialLoadError,
                     StateMismatchError, StepOrderError,
                     StorageError, UnsupportedValueError)
from ckpt._manager.manager import CheckpointManager
from ckpt.options import MemoryTierOptions, MetricsOptions, SaveOptions, Schedule
from ckpt._retention.policy import KeepBest, RetentionPolicy
from ckpt._load.probe import Probe
from ckpt._shared.rng import RNGState
from ckpt._shared.state import PerRank

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "ForwardCheckError",
    "KeepBest",
    "MemoryTierOptions",
    "MetricsOptions",
    "ModelOptimizer",
    "PartialLoadError",
    "PerRank",
    "Probe",
    "RNGState",
    "RetentionPolicy",
    "SaveHandle",
    "SaveOptions",
    "SaveResult",
    "Schedule",
    "StateMismatchError",
    "StepOrderError",
    "StorageError",
    "UnsupportedValueError",
    "async_save",
    "inspect",
    "load",
    "save",
]
__version__ = "0.1.0"
