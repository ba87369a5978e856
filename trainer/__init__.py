"""Training-side helpers used with ckpt: resumable data sampling, a tiny demo model, and an
elastic trainer for torchrun."""

from trainer.data import ResumableSampler
from trainer.elastic import ElasticSummary, ElasticTrainer, Recovery
from trainer.heartbeat import Heartbeat, PeerLoss

__all__ = [
    "ElasticSummary",
    "ElasticTrainer",
    "Heartbeat",
    "PeerLoss",
    "Recovery",
    "ResumableSampler",
]
