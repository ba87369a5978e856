"""Where an elastic worker runs: torchrun's environment, the process group and the model.

The world-size arithmetic that keeps the global batch constant, the device and process
group of this worker (from torchrun's ``WORLD_SIZE``/``MASTER_ADDR``/``LOCAL_RANK``), the
heartbeat's connection to the c10d store, and the model wrapped for data parallelism
(DDP, or FSDP2's ``fully_shard``). :class:`Attempt` holds one attempt's device, rank,
world size and collectives for the parts of :class:`trainer.elastic.ElasticTrainer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainer.heartbeat import Heartbeat


def valid_world_sizes(global_batch_size: int, micro_batch_size: int,
                      limit: int | None = None) -> list[int]:
    """World sizes at which ``global_batch_size`` splits into whole micro batches per rank."""
    if global_batch_size % micro_batch_size:
        return []
    micro_batches = global_batch_size // micro_batch_size
    top = micro_batches if limit is None else min(limit, micro_batches)
    return [w for w in range(1, top + 1) if micro_batches % w == 0]


def check_world_size(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Gradient accumulation steps at ``world_size``; ValueError naming the sizes that work."""
    if global_batch_size <= 0 or micro_batch_size <= 0:
        raise ValueError("global_batch_size and micro_batch_size must be positive")
    if global_batch_size % (micro_batch_size * world_size) == 0:
        return global_batch_size // (micro_batch_size * world_size)
    works = valid_world_sizes(global_batch_size, micro_batch_size)
    raise ValueError(
        f"global batch {global_batch_size} does not split into micro batches of "
        f"{micro_batch_size} over {world_size} ranks (global batch = micro batch x world "
        f"size x accumulation steps); world sizes that work: "
        f"{', '.join(map(str, works)) if works else 'none (micro batch does not divide it)'}"
        f". Start the job with a world size from that list (torchrun --nnodes=MIN:MAX with "
        f"node counts giving such sizes), or change the batch sizes")


def expected_world_size() -> int:
    """The world size of the process group, or the one torchrun's environment announces."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_count() -> int:
    """How often torchrun's agent restarted this worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def process_start_time(pid: int | str = "self") -> float:
    """Wall time at which process ``pid`` (default: this one) started (Linux: from /proc,
    to the clock tick), else now."""
    from trainer.warm import proc_stat

    try:
        ticks = int(proc_stat(pid)[19])
        # The start time counts clock ticks since boot: CLOCK_BOOTTIME's origin, read
        # with the wall clock at the same moment (/proc/stat's btime is whole seconds).
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def warm_start() -> dict[str, Any]:
    """How this worker process came to be: ``{"zygote": pid, "launcher": pid,
    "launcher_start": time}`` when a zygote of :mod:`trainer.warm` forked it (the launcher
    is the process torchrun started), else ``{"zygote": None}``."""
    from trainer.warm import LAUNCHER_ENV, ZYGOTE_ENV

    zygote = os.environ.get(ZYGOTE_ENV)
    if zygote is None or str(os.getppid()) != zygote:
        return {"zygote": None}
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not launcher.isdigit():
        return {"zygote": int(zygote), "launcher": None, "launcher_start": None}
    return {"zygote": int(zygote), "launcher": int(launcher),
            "launcher_start": process_start_time(launcher)}


def warm_imports() -> None:
    """Import torch._dynamo in the background: DDP's constructor (and the first optimizer)
    import it, 1.6 s on a small CPU machine, which a restarted worker would pay after its
    process group formed. Started at construction, it overlaps init_process_group's wait
    for the peers."""
    import importlib
    import sys

    if "torch._dynamo" in sys.modules:  # a warm start (trainer.warm): imported already
        return

    def work() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module("torch._dynamo")

    threading.Thread(target=work, name="ckpt-elastic-warm-imports", daemon=True).start()


def pick_device(device: str | torch.device | None) -> torch.device:
    """``device``, else ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def wants_process_group() -> bool:
    """Whether torchrun's environment describes a process group to join."""
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def start_process_group(device: torch.device, collective_timeout: float) -> None:
    """Join the process group of torchrun's environment: NCCL on CUDA, else gloo, with
    ``collective_timeout`` on every collective and store call."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, timeout=datetime.timedelta(seconds=collective_timeout),
        **({"device_id": device} if backend == "nccl" else {}))


def heartbeat_store(attempt: int) -> Any:
    """The c10d store the heartbeats of ``attempt`` go through, on a connection of its own
    where the store type allows one."""
    base = dist.distributed_c10d._get_default_store()
    try:
        store = base.clone()  # its own connection: no queueing behind ckpt's store waits
    except Exception:  # store types without clone (FileStore on old torch): share it
        store = base
    return dist.PrefixStore(f"ckpt-elastic/a{attempt}/hb", store)


def wrap_model(model: torch.nn.Module, device: torch.device,
               fsdp: bool | Callable[..., torch.nn.Module], distributed: bool,
               world_size: int) -> torch.nn.Module:
    """``model`` ready for data-parallel training: sharded with FSDP2 when ``fsdp`` is
    set, in DDP on more than one rank, else as it is."""
    if fsdp and distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        if callable(fsdp):
            return fsdp(model, mesh)
        # each layer of every ModuleList (transformer blocks), then the rest
        for container in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for layer in container:
                if any(p.requires_grad for p in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if distributed and world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


@dataclasses.dataclass
class Attempt:
    """Where one attempt of the job runs: its device, its place in the process group, and
    the collectives the trainer's parts share. Built by :meth:`join`; ``number`` is the
    attempt's number in the run directory (0 for the first), agreed by every rank."""

    device: torch.device
    rank: int
    world_size: int
    distributed: bool
    owns_group: bool
    accumulation: int
    group_ready_at: float
    number: int = 0

    @classmethod
    def join(cls, device: str | torch.device | None, collective_timeout: float,
             global_batch_size: int, micro_batch_size: int) -> Attempt:
        """Pick the device and join torchrun's process group (if there is one and it is
        not joined yet). ValueError when the world size does not split the global batch."""
        dev = pick_device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        owns = False
        if not (dist.is_available() and dist.is_initialized()) and wants_process_group():
            start_process_group(dev, collective_timeout)
            owns = True
        distributed = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        accumulation = check_world_size(global_batch_size, micro_batch_size, world)
        return cls(dev, rank, world, distributed, owns, accumulation, time.time())

    @property
    def collective(self) -> bool:
        """Whether collectives go anywhere (a process group of more than one rank)."""
        return self.distributed and self.world_size > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.collective:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        if not self.collective:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.collective:
            dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.collective:
            dist.barrier()

    def leave(self) -> None:
        """Destroy the process group if this attempt created it."""
        if self.owns_group:
            dist.destroy_process_group()
            self.owns_group = False


def start_heartbeat(attempt: Attempt, timeout: float | None, interval: float,
                    on_lost: Callable[[Any], None] | None, **progress: Any) -> Heartbeat | None:
    """The heartbeat of this rank (None: no peers to watch, or no timeout asked);
    ``progress``: its ``sections`` and ``hang_rule`` (:class:`Heartbeat`)."""
    if not attempt.distributed or timeout is None or attempt.world_size == 1:
        return None
    return Heartbeat(heartbeat_store(attempt.number), attempt.rank, attempt.world_size,
                     timeout=timeout, interval=interval, on_lost=on_lost, **progress).start()


__all__ = ["Attempt", "check_world_size", "expected_world_size", "heartbeat_store",
           "pick_device", "process_start_time", "restart_count", "start_heartbeat",
           "start_process_group", "valid_world_sizes", "wants_process_group", "warm_imports",
           "warm_start", "wrap_model"]
