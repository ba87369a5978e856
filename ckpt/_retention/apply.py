"""A policy applied to a root: the metrics and the recorded policy read from its manifests,
and the steps to keep."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from storage_backends import Storage

from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt._format.names import step_dir
from ckpt._retention.policy import RECORD_KEY, RetentionPolicy, saved_metrics
from ckpt._step.integrity import read_manifest
from ckpt._step.verified import newest_verified

log = logging.getLogger("ckpt")


def step_metrics(storage: Storage, steps: Sequence[int]) -> dict[int, Mapping[str, Any]]:
    """Each step's saved metrics; a step whose manifest cannot be read has none (logged)."""
    out: dict[int, Mapping[str, Any]] = {}
    for s in steps:
        try:
            out[s] = saved_metrics(read_manifest(storage, step_dir(s), s).metadata)
        except (CheckpointError, OSError) as e:
            log.warning("ckpt.retention step=%d has no readable metrics: %s", s, e)
            out[s] = {}
    return out


def steps_to_keep(storage: Storage, policy: RetentionPolicy, steps: Sequence[int], *,
                  newest: int | None) -> set[int]:
    """The committed ``steps`` that ``policy`` keeps, reading the metrics it ranks by from
    the manifests; ``newest`` (the newest good step) and the newest verified step (read
    from the markers, newest first) are kept whatever the rules."""
    metrics = step_metrics(storage, steps) if policy.keep_best is not None else None
    verified = None if policy.keeps_all else newest_verified(storage, steps)
    return policy.retained(steps, metrics, newest=newest, verified=verified)


def recorded_policy(storage: Storage,
                    steps: Sequence[int]) -> tuple[RetentionPolicy | None, int | None]:
    """The policy the newest readable manifest among ``steps`` records, and its step.

    Returns ``(None, step)`` when that manifest records none (its writer kept every step),
    ``(None, None)`` when no manifest can be read. A manifest that cannot be read is passed
    over for the one before: the record of a damaged step is unknown, an older one's is not.

    Raises:
        CorruptCheckpointError: the record is not a policy this version can apply.
    """
    for s in sorted(steps, reverse=True):
        try:
            metadata = read_manifest(storage, step_dir(s), s).metadata
        except (CheckpointError, OSError) as e:
            log.warning("ckpt.retention step=%d: no readable policy record: %s", s, e)
            continue
        if RECORD_KEY not in metadata:
            return None, s
        try:
            return RetentionPolicy.from_record(metadata[RECORD_KEY]), s
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"step {s} records a retention policy ckpt cannot apply ({e}): its manifest "
                f"was altered, or written by a newer ckpt", path=storage.url) from e
    return None, None
