"""Training-side helpers used with ckpt: resumable data sampling and a tiny demo model."""

from trainer.data import ResumableSampler

__all__ = [
    "ResumableSampler",
]
