"""Where an elastic worker runs: torchrun's environment, the process group and the model.

The world-size arithmetic that keeps the global batch constant, the device and process
group of this worker (from torchrun's ``WORLD_SIZE``/``MASTER_ADDR``/``LOCAL_RANK``), the
heartbeat's connection to the c10d store, and the model wrapped for data parallelism
(DDP, or FSDP2's ``fully_shard``). :class:`AttemptSetup` puts them together for
:class:`trainer.elastic.ElasticTrainer`: everything an attempt does before its first step.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import ckpt
from trainer.data import ResumableSampler
from trainer.heartbeat import Heartbeat
from trainer.metrics import format_event
from trainer.progress import recorded_skips

log = logging.getLogger("trainer.elastic")
events = logging.getLogger("ckpt.trainer")


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


def process_start_time() -> float:
    """Wall time at which this process started (Linux: from /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def warm_imports() -> None:
    """Import torch._dynamo in the background: DDP's constructor (and the first optimizer)
    import it, 1.6 s on a small CPU machine, which a restarted worker would pay after its
    process group formed. Started at construction, it overlaps init_process_group's wait
    for the peers."""
    import importlib

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


class AttemptSetup:
    """What an attempt of :class:`trainer.elastic.ElasticTrainer` does before its first
    step: join the process group, start the heartbeat, build the model, optimizer and
    checkpointed state, and restore the newest checkpoint (a mixin: it uses the trainer's
    configuration, records and metrics).
    """

    def _init_distributed(self) -> None:
        self.device = pick_device(self._device_arg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_available() and dist.is_initialized():
            self._owns_group = False
        elif wants_process_group():
            start_process_group(self.device, self.collective_timeout)
            self._owns_group = True
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        self.accumulation = check_world_size(self.global_batch_size, self.micro_batch_size,
                                             self.world_size)

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if not self.distributed or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _start_heartbeat(self) -> None:
        if not self.distributed or self.heartbeat_timeout is None or self.world_size == 1:
            return
        self._heartbeat = Heartbeat(heartbeat_store(self.attempt), self.rank, self.world_size,
                                    timeout=self.heartbeat_timeout,
                                    interval=self.heartbeat_interval, on_lost=self._peer_lost
                                    if self.hard_exit else None).start()
        self.metrics.heartbeat = self._heartbeat

    def _build(self) -> None:
        """The model (same initial weights on every rank), wrapped; optimizer, scheduler,
        sampler, the checkpointed state and its checkpoint manager."""
        t0 = time.time()
        torch.manual_seed(self.seed)  # the same initial weights on every rank
        model = self.model_fn().to(self.device)
        self.module = model
        t_model = time.time()
        self.model = wrap_model(model, self.device, self.fsdp, self.distributed,
                                self.world_size)
        self.optimizer = self.optimizer_fn(self.model.parameters())
        self._record("built", seconds=time.time() - self._group_ready_at,
                     model_s=t_model - t0, wrap_s=time.time() - t_model)
        self.scheduler = self.scheduler_fn(self.optimizer) if self.scheduler_fn else None
        self.sampler = ResumableSampler(len(self.dataset), seed=self.seed)
        torch.manual_seed(self.seed + 1 + self.rank)  # dropout differs by rank
        self.state: dict[str, Any] = self._checkpointed_state()
        options = {"keep_last": 3, "commit_timeout": self.collective_timeout,
                   **self.checkpoint_options}
        self._manager = ckpt.CheckpointManager(
            self.checkpoint_root, every_steps=self.checkpoint_every, handle_sigterm=False,
            save_on_preemption=False, **options)
        self.metrics.attach_checkpoint(self._manager.metrics)

    def _checkpointed_state(self) -> dict[str, Any]:
        """The items every checkpoint holds (the model and optimizer through
        ``ckpt.ModelOptimizer`` with FSDP, so that any world size can load them)."""
        state: dict[str, Any] = {"rng": ckpt.RNGState(), "data": self.sampler,
                                 "meta": {"step": 0}}
        if self.fsdp:
            state["train"] = ckpt.ModelOptimizer(self.model, self.optimizer)
        else:
            state["model"] = self.module
            state["optim"] = self.optimizer
        if self.scheduler is not None:
            state["sched"] = self.scheduler
        if self.grad_scaler is not None:
            state["scaler"] = self.grad_scaler
        return state

    def _restore(self) -> int:
        """Load the newest checkpoint (a fresh run with a health guard saves step 0 instead)
        and the batches earlier rollbacks marked bad; returns the step to continue after."""
        assert self._manager is not None
        t0 = time.time()
        restored = self._manager.restore(self.state)
        start = restored or 0
        self._skipped_batches = 0
        if restored is not None:
            meta = self.state.get("meta") or {}
            self._skipped_batches = int(meta.get("skipped_batches", 0))
            if self._data_offset() != (start + self._skipped_batches) * self.global_batch_size:
                log.warning("rank %d: checkpoint step %d has %d samples consumed, expected "
                            "(%d + %d skipped) x %d: was it written with another global batch "
                            "size?", self.rank, start, self._data_offset(), start,
                            self._skipped_batches, self.global_batch_size)
            log.info("rank %d: resumed from step %d (written by attempt %s at world size %s) "
                     "in %.2fs", self.rank, start, meta.get("attempt"), meta.get("world"),
                     time.time() - t0)
        elif self.health is not None:
            # A rollback before the first scheduled checkpoint needs a step to go back to.
            self.state["meta"] = self._meta(0, None)
            self._manager.save(0, self.state, force=True)
        skips = recorded_skips(self.run_dir, self.global_batch_size) if self.rank == 0 else None
        self._skips = set(self._broadcast(skips))
        self._step = start
        self._record("restored", step=start, fresh=restored is None, seconds=time.time() - t0)
        events.info(format_event("train.resume", rank=self.rank, step=start,
                                 fresh=restored is None, seconds=round(time.time() - t0, 3),
                                 known_bad_batches=len(self._skips)))
        if self._heartbeat is not None:
            self._heartbeat.update(start)
        return start


__all__ = ["AttemptSetup", "check_world_size", "expected_world_size", "heartbeat_store",
           "pick_device", "process_start_time", "restart_count", "start_process_group",
           "valid_world_sizes", "wants_process_group", "warm_imports", "wrap_model"]
