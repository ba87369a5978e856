"""What one rank of one attempt writes down: its progress records and its audit log.

Progress records (``<run_dir>/attempt-NNNN/rank-NNNNN.jsonl``, see :mod:`trainer.progress`)
are what the :class:`trainer.progress.ElasticSummary` is built from; audit records
(``<audit_dir>/audit-aNNNN-rNNNNN.jsonl``, see :mod:`trainer.audit`) name the samples each
step trained. Either directory may be absent (None): its records are then not written.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainer.audit import open_audit
from trainer.progress import JsonLines, open_progress


class RunRecords:
    """The progress and audit records of rank ``rank`` in attempt ``attempt``."""

    def __init__(self, run_dir: Path | None, audit_dir: str | Path | None, *, attempt: int,
                 rank: int, world_size: int) -> None:
        self.run_dir = run_dir
        self.attempt, self.rank, self.world_size = attempt, rank, world_size
        self._progress: JsonLines | None = (open_progress(run_dir, attempt, rank)
                                            if run_dir is not None else None)
        self._audit: JsonLines | None = (open_audit(audit_dir, attempt, rank)
                                         if audit_dir else None)

    def record(self, event: str, **fields: Any) -> None:
        """One progress record: ``event``, the time, this rank and ``fields``."""
        if self._progress is not None:
            self._progress.write({"event": event, "time": time.time(), "rank": self.rank,
                                  **fields})

    def audit(self, step: int, **fields: Any) -> None:
        """One audit record of ``step`` (the samples trained or skipped)."""
        if self._audit is not None:
            self._audit.write({"step": step, "attempt": self.attempt, "rank": self.rank,
                               "world": self.world_size, **fields})

    def close(self) -> None:
        for f in (self._progress, self._audit):
            if f is not None:
                f.close()


__all__ = ["RunRecords"]
