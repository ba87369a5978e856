"""What tools built on ckpt use beyond the training API: the ``ckpt`` command (verify/), the
trainer and its framework integrations (trainer/), and a user's own scripts.

Step names and listings of a root, pointer files (the step a framework's checkpoint path
stands for), the retention policy and the collection of a root, and the collection of
memory-tier segments without a live owner. Reading a step's contents is :mod:`ckpt.inspect`.
"""

from ckpt._format.names import step_dir
from ckpt._manager.metrics import default_labels
from ckpt._memory.tier import gc_segments
from ckpt._retention.apply import recorded_policy
from ckpt._retention.gc import GcResult, collect_root
from ckpt._retention.policy import KeepBest, RetentionPolicy
from ckpt._step.listing import committed_steps
from ckpt._step.pointer import POINTER_NAME, read_pointer, write_pointer

__all__ = [
    "GcResult",
    "KeepBest",
    "POINTER_NAME",
    "RetentionPolicy",
    "collect_root",
    "committed_steps",
    "default_labels",
    "gc_segments",
    "read_pointer",
    "recorded_policy",
    "step_dir",
    "write_pointer",
]
