"""Training-side helpers used with ckpt: resumable data sampling, a tiny demo model, and an
elastic trainer for torchrun.

The names below are imported on first use (PEP 562), so that ``python -m trainer.warm``,
the launcher of warm restarts, starts without importing torch (docs/warm-restarts.md).
``from trainer import ElasticTrainer`` imports it on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CheckpointConfig": "trainer.config",
    "DataConfig": "trainer.config",
    "ElasticConfig": "trainer.config",
    "ElasticSummary": "trainer.elastic",
    "ElasticTrainer": "trainer.elastic",
    "FailureConfig": "trainer.config",
    "HealthGuard": "trainer.health",
    "Heartbeat": "trainer.heartbeat",
    "Hooks": "trainer.hooks",
    "ObservabilityConfig": "trainer.config",
    "PeerLoss": "trainer.heartbeat",
    "Recovery": "trainer.elastic",
    "ResumableLoader": "trainer.data",
    "ResumableSampler": "trainer.data",
    "StepConfig": "trainer.config",
    "StragglerConfig": "trainer.config",
    "TrainerMetrics": "trainer.metrics",
    "TrainingHealthError": "trainer.health",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
