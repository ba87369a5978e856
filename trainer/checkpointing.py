"""The elastic trainer's checkpoints: which items they hold, and the manager that writes them.

Every checkpoint holds the RNG streams, the data position (the global sampler), the step's
metadata, the model and optimizer (through ``ckpt.ModelOptimizer`` with FSDP, so that any
world size can load them), the scheduler and grad scaler when there are any, and the
user's extra items (an EMA copy of the model, a counter: anything ``ckpt`` saves).

With a verified window (on by default with the health guard), a checkpoint whose following
steps the health guard judged healthy is marked verified (``CheckpointManager.mark_verified``,
by rank 0, once it is committed), and restores prefer the newest verified step. A stop
checkpoint (the end of ``fit``, a preemption, a straggler drop) has no steps after it: the
next attempt resumes from it all the same (:meth:`TrainerCheckpointer.stop_step`), and it
waits for its own window there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

import ckpt
import ckpt.inspect
from trainer.health import HealthGuard, HealthyWindow, Verdict
from trainer.metrics import format_event

log = logging.getLogger("trainer.elastic")
events = logging.getLogger("ckpt.trainer")

#: Restore levels (``CheckpointManager.restore``'s ``verify``).
VERIFY_LEVELS = ("structure", "digest", "forward")


#: ``CheckpointConfig.verified_window``'s default, in steps: more than 2, so that a fault
#: showing two steps after a save (a NaN, a spike) keeps that save unverified with a step of
#: margin; small, because a crash inside the newest save's window resumes from the verified
#: save before it (up to ``window + checkpoint_every`` steps recomputed, about ``window``
#: more than without a window on average).
DEFAULT_VERIFIED_WINDOW = 4


#: The manifest metadata key of a stop checkpoint, ``{"attempt": N, "reason": R}``: the
#: attempt that took it, and why (one of :data:`STOP_REASONS`).
STOP_KEY = "trainer_stop"
STOP_REASONS = ("finished", "preempted", "dropped")


#: Item names the trainer uses itself; extra items may not take them.
RESERVED_ITEMS = frozenset({"rng", "data", "meta", "model", "optim", "train", "sched",
                            "scaler"})


def checkpointed_items(*, sampler: Any, module: torch.nn.Module, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, scheduler: Any | None,
                       grad_scaler: torch.amp.GradScaler | None, fsdp: bool,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The items of every checkpoint (``"meta"``: the metadata of its step), then the
    user's ``extra`` items (ValueError for a name the trainer uses)."""
    items: dict[str, Any] = {"rng": ckpt.RNGState(), "data": sampler, "meta": {"step": 0}}
    if fsdp:
        items["train"] = ckpt.ModelOptimizer(model, optimizer)
    else:
        items["model"] = module
        items["optim"] = optimizer
    if scheduler is not None:
        items["sched"] = scheduler
    if grad_scaler is not None:
        items["scaler"] = grad_scaler
    extra = dict(extra or {})
    taken = sorted(RESERVED_ITEMS & extra.keys())
    if taken:
        raise ValueError(f"extra_state may not use the item names {taken}: the trainer "
                         f"saves its own items under {sorted(RESERVED_ITEMS)}; rename yours")
    return {**items, **extra}


def default_probe_inputs(batch: Any) -> Any:
    """The model's input in a collated batch: its first element for a tuple or list
    (``(inputs, targets, ...)``), else the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def make_probe(spec: bool | Callable[[Any], Any] | ckpt.Probe | None, module: torch.nn.Module,
               batch: Callable[[], Any], *, fsdp: bool) -> ckpt.Probe | None:
    """The probe recorded with every checkpoint (see the trainer's ``probe``), tried once on
    ``module`` now. ``batch()`` gives a fixed micro batch of the dataset.

    Raises ValueError when an explicitly given probe cannot run; the default one (``spec``
    True) is dropped with a warning instead.
    """
    if spec is None or spec is False:
        return None
    if fsdp:
        log.info("no probe recorded: the model is sharded (FSDP), the forward check would "
                 "need every rank; restores check digests")
        return None
    if isinstance(spec, ckpt.Probe):
        probe = spec
    else:
        fn = default_probe_inputs if spec is True else spec
        probe = ckpt.Probe(model_key="model", inputs=fn(batch()))
    try:
        probe.record({probe.model_key: module})
    except Exception as e:
        if spec is not True:
            raise ValueError(f"the probe cannot run through the model: {type(e).__name__}: "
                             f"{e}") from e
        log.warning("no probe recorded: the model refused the first element of a micro "
                    "batch (%s: %s); pass probe=lambda batch: <the model's inputs> to have "
                    "restores run the forward check", type(e).__name__, e)
        return None
    return probe


SHM_DIR = "/dev/shm"

_DEFAULT_COMMIT_TIMEOUT = ckpt.SaveOptions().commit_timeout


def memory_job_id(root: str | os.PathLike, run_id: str | None) -> str:
    """The job's name in memory segment names: torchrun's run id and a hash of the root, so
    that two jobs with one run id (``--rdzv-id``) never read each other's segments and a
    restarted worker of this job finds its own."""
    digest = hashlib.sha256(os.fspath(root).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.]+", "_", f"{run_id or 'local'}.{digest}")


def memory_tier_options(requested: bool | None, *, root: str | os.PathLike, elastic: bool,
                        options: ckpt.MemoryTierOptions | None = None) -> dict[str, Any]:
    """The ``CheckpointManager`` keywords that turn the memory tier on (empty: off).

    ``requested``: True (on), False (off) or None, the trainer's default: on when torchrun
    runs the job (``elastic``) and /dev/shm exists. ``options`` say how the tier works
    (``persist_every``, ``replicas``, ``keep``, ...); their ``job``, the name in segment
    names, defaults to :func:`memory_job_id`.
    """
    if requested is False or (requested is None
                              and not (elastic and os.path.isdir(SHM_DIR))):
        return {}
    options = options or ckpt.MemoryTierOptions()
    if options.job is None:
        options = dataclasses.replace(
            options, job=memory_job_id(root, os.environ.get("TORCHELASTIC_RUN_ID")))
    return {"memory_tier": options}


def incremental_saves(manager_options: Mapping[str, Any]) -> bool:
    """Whether ``CheckpointManager`` keywords ask for incremental saves (``options=
    ckpt.SaveOptions(incremental=True)`` or the ``incremental=True`` shorthand)."""
    options = manager_options.get("options")
    return bool(manager_options.get("incremental")
                or getattr(options, "incremental", False))


def manager_keywords(checkpoint: Any, *, root: str | os.PathLike,
                     elastic: bool) -> dict[str, Any]:
    """The ``CheckpointManager`` keywords of a ``trainer.CheckpointConfig``: the memory
    tier's (:func:`memory_tier_options`), then the user's ``manager_options``.

    The tier's default (on under torchrun) gives way to incremental saves that the options
    ask for: the tier cannot hold them (an incremental step references its base step's
    files in the root), and a job that runs in a plain process must run under torchrun
    too. The tier stays off then, and the log says why. (Asking for both is refused when
    the config is built.)"""
    requested = checkpoint.memory_tier
    if requested is None and incremental_saves(checkpoint.manager_options):
        if elastic:
            log.info("memory tier off: the checkpoint options ask for incremental saves, "
                     "which it cannot hold (its default is on under torchrun; drop "
                     "incremental=True to restore restarted workers from memory)")
        requested = False
    return {**memory_tier_options(requested, root=root, elastic=elastic,
                                  options=checkpoint.memory_options),
            **checkpoint.manager_options}


class TrainerCheckpointer:
    """The trainer's checkpointed state (``items`` plus the step's ``"meta"``) and the
    manager that saves it on the schedule and restores it.

    Args:
        root: the checkpoint root (any root ``ckpt.CheckpointManager`` takes).
        every: save every N steps.
        items: what each checkpoint holds (see :func:`checkpointed_items`); restored in
            place.
        collective_timeout: the commit vote's timeout (unless the ``ckpt.SaveOptions`` in
            ``options`` sets another).
        options: more ``CheckpointManager`` keywords (``keep_last`` defaults to 3; the
            memory tier's from :func:`memory_tier_options`).
        probe: recorded with every save (None: none).
        verify: what a step must pass to be restored (see :data:`VERIFY_LEVELS`); a step
            that fails is skipped for the one before it, on a resume and on a rollback.
        verified_window, guard: mark a checkpoint verified once ``verified_window`` steps
            after it were judged healthy by ``guard`` (see :class:`HealthyWindow`), and
            restore the newest verified step first; None for either: neither.
    """

    def __init__(self, root: str | os.PathLike, *, every: int, items: dict[str, Any],
                 collective_timeout: float, options: dict[str, Any],
                 probe: ckpt.Probe | None = None, verify: str = "digest",
                 verified_window: int | None = None,
                 guard: HealthGuard | None = None) -> None:
        self.state: dict[str, Any] = dict(items)
        self.state.setdefault("meta", {"step": 0})
        options = {"keep_last": 3, **options}
        self.manager_options = options
        self.verify = verify
        kwargs = dict(options)
        saving = kwargs.pop("options", None) or ckpt.SaveOptions()
        if saving.commit_timeout == _DEFAULT_COMMIT_TIMEOUT:  # not chosen by the user
            saving = dataclasses.replace(saving, commit_timeout=collective_timeout)
        # The trainer's own SIGTERM handling checkpoints the step every rank agreed on.
        self.manager = ckpt.CheckpointManager(
            root, every_steps=every, schedule=ckpt.Schedule(handle_sigterm=False),
            options=dataclasses.replace(saving, probe=probe), **kwargs)
        self.window = (HealthyWindow(verified_window, guard)
                       if verified_window is not None and guard is not None else None)
        self._handles: dict[int, Any] = {}  # saves awaiting their window: their handles
        self._confirmed: list[tuple[int, dict]] = []  # (step, evidence) not yet marked

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata of the step last saved or restored."""
        return self.state.get("meta") or {}

    def restore(self, stop: int | None = None) -> int | None:
        """Load the newest checkpoint that passes the ``verify`` level into the state (with
        a verified window: the newest verified one first, unless ``stop``, the newest step,
        is a stop checkpoint to resume from: see :meth:`stop_step`); its step (None: none).
        A restored step that is not verified yet waits for its window again (it is marked
        verified once the steps after it are healthy)."""
        if self.window is None:
            return self.manager.restore(self.state, verify=self.verify)
        self.manager.wait()
        self._mark_confirmed()  # before a rollback replaces the timeline they belong to
        restored = self.manager.restore(self.state, verify=self.verify,
                                        prefer="newest" if stop is not None else "verified")
        self.window.rewind(-1 if restored is None else restored)
        self._confirmed = [(s, e) for s, e in self._confirmed if restored is not None
                           and s <= restored]
        if restored is not None and not self._is_verified(restored):
            self.window.saved(restored)
        return restored

    def retire_after(self, step: int) -> list[int]:
        """After a rollback to ``step``: retire the committed steps after it, the old
        timeline's (a restore that preferred the verified ``step`` passed over them). Left
        in the root, the newest of them would pass for the job's newest state: a resume
        after a preemption of the new timeline would not find its stop checkpoint, and a
        plain load of the root would return weights the rollback undid. A verified step
        after ``step`` (one the restore skipped: it failed to load, reported, perhaps a
        storage fault) is never retired here. Call on one rank (rank 0: the root has one
        writer); returns the steps retired. A storage failure is logged and the steps
        stay (a later save of the same number replaces each one)."""
        try:
            verified = set(self.manager.verified_steps())
            newer = [s for s in self.manager.steps() if s > step and s not in verified]
            if newer:
                self.manager.retire(newer)
        except (OSError, ckpt.CheckpointError) as e:
            log.warning("retiring the steps after step %d (the timeline the rollback left) "
                        "failed: %s; they stay until saves of the same numbers replace them",
                        step, e)
            return []
        return newer

    def stop_step(self, attempt: int | None) -> int | None:
        """The newest committed step when a resume should take it although it is not
        verified: a stop checkpoint (:data:`STOP_KEY` in its manifest's metadata) that
        the previous attempt (``attempt - 1``) took, so the guard accepted every step up
        to it. Else None: the resume prefers the newest verified step. A stop checkpoint
        an attempt resumed from already (and then crashed inside its window) is not taken
        again. ``attempt`` None: the attempts are not numbered (no run directory, as for
        an object-store root by default), so a stop checkpoint is taken whichever attempt
        took it (one that crashed after resuming from it is not told apart then). Reads
        one manifest (rank 0 calls it and broadcasts the answer)."""
        if self.window is None:
            return None
        try:
            newest = self.manager.latest_step()
            if newest is None or self._is_verified(newest):
                return None
            recorded = ckpt.inspect.open(self.manager).manifest(newest).metadata.get(STOP_KEY)
        except (OSError, ckpt.CheckpointError) as e:
            log.info("cannot read whether the newest step is a stop checkpoint (%s): "
                     "resuming from the newest verified step", e)
            return None
        if recorded is None:
            return None
        if not (isinstance(recorded, dict) and recorded.get("reason") in STOP_REASONS
                and type(recorded.get("attempt")) is int):
            log.warning("step %d carries an invalid %r (%r): not taken as a stop checkpoint; "
                        "resuming from the newest verified step", newest, STOP_KEY, recorded)
            return None
        if attempt is None:
            log.info("step %d is a %s stop checkpoint: resuming from it (no run directory "
                     "numbers the attempts, so whether an attempt resumed from it already "
                     "and crashed cannot be told; set ObservabilityConfig.run_dir to a "
                     "directory every node shares for that)", newest, recorded["reason"])
            return newest
        if recorded["attempt"] != attempt - 1:
            log.info("step %d is the stop checkpoint of attempt %d, not of the previous one "
                     "(%d): resuming from the newest verified step", newest,
                     recorded["attempt"], attempt - 1)
            return None
        log.info("step %d is the %s stop checkpoint of attempt %d: resuming from it; it is "
                 "marked verified once the %d steps after it are healthy (a health rollback "
                 "before then goes to the newest verified step)", newest, recorded["reason"],
                 recorded["attempt"], self.window.steps)
        return newest

    def _is_verified(self, step: int) -> bool:
        """Whether ``step`` carries a valid verified marker (False when they cannot be
        read: it then waits for its window again, and marking it keeps its first marker)."""
        try:
            return step in self.manager.verified_steps()
        except (OSError, ckpt.CheckpointError) as e:
            log.info("cannot read the verified markers (%s): step %d waits for its window "
                     "again", e, step)
            return False

    def judged(self, verdict: Verdict) -> None:
        """The health guard's verdict on a step: count it in the windows of the saves
        before it; mark those it confirms verified once committed (rank 0)."""
        if self.window is None:
            return
        confirmed, dropped = self.window.observe(verdict)
        for step in dropped:
            self._handles.pop(step, None)
            events.warning(format_event("train.unverified", step=step, at_step=verdict.step,
                                        reason=verdict.reason if not verdict.ok
                                        else "grad_norm_over_limit"))
        self._confirmed += confirmed
        self._mark_confirmed()

    @property
    def memory_tier(self) -> bool:
        """Whether saves also go to the memory tier."""
        return bool(self.manager_options.get("memory_tier"))

    def restored_from(self) -> dict[str, Any]:
        """Where the last restore came from: ``tier`` ("memory", "peer" or "storage"),
        ``bytes_from_storage`` (read from the persistent root) and ``skipped_steps``, the
        steps it gave up on first, newest first (the reasons are in the manager's
        ``ckpt.restore`` log line and ``last_restore.skipped``); empty before one."""
        info = self.manager.last_restore
        if info is None:
            return {}
        skipped = list(dict.fromkeys(step for step, _, _ in info.skipped))
        return {"tier": info.tier, "bytes_from_storage": info.bytes_from_storage,
                "skipped_steps": skipped}

    def save(self, step: int, meta: dict[str, Any], *, force: bool = False,
             persist: bool | None = None, stop: str | None = None) -> Any:
        """Save ``step`` with ``meta`` if the schedule (or ``force``) says so; returns the
        manager's handle (None: not saved). A forced save (the trainer's first, final and
        preemption checkpoints) and one with ``persist=True`` or ``stop`` also go to the
        root when the memory tier is on, whatever ``persist_every`` says. ``stop`` (one of
        :data:`STOP_REASONS`): the attempt stops after this step, every step judged healthy
        so far; with a verified window it is recorded for :meth:`stop_step`."""
        self.state["meta"] = meta
        metadata = None
        if stop is not None and self.window is not None:
            metadata = {STOP_KEY: {"attempt": meta.get("attempt"), "reason": stop}}
        handle = self.manager.save(step, self.state, force=force, metadata=metadata,
                                   persist=True if force or persist or stop else None)
        if handle is not None and self.window is not None:
            self.window.saved(step)
            self._handles[step] = handle
        return handle

    def due(self, step: int) -> bool:
        """Whether :meth:`save` of ``step`` writes a checkpoint: the manager's step schedule
        (the same on every rank)."""
        return self.manager.save_due(step)

    def wait_previous(self, step: int) -> float:
        """Before the due save of ``step``: the manager's wait for the save in flight
        (``CheckpointManager.wait_for_save_in_flight``: counted once as backpressure, its
        error raised here, a ``ckpt.save_slow`` warning every 10 s of waiting), so that the
        loop marks that wait as its own section. Returns the seconds waited."""
        return self.manager.wait_for_save_in_flight(step)

    def _mark_confirmed(self) -> None:
        """Mark the confirmed saves verified whose writes are done (the others at a later
        call: training never waits for a write to mark one)."""
        waiting = []
        for step, evidence in self._confirmed:
            handle = self._handles.get(step)
            if handle is not None and not handle.done():
                waiting.append((step, evidence))
                continue
            self._handles.pop(step, None)
            if handle is not None and handle.failed():
                continue  # the save failed: nothing to verify (its error surfaces anyway)
            try:
                marked = self.manager.mark_verified(step, evidence)
            except ckpt.CheckpointNotFoundError:
                log.info("step %d was confirmed healthy but is not in the root (a save kept "
                         "in the memory tier only, or retired): not marked verified", step)
                continue
            except ckpt.StorageError as e:
                log.warning("marking step %d verified failed: %s", step, e)
                continue
            if marked is not None:
                events.info(format_event("train.verified", step=step,
                                         confirmed_at=evidence["confirmed_at"],
                                         window=evidence["window"]))
        self._confirmed = waiting

    def wait(self) -> None:
        """Until the save in flight is committed (and the confirmed saves are marked)."""
        self.manager.wait()
        self._mark_confirmed()

    def close(self, *, finished: bool = True) -> None:
        """Finish the save in flight and release the root. ``finished``: training ended
        (False after a preemption or an error: the memory tier keeps its segment for the
        restart)."""
        self.manager.close(finished=finished)


__all__ = ["DEFAULT_VERIFIED_WINDOW", "RESERVED_ITEMS", "STOP_KEY", "STOP_REASONS",
           "TrainerCheckpointer", "VERIFY_LEVELS",
           "checkpointed_items", "default_probe_inputs", "incremental_saves", "make_probe",
           "manager_keywords", "memory_job_id", "memory_tier_options"]
