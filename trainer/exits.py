"""How an elastic worker stops before the end, and with which exit status.

- a lost peer (the heartbeat watchdog) or a failed collective: the process group is
  unusable, so the worker records why and exits with :data:`EXIT_PEER_LOST`, and torchrun
  restarts the group;
- a hung rank (the watchdog found a training thread that stopped making progress while
  the others wait for it, :mod:`trainer.hangs`): every rank records the culprit, its
  section and its Python stack; the culprit itself exits with :data:`EXIT_HUNG` (it is
  dropped like a dead node: its agent starts a fresh worker in its place), the others with
  :data:`EXIT_PEER_LOST`;
- an error in our own code: exit status 1 under torchrun (a restart is used up), raised in
  a plain single process;
- SIGTERM (preemption, or torchrun restarting the workers because a node joined): all
  ranks checkpoint the same step, then exit with :data:`EXIT_PREEMPTED`.

:class:`ExitPolicy` takes these paths for :class:`trainer.elastic.ElasticTrainer`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainer.checkpointing import TrainerCheckpointer
from trainer.hangs import section_name
from trainer.health import TrainingHealthError
from trainer.heartbeat import Heartbeat, PeerLoss
from trainer.metrics import TrainerMetrics, format_event
from trainer.records import RunRecords

log = logging.getLogger("trainer.elastic")
events = logging.getLogger("ckpt.trainer")

#: Exit status of a worker that gave up on its process group (a peer was lost, a collective
#: failed or timed out): any non-zero status makes torchrun restart the group.
EXIT_PEER_LOST = 75
#: Exit status of a worker whose own training thread was found hung (any non-zero status
#: makes torchrun restart the group; this one says why).
EXIT_HUNG = 76
#: Exit status after a checkpoint taken on SIGTERM (128 + SIGTERM).
EXIT_PREEMPTED = 128 + signal.SIGTERM

_DIST_ERROR_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer",
                     "store", "broken pipe", "process group", "c10d")


def is_distributed_error(e: BaseException) -> bool:
    """Whether ``e`` says the process group broke (a peer died or hangs), not our code."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in _DIST_ERROR_WORDS)


def flush_streams() -> None:
    """Flush the log handlers and stdio: ``os._exit`` skips that."""
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class ExitPolicy:
    """How one attempt of :class:`trainer.elastic.ElasticTrainer` ends early: on SIGTERM,
    on a lost peer, on an error. It holds the SIGTERM flag (set by :meth:`on_sigterm`, the
    signal handler) and, once attached, the heartbeat and the checkpointer it needs.

    Args:
        records, metrics: where the end is written down.
        current_step: the last step finished (or restored), for the records.
        hard_exit: leave with ``os._exit`` (see the trainer's ``hard_exit``).
        elastic: whether a torchrun agent runs this process.
        collective_timeout: bounds the wait for a late SIGTERM after a preemption.
        diagnose_grace: seconds to wait for the heartbeat to name a lost peer.
    """

    def __init__(self, records: RunRecords, metrics: TrainerMetrics, *,
                 current_step: Callable[[], int], hard_exit: bool, elastic: bool,
                 collective_timeout: float, diagnose_grace: float = 0.0) -> None:
        self.records, self.metrics = records, metrics
        self.rank = records.rank
        self.world_size = records.world_size
        self._current_step = current_step
        self.hard_exit, self.elastic = hard_exit, elastic
        self.collective_timeout = collective_timeout
        self.diagnose_grace = diagnose_grace
        self.sigterm = False
        self.heartbeat: Heartbeat | None = None
        self.checkpointer: TrainerCheckpointer | None = None

    def attach(self, *, heartbeat: Heartbeat | None = None,
               checkpointer: TrainerCheckpointer | None = None) -> None:
        """The parts built after this one: the heartbeat to ask for a culprit and to stop,
        the checkpointer to save on SIGTERM and to close after an error."""
        if heartbeat is not None:
            self.heartbeat = heartbeat
        if checkpointer is not None:
            self.checkpointer = checkpointer

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler: checkpoint at the end of this step (see :meth:`preempted`)."""
        self.sigterm = True
        log.warning("rank %d: SIGTERM at step %d: checkpointing at the end of this step",
                    self.rank, self._current_step())

    def peer_lost(self, loss: PeerLoss) -> None:
        """Heartbeat watchdog verdict (watchdog thread): record it and leave."""
        self._give_up("hung rank" if loss.reason == "hang" else f"lost ranks ({loss.reason})",
                      loss, None)

    def _give_up(self, reason: str, loss: PeerLoss | None, error: BaseException | None) -> None:
        step = self._current_step()
        lost = loss.lost if loss else []
        hang = loss.hang if loss else None
        status = EXIT_HUNG if hang is not None and self.rank in lost else EXIT_PEER_LOST
        culprits = {} if hang is None else {r: hang.progress[r] for r in lost}
        events.error(format_event(
            "train.detect", rank=self.rank, step=step, reason=reason, lost=lost,
            last_steps=[loss.last_steps.get(r) for r in lost] if loss else [],
            error=f"{type(error).__name__}: {error}".splitlines()[0][:200] if error else None,
            exit_status=status))
        for r, p in culprits.items():
            events.error(format_event(
                "train.hang", rank=self.rank, culprit=r, section=section_name(p),
                age_s=round(p.age, 3), limit_s=p.limit, step=p.step,
                where=" | ".join(x.strip() for x in (p.stack or "").strip().splitlines()[-2:])
                or None))
            self.metrics.hang_detected(culprit=r, section=p.section)
            log.error("rank %d: rank %d hung in %s for %.1fs; its stack:\n%s", self.rank, r,
                      section_name(p), p.age, p.stack or "(not published)")
        log.error("rank %d: giving up on the process group at step %d: %s%s; exiting with "
                  "status %d so torchrun restarts the workers", self.rank, step, reason,
                  f" - {loss.describe()}" if loss else " - no peer identified as lost",
                  status)
        extra = {}
        if hang is not None:
            extra["hung"] = {str(r): {"section": p.section, "collectives": p.collectives,
                                      "age": round(p.age, 3), "limit": p.limit,
                                      "step": p.step, "stack": p.stack}
                             for r, p in culprits.items()}
            extra["waiting"] = {str(r): section_name(p) for r, p in hang.progress.items()
                                if r not in culprits}
        self.records.record(
            "failure", step=step, reason=reason, lost=lost,
            last_steps={str(k): v for k, v in (loss.last_steps if loss else {}).items()},
            last_seen={str(k): v for k, v in (loss.last_seen if loss else {}).items()},
            detail=(loss.detail if loss else "")
            + (f" {type(error).__name__}: {error}"[:500] if error else ""),
            detected_at=loss.detected_at if loss else None, **extra)
        with contextlib.suppress(Exception):
            self.metrics.write_textfile()
        flush_streams()
        os._exit(status)

    def _record_error(self, reason: str, e: BaseException) -> None:
        self.records.record("failure", step=self._current_step(), reason=reason, lost=[],
                            detail=f"{type(e).__name__}: {e}"[:500])

    def handle_error(self, e: BaseException) -> None:
        """``e`` ended the training: record it, then exit the process with the status that
        fits (see the module docstring), or return for the caller to raise it."""
        reason = "unhealthy" if isinstance(e, TrainingHealthError) else "error"
        if not self.hard_exit or isinstance(e, KeyboardInterrupt) and not self.elastic:
            self._record_error(reason, e)
            if self.world_size == 1:
                self._release()  # the root's lock: a retry in this process can open it
            return
        log.error("rank %d: step %d failed:\n%s", self.rank, self._current_step(),
                  traceback.format_exc())
        if not is_distributed_error(e):
            self._record_error(reason, e)
            flush_streams()
            os._exit(1)  # a bug, not a lost peer; torchrun still restarts (max-restarts)
        # Name a culprit only if the heartbeat already knows one: waiting for a peer to
        # miss beats would delay the restart by seconds. The summary later names the
        # ranks that left no record of their own (they died without a word).
        loss = None
        if self.heartbeat is not None:
            loss = self.heartbeat.diagnose(self.diagnose_grace)
        self._give_up("collective failed", loss, e)

    def _release(self) -> None:
        """After an error in a plain process: close the manager (finishing the save in
        flight, releasing the root's lock) and the record files; errors are ignored."""
        if self.checkpointer is not None:
            with contextlib.suppress(Exception):
                self.checkpointer.close(finished=False)
        self.records.close()
        with contextlib.suppress(Exception):
            self.metrics.write_textfile()

    def preempted(self, step: int, handle: Any,
                  committed: Callable[[Any], None] | None = None) -> None:
        """Every rank agreed that one of them got SIGTERM: checkpoint ``step`` (unless
        ``handle``, the save of it, is in flight) and leave. ``committed`` is called once
        the checkpoint is committed, with the handle of the save taken here (None when
        ``handle`` was the save)."""
        checkpointer = self.checkpointer
        assert checkpointer is not None
        if self.heartbeat is not None:
            self.heartbeat.stop(final_state="preempted")
        t0 = time.time()
        taken = None
        if handle is None:
            taken = checkpointer.save(step, checkpointer.meta, force=True, stop="preempted")
        checkpointer.wait()
        if committed is not None:
            committed(taken)
        log.warning("rank %d: preemption checkpoint of step %d committed in %.2fs; exiting "
                    "with status %d", self.rank, step, time.time() - t0, EXIT_PREEMPTED)
        self.records.record("preempted", step=step, signalled=self.sigterm,
                            seconds=time.time() - t0)
        events.warning(format_event("train.preempted", rank=self.rank, step=step,
                                    signalled=self.sigterm, seconds=round(time.time() - t0, 3),
                                    exit_status=EXIT_PREEMPTED))
        self.metrics.write_textfile()
        # A rank whose agent has not signalled it yet waits a little for its SIGTERM: an exit
        # before it would count as a failure (a restart used up) instead of a membership change.
        deadline = time.time() + min(10.0, self.collective_timeout)
        while self.elastic and not self.sigterm and time.time() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(Exception):
            checkpointer.close(finished=False)
        flush_streams()
        if self.hard_exit:
            os._exit(EXIT_PREEMPTED)
        raise SystemExit(EXIT_PREEMPTED)


__all__ = ["EXIT_HUNG", "EXIT_PEER_LOST", "EXIT_PREEMPTED", "ExitPolicy", "flush_streams",
           "is_distributed_error"]
