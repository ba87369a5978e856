"""The process group as ckpt uses it: collectives in the foreground of a save only, and the
c10d store (plain key/value calls, safe from the background writer) for the commit vote.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch.distributed as dist

from ckpt.errors import CheckpointError


class Group:
    """Rank, world size and the few exchanges a save needs (a no-op for one process)."""

    def __init__(self, process_group: Any = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.pg = process_group
        if self.enabled:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            base = dist.distributed_c10d._get_default_store()
            try:
                self._store = base.clone()  # own connection: the commit wait blocks no one
            except Exception:  # stores without clone(): share the connection
                self._store = base
        else:
            self.rank, self.world_size, self._store = 0, 1, None
        self.enabled = self.enabled and self.world_size > 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0)
                                   if self.pg is not None else 0, group=self.pg)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.pg)

    # -- store-based exchange: usable from the background writer ------------------------------
    def publish(self, key: str, value: dict) -> None:
        self._store.set(f"ckpt/{key}", json.dumps(value))

    def collect(self, keys: list[str], timeout: float) -> list[dict]:
        """Wait for ``keys`` (published by other ranks) and return their values."""
        full = [f"ckpt/{k}" for k in keys]
        try:
            self._store.wait(full, datetime.timedelta(seconds=timeout))
        except Exception as e:  # DistStoreError / RuntimeError on timeout
            missing = [k for k in keys if not self._store.check([f"ckpt/{k}"])]
            raise CheckpointError(
                f"no word within {timeout:.0f}s from {', '.join(missing) or 'peers'}: a rank "
                "died or hangs; the step was not committed") from e
        if hasattr(self._store, "multi_get"):  # one round trip for thousands of ranks
            return [json.loads(v) for v in self._store.multi_get(full)]
        return [json.loads(self._store.get(k)) for k in full]

    def forget(self, keys: list[str]) -> None:
        for k in keys:
            try:
                self._store.delete_key(f"ckpt/{k}")
            except Exception:  # best effort: stale keys are tiny and namespaced by token
                pass
