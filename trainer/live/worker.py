"""One rank of a replica group of a live job: a training loop that commits each step with
the quorum and heals from a peer, so that losing another group costs it about a heartbeat
timeout.

A group has one rank or several (``LiveConfig.group_size``: a local gloo process group,
:mod:`trainer.live.group`); torchft pairs each rank with the ranks of the same index in
the other groups. Each step:

1. **quorum** (``Manager.start_quorum``, synchronous; every rank of the group asks, the
   group's manager asks the lighthouse once): the lighthouse names the groups of this
   step; a group behind the others (a replacement) heals here, each rank from the rank of
   the same index in a peer group, to the newest step: model, optimizer, scheduler, data
   position and step metadata (all of it replicated across groups: every group holds the
   same values at a committed step);
2. **RNG**: each rank's torch/NumPy/``random`` streams are keyed by (seed, group, rank,
   step), so a replacement draws at step k exactly what the lost rank would have drawn;
3. **data**: the step's global batch comes from the global :class:`ResumableSampler`;
   the rank trains its share (split over the quorum's groups times the group's ranks),
   so the gradient is the global batch's mean whatever the number of groups;
4. **gradients**: after backward, averaged over the group and across groups
   (:meth:`LocalGroup.sync`: our own ``manager.allreduce``, since torchft's
   ``DistributedDataParallel`` crashes the survivors when a peer dies inside its
   all-reduce; a failed ``manager.allreduce`` only fails the commit);
5. **commit** (``Manager.should_commit``): the optimizer steps only if the quorum commits;
   otherwise the data position goes back and the step is tried again, so no sample is
   skipped or repeated;
6. **checkpoint**: a committed step is the moment to snapshot; every ``checkpoint_every``
   steps ckpt saves the state to this group's folder (``<root>/group-<g>``, all ranks of
   the group together), from which a group starts (before the quorum says whether a peer
   is ahead) and from which the whole job resumes when live recovery gives up
   (:data:`EXIT_QUORUM_LOST`). A group that healed to a step holds that step's state
   without having committed it: it saves it then, if the schedule names it, as its peers
   did at their commit (else a replacement that heals onto a save step would leave its
   folder a whole interval behind).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch._dynamo  # noqa: F401 (a first optimizer imports it, seconds: a warm spare pays now)
import torchft  # noqa: F401 (imported here so that a warm spare has paid for it)
from torch.utils.data import Dataset, default_collate

import ckpt
from trainer.data import ResumableSampler
from trainer.live.config import EXIT_QUORUM_LOST, LIVE_KEY_ENV, LiveConfig
from trainer.live.group import LocalGroup, is_sharded, local_tree, shard_like
from trainer.progress import JsonLines

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    np = None

log = logging.getLogger("trainer.live")


class QuorumLostError(RuntimeError):
    """The lighthouse did not answer within the retry window, or too few groups joined
    for ``quorum_timeout``: live recovery cannot go on; resume the job from ckpt."""


def step_seed(seed: int, group: int, step: int, rank: int = 0) -> int:
    """The 63-bit seed of the RNG streams of ``group``'s ``rank`` at ``step``."""
    digest = hashlib.blake2b(f"ckpt-live/{seed}/{group}/{rank}/{step}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def key_rng(seed: int, group: int, step: int, rank: int = 0) -> None:
    """Seed torch, NumPy and ``random`` for ``group``'s ``rank`` at ``step``."""
    s = step_seed(seed, group, step, rank)
    torch.manual_seed(s)
    random.seed(s)
    if np is not None:
        np.random.seed(s % 2 ** 32)


def state_digest(value: Any) -> str:
    """A SHA-256 of a (nested) state: tensors by dtype, shape and bytes; the rest by repr."""
    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if is_sharded(v):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"L{len(v)}".encode())
            for x in v:
                walk(x)
        else:
            h.update(repr(v).encode())

    walk(value)
    return h.hexdigest()[:16]


def rng_state() -> dict[str, Any]:
    """The streams :func:`key_rng` sets, as they are now."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if np is not None:
        out["numpy"] = np.random.get_state()
    return out


class LiveTrainer:
    """One rank's training loop of a replica group under torchft.

    Args:
        model_fn, optimizer_fn, dataset, step_fn, scheduler_fn: as for
            :class:`trainer.ElasticTrainer` (``step_fn(model, batch) -> mean loss``).
            With several ranks per group ``model_fn`` runs after the group's process
            group exists: a model it shards with FSDP2's ``fully_shard`` over the group's
            ranks (``init_device_mesh("cpu", (group_size,))``) trains sharded inside the
            group and replicated across groups (HSDP); a plain one is replicated (DDP).
        checkpoint_root: the job's checkpoint root; this group saves under ``group-<g>``.
        checkpoint_every: save every N committed steps.
        global_batch_size: samples per step, split evenly over the ranks of the quorum's
            groups: it must divide by ``group_size`` times every group count from
            ``min_replicas`` to ``replica_groups``.
        live: the :class:`LiveConfig` (default: from the ``CKPT_LIVE_*`` environment).
        seed: seeds the model (same weights in every group) and the RNG keys.
        key: the job's heal key (default: env ``CKPT_LIVE_KEY``, hex).
        record_dir: where ``group-<g>.jsonl`` records every start, heal, commit (with the
            step's global batch and this group's share: the audit) and failed step.
        digests: also record digests of the model, optimizer, RNG and data per commit.
        manager_options: more ``ckpt.CheckpointManager`` keywords (``memory_tier=``...).
    """

    def __init__(self, model_fn: Callable[[], torch.nn.Module],
                 optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                 dataset: Dataset, step_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                 checkpoint_root: str | os.PathLike, checkpoint_every: int,
                 global_batch_size: int, live: LiveConfig | None = None,
                 scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
                 seed: int = 0, key: bytes | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 record_dir: str | os.PathLike | None = None, digests: bool = False,
                 manager_options: dict[str, Any] | None = None) -> None:
        self.live = live = live or LiveConfig.from_env()
        for n in range(live.quorum_size, live.replica_groups + 1):
            if global_batch_size % (n * live.group_size):
                raise ValueError(f"global_batch_size {global_batch_size} does not split over "
                                 f"{n} replica groups of {live.group_size} ranks; it must "
                                 f"divide by {live.group_size} times every group count from "
                                 f"{live.quorum_size} to {live.replica_groups}")
        if key is None:
            # read once and dropped: child processes (data loader workers, tools) do
            # not inherit it
            raw = os.environ.pop(LIVE_KEY_ENV, "")
            try:
                key = bytes.fromhex(raw)
            except ValueError:
                raise ValueError(f"{LIVE_KEY_ENV} must be the job's key in hex, as the "
                                 f"supervisor makes it (secrets.token_hex(32)); it is not "
                                 f"hex") from None
        if not key:
            raise ValueError(f"live recovery needs the job's key: pass key= or set "
                             f"{LIVE_KEY_ENV} (the same in every group)")
        self.group, self.rank, self.seed = live.replica_group, live.group_rank, seed
        self.dataset, self.step_fn = dataset, step_fn
        self.collate_fn = collate_fn or default_collate
        self.global_batch_size = global_batch_size
        self.digests = digests
        self.local = LocalGroup(live, timedelta(seconds=live.timeout),
                                timedelta(seconds=live.start_timeout))
        torch.manual_seed(seed)
        self.model = model_fn()
        self.optimizer = optimizer_fn(self.model.parameters())
        self.scheduler = scheduler_fn(self.optimizer) if scheduler_fn else None
        self.sampler = ResumableSampler(len(dataset), seed=seed)
        self.sharded = any(is_sharded(p) for p in self.model.parameters())
        self.local.replicated = not self.sharded
        # FSDP2 state through torch's distributed state dict (names, shards, optimizer
        # state that exists before the first step): what ckpt saves and a heal carries
        self.train_state: Any = ckpt.ModelOptimizer(self.model, self.optimizer) \
            if self.sharded else None
        trained = {"train": self.train_state} if self.sharded else {
            "model": self.model, "optim": self.optimizer}
        self.state: dict[str, Any] = {**trained, "data": self.sampler,
                                      "rng": ckpt.RNGState(),
                                      "meta": {"step": 0, "batches_committed": 0}}
        if self.scheduler is not None:
            self.state["sched"] = self.scheduler
        options = {"keep_last": 3, **(manager_options or {})}
        self.checkpoints = ckpt.CheckpointManager(
            Path(checkpoint_root) / f"group-{self.group}", every_steps=checkpoint_every,
            **options)
        name = f"group-{self.group}" + (f"-rank-{self.rank}" if live.group_size > 1 else "")
        self.records = (JsonLines(Path(record_dir) / f"{name}.jsonl")
                        if record_dir is not None else None)
        self._healed = False
        self._joined = False
        self._key = key
        self.manager: Any = None  # started by fit, after the restore

    @property
    def meta(self) -> dict[str, Any]:
        """The committed step's metadata (``step``, ``batches_committed``), checkpointed."""
        return self.state["meta"]

    # -- torchft -----------------------------------------------------------------------------
    def _start_manager(self, key: bytes) -> Any:
        from torchft import Manager, ProcessGroupGloo

        from trainer.live.transport import KeyedHTTPTransport

        live = self.live
        timeout = timedelta(seconds=live.timeout)
        self.transport = KeyedHTTPTransport(live.host, key, timeout,
                                            max_bytes=self._heal_bound())
        return Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=live.quorum_size,
            load_state_dict=self._load_live, state_dict=self._live_state,
            use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=live.quorum_timeout), connect_timeout=timeout,
            rank=self.rank, world_size=live.group_size, store_addr=self.local.store_host,
            store_port=self.local.store_port,
            lighthouse_addr=f"http://{live.lighthouse}", replica_id=f"group{self.group}",
            hostname=live.host, heartbeat_interval=timedelta(seconds=live.heartbeat_interval),
            checkpoint_transport=self.transport, init_sync=False,
            quorum_retries=live.quorum_retries)

    def _heal_bound(self) -> int:
        """The most bytes a heal may carry: 8 times this rank's model (an Adam-like
        optimizer holds two more copies; serialization adds a little), plus 64 MiB."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        local = sum((t.to_local() if is_sharded(t) else t).nbytes for t in tensors)
        return 8 * local + (64 << 20)

    def _live_state(self) -> dict[str, Any]:
        """What a healing peer's rank of the same index receives: the state of the
        committed step replicated across groups (a sharded model: this rank's shards)."""
        if self.sharded:
            out = {"train": local_tree(self.train_state.state_dict())}
        else:
            out = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        out.update(data=self.sampler.state_dict(), meta=dict(self.meta))
        if self.scheduler is not None:
            out["sched"] = self.scheduler.state_dict()
        return out

    def _load_live(self, state: dict[str, Any]) -> None:
        if self.sharded:
            self.train_state.load_state_dict(
                shard_like(self.train_state.state_dict(), state["train"]))
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
        self.sampler.load_state_dict(state["data"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["sched"])
        self.state["meta"] = dict(state["meta"])
        self._healed = True

    # -- the loop ----------------------------------------------------------------------------
    def _record(self, event: str, **fields: Any) -> None:
        if self.records is not None:
            self.records.write({"event": event, "group": self.group, "group_rank": self.rank,
                                "pid": os.getpid(), "time": time.time(), **fields})

    def restore(self) -> int:
        """Load this group's newest good checkpoint (0: none), then start the manager at
        that step. In this order because the lighthouse holds each quorum (up to
        ``join_timeout``) for a group that heartbeats but has not asked yet: the
        manager's heartbeats start only once the group is ready to ask."""
        restored = self.checkpoints.restore(self.state) or 0
        self.manager = self._start_manager(self._key)
        self.manager.load_state_dict({"step": restored,
                                      "batches_committed": self.meta.get("batches_committed", 0)})
        return restored

    def fit(self, total_steps: int) -> int:
        """Train until ``total_steps`` committed steps; returns the last step.

        Raises:
            QuorumLostError: the quorum could not be formed within the retry window.
        """
        started = _process_start()
        restored = self.restore()
        self._record("start", restored=restored, started=started,
                     heal_port=self.transport.port)
        try:
            while self.manager.current_step() < self.last_step(total_steps):
                self.train_step()
        finally:
            self.checkpoints.wait()
        return self.manager.current_step()

    def last_step(self, total_steps: int) -> int:
        """The step to stop after (``total_steps``; a subclass may end the job sooner,
        at a step every group learns of before it gets there)."""
        return total_steps

    def train_step(self) -> bool:
        """One step: quorum (maybe a heal), forward/backward, gradient sync, commit."""
        first = not self._joined
        try:
            # A process's first quorum waits for the other groups to start (or for the
            # replacement's peers to answer); later ones for quorum_timeout.
            self.manager.start_quorum(timeout=timedelta(seconds=self.live.start_timeout)
                                      if first else None)
            self._joined = True
        except Exception as e:
            self._record("quorum_lost", step=self.manager.current_step(), error=str(e)[:300])
            raise QuorumLostError(f"no quorum: {e}") from e
        step = self.manager.current_step() + 1  # the step this one commits
        if self._healed:
            self._healed = False
            self._record("heal", step=step - 1, **self._digest_fields())
            # the peers saved this step at their commit if the schedule named it
            self._save(step - 1)
        participants = self.manager.num_participants()
        rank = self.manager.participating_rank()
        key_rng(self.seed, self.group, step, self.rank)
        before = self.sampler.state_dict()
        start = self._start_fields(before)
        batch = self.sampler.next_indices(self.global_batch_size)
        size = self.live.group_size
        mine = (ResumableSampler.rank_slice(batch, rank * size + self.rank, participants * size)
                if rank is not None else [])
        self.optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros(())
        if mine:
            loss = self.step_fn(self.model, self.collate_fn([self.dataset[i] for i in mine]))
            loss.backward()
        self.sync_gradients()
        try:
            committed = self.manager.should_commit()
        except Exception as e:  # our own manager server failed: nothing to commit with
            self._record("quorum_lost", step=step - 1, error=str(e)[:300])
            raise QuorumLostError(f"commit vote failed: {e}") from e
        if not committed:
            self.sampler.load_state_dict(before)  # the batch is trained again
            error = self.manager.errored()
            self._record("failed", step=step, participants=participants, indices=mine,
                         error=str(getattr(error, "original_exception", error))[:300])
            return False
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.meta.update(step=step, batches_committed=self.manager.batches_committed())
        self._record("commit", step=step, participants=participants, rank=rank,
                     batch=batch, indices=mine, loss=float(loss.detach()),
                     **self._digest_fields(), **start)
        self._save(step)
        return True

    def _save(self, step: int) -> None:
        """Save ``step`` if the schedule names it (every rank of the group calls it)."""
        if self.checkpoints.save(step, self.state) is not None:
            self._record("saved", step=step)

    def issue_allreduce(self, flat: torch.Tensor) -> Any:
        """Start the average of ``flat`` over the quorum (torchft's work handle)."""
        return self.manager.allreduce(flat)

    def sync_gradients(self) -> None:
        """Average the gradients over the group and the quorum (:meth:`LocalGroup.sync`);
        a failure (a peer lost inside the cross-group all-reduce) is reported to the
        manager, which then does not commit."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad.to_local() if is_sharded(p.grad) else p.grad for p in params]
        error = self.local.sync(grads, self.issue_allreduce)
        if error is not None:
            self.manager.report_error(error)

    def _digest_fields(self) -> dict[str, Any]:
        """Digests of the model and optimizer as they are now (``digests=True``)."""
        if not self.digests:
            return {}
        if self.sharded:
            train = self.train_state.state_dict()
            model, optim = train["model"], train["optim"]
        else:
            model, optim = self.model.state_dict(), self.optimizer.state_dict()
        return {"model": state_digest(model), "optim": state_digest(optim),
                "data_next": self.sampler.state_dict()}

    def _start_fields(self, data: dict[str, Any]) -> dict[str, Any]:
        """The RNG streams and data position a step starts from (``digests=True``)."""
        if not self.digests:
            return {}
        return {"rng": state_digest(rng_state()), "data": data}

    def close(self) -> None:
        """Finish the checkpoint in flight and stop the manager."""
        self.checkpoints.close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        self.local.close()
        if self.records is not None:
            self.records.close()


def _process_start() -> float:
    from trainer.launch import process_start_time

    return process_start_time()


def run(trainer: LiveTrainer, total_steps: int) -> None:
    """Train to ``total_steps`` and leave the process: status 0, or
    :data:`EXIT_QUORUM_LOST` when the quorum is lost (the supervisor then restarts the job,
    which resumes from ckpt). ``os._exit``: torchft's threads may block a clean exit."""
    code = 0
    try:
        trainer.fit(total_steps)
        trainer.close()
    except QuorumLostError as e:
        log.error("replica group %d: %s; exiting with status %d for a resume from the "
                  "newest checkpoint", trainer.group, e, EXIT_QUORUM_LOST)
        code = EXIT_QUORUM_LOST
    logging.shutdown()
    os._exit(code)


__all__ = ["LiveTrainer", "QuorumLostError", "key_rng", "rng_state", "run", "state_digest",
           "step_seed"]
