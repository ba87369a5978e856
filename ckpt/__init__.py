"""ckpt: fault-tolerant checkpoints for PyTorch training."""

from . import inspect
from .adapters import ModelOptimizer
from .api import CheckpointExistsError, async_save, load, save
from .engine import SaveHandle, SaveResult
from .errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError,
                     CorruptCheckpointError, ForwardCheckError, PartialLoadError,
                     StateMismatchError,
                     StorageError, UnsupportedValueError)
from .manager import CheckpointManager
from .options import SaveOptions
from .probe import Probe
from .rng import RNGState
from .state import PerRank

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "ForwardCheckError",
    "ModelOptimizer",
    "PartialLoadError",
    "PerRank",
    "Probe",
    "RNGState",
    "SaveHandle",
    "SaveOptions",
    "SaveResult",
    "StateMismatchError",
    "StorageError",
    "UnsupportedValueError",
    "async_save",
    "inspect",
    "load",
    "save",
]
__version__ = "0.1.0"
