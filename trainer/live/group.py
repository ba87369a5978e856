"""The ranks of one replica group: their local process group, and how a rank averages its
gradients over its group and, through torchft, over the ranks of the same index in the
other groups.

Two layouts, told apart by the model's parameters:

- **replicated** (plain tensors: DDP inside the group): every rank of the group holds the
  whole model. The flattened gradient is summed over the group (gloo all-reduce), each
  rank averages its 1/N slice of it across groups (torchft's all-reduce of this group
  rank), and the group gathers the slices back: each byte crosses between groups once,
  not N times;
- **sharded** (DTensors: FSDP2's ``fully_shard`` over the group's mesh, HSDP's shard
  dimension): each rank holds a shard, FSDP2 has averaged its gradient over the group
  already, and the rank averages its shard's gradient across groups (HSDP's replica
  dimension).

Either way a rank's cross-group all-reduce may fail (a peer lost inside it) while its
group's other ranks' succeed: the failure goes to the manager, whose commit vote is one
for the whole group, and the rank still takes part in the group's own collectives, so that
no rank of a live group waits for one that gave up.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from trainer.live.config import LiveConfig


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of a parameter or of its state)."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")


class LocalGroup:
    """This process's replica group: its c10d store (torchft's manager and the group's
    process group meet there; rank 0 hosts it) and, with several ranks, the default
    process group over the group's ranks (gloo).

    Args:
        live: the job's settings (``group_rank``, ``group_size``, ``group_store``).
        timeout: seconds for the group's collectives.
        start_timeout: seconds a rank waits for rank 0's store.
    """

    def __init__(self, live: LiveConfig, timeout: timedelta, start_timeout: timedelta) -> None:
        self.rank, self.size = live.group_rank, live.group_size
        #: the layout (see the module); the trainer sets it from the model's parameters
        self.replicated = True
        if self.size == 1:
            # nobody else connects: a free port of this group's own
            self.store = TCPStore(live.host, 0, is_master=True, wait_for_workers=False)
            self.store_host = live.host
            return
        if live.group_store is None:
            raise ValueError(f"rank {self.rank} of a group of {self.size} needs the group's "
                             f"store (LiveConfig.group_store, env CKPT_LIVE_GROUP_STORE: "
                             f"host:port of the store the group's rank 0 hosts)")
        host, port = live.group_store.rsplit(":", 1)
        self.store_host = host.strip("[]")
        self.store = TCPStore(self.store_host, int(port), is_master=self.rank == 0,
                              wait_for_workers=False, timeout=start_timeout)
        dist.init_process_group("gloo", store=PrefixStore("ckpt-live/local/", self.store),
                                rank=self.rank, world_size=self.size, timeout=timeout)

    @property
    def store_port(self) -> int:
        return int(self.store.port)

    def sync(self, grads: list[torch.Tensor], cross: Callable[[torch.Tensor], Any]
             ) -> Exception | None:
        """Average ``grads`` (this rank's local tensors, in place) over the group and the
        quorum; ``cross(flat)`` starts the cross-group average of this rank's tensor.
        Returns the cross-group failure, if any (the values are then not to be used)."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        error: Exception | None = None
        if self.size == 1 or not self.replicated:
            try:
                cross(flat).wait()
            except Exception as e:
                error = e
        else:
            dist.all_reduce(flat)  # the group's sum
            n = flat.numel()
            chunk = -(-n // self.size)
            padded = torch.zeros(chunk * self.size, dtype=flat.dtype)
            padded[:n] = flat
            padded /= self.size
            mine = padded[self.rank * chunk:(self.rank + 1) * chunk].clone()
            try:
                cross(mine).wait()
            except Exception as e:
                error = e
            # every rank gathers, failed or not: a rank left out would wait here
            parts = list(padded.split(chunk))
            dist.all_gather(parts, mine)
            flat = torch.cat(parts)[:n]
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return error

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def local_tree(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (what a peer's same rank
    holds too: the heal sends plain tensors)."""
    if is_sharded(value):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_tree(v) for v in value)
    return value


def shard_like(template: Any, received: Any) -> Any:
    """``received`` (from :func:`local_tree` in a peer's same rank) with each tensor made a
    DTensor where ``template`` (this rank's own state) holds one, on the same mesh and
    placements."""
    if is_sharded(template):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(received.to(template.dtype), template.device_mesh,
                                  template.placements, shape=template.shape,
                                  stride=template.stride())
    if isinstance(template, dict) and isinstance(received, dict):
        return {k: shard_like(template.get(k), v) for k, v in received.items()}
    if isinstance(template, (list, tuple)) and isinstance(received, (list, tuple)) \
            and len(template) == len(received):
        return type(received)(shard_like(t, v) for t, v in zip(template, received))
    return received


__all__ = ["LocalGroup", "is_sharded", "local_tree", "shard_like"]
