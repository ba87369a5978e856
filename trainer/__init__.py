"""Training-side helpers used with ckpt: resumable data sampling, a tiny demo model, and an
elastic trainer for torchrun."""

from trainer.data import ResumableLoader, ResumableSampler
from trainer.elastic import ElasticSummary, ElasticTrainer, Recovery
from trainer.health import HealthGuard, TrainingHealthError
from trainer.heartbeat import Heartbeat, PeerLoss
from trainer.hooks import Hooks
from trainer.metrics import TrainerMetrics

__all__ = [
    "ElasticSummary",
    "ElasticTrainer",
    "HealthGuard",
    "Heartbeat",
    "Hooks",
    "PeerLoss",
    "Recovery",
    "ResumableLoader",
    "ResumableSampler",
    "TrainerMetrics",
    "TrainingHealthError",
]
