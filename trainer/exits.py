"""How an elastic worker stops before the end, and with which exit status.

- a lost peer (the heartbeat watchdog) or a failed collective: the process group is
  unusable, so the worker records why and exits with :data:`EXIT_PEER_LOST`, and torchrun
  restarts the group;
- an error in our own code: exit status 1 under torchrun (a restart is used up), raised in
  a plain single process;
- SIGTERM (preemption, or torchrun restarting the workers because a node joined): all
  ranks checkpoint the same step, then exit with :data:`EXIT_PREEMPTED`.

:class:`WorkerExits` holds these paths for :class:`trainer.elastic.ElasticTrainer`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch.distributed as dist

from trainer.health import TrainingHealthError
from trainer.heartbeat import PeerLoss
from trainer.metrics import format_event

log = logging.getLogger("trainer.elastic")
events = logging.getLogger("ckpt.trainer")

#: Exit status of a worker that gave up on its process group (a peer was lost, a collective
#: failed or timed out): any non-zero status makes torchrun restart the group.
EXIT_PEER_LOST = 75
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


class WorkerExits:
    """The early ends of :class:`trainer.elastic.ElasticTrainer` (a mixin: it uses the
    trainer's rank, step, heartbeat, manager, state, metrics and records)."""

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True
        log.warning("rank %d: SIGTERM at step %d: checkpointing at the end of this step",
                    self.rank, self._step)

    def _peer_lost(self, loss: PeerLoss) -> None:
        """Heartbeat watchdog verdict (watchdog thread): record it and leave."""
        self._give_up(f"lost ranks ({loss.reason})", loss, None)

    def _give_up(self, reason: str, loss: PeerLoss | None, error: BaseException | None) -> None:
        lost = loss.lost if loss else []
        events.error(format_event(
            "train.detect", rank=self.rank, step=self._step, reason=reason, lost=lost,
            last_steps=[loss.last_steps.get(r) for r in lost] if loss else [],
            error=f"{type(error).__name__}: {error}".splitlines()[0][:200] if error else None,
            exit_status=EXIT_PEER_LOST))
        log.error("rank %d: giving up on the process group at step %d: %s%s; exiting with "
                  "status %d so torchrun restarts the workers", self.rank, self._step, reason,
                  f" - {loss.describe()}" if loss else " - no peer identified as lost",
                  EXIT_PEER_LOST)
        self._record("failure", step=self._step, reason=reason, lost=lost,
                     last_steps={str(k): v for k, v in (loss.last_steps if loss else {}).items()},
                     last_seen={str(k): v for k, v in (loss.last_seen if loss else {}).items()},
                     detail=(loss.detail if loss else "")
                     + (f" {type(error).__name__}: {error}"[:500] if error else ""))
        flush_streams()
        os._exit(EXIT_PEER_LOST)

    def _record_error(self, reason: str, e: BaseException) -> None:
        self._record("failure", step=self._step, reason=reason, lost=[],
                     detail=f"{type(e).__name__}: {e}"[:500])

    def _handle_error(self, e: BaseException) -> None:
        """``e`` ended the training: record it, then exit the process with the status that
        fits (see the module docstring), or return for the caller to raise it."""
        reason = "unhealthy" if isinstance(e, TrainingHealthError) else "error"
        if not self.hard_exit or isinstance(e, KeyboardInterrupt) and not self.elastic:
            self._record_error(reason, e)
            if self.world_size == 1:
                self._release()  # the root's lock: a retry in this process can open it
            return
        log.error("rank %d: step %d failed:\n%s", self.rank, self._step,
                  traceback.format_exc())
        if not is_distributed_error(e):
            self._record_error(reason, e)
            flush_streams()
            os._exit(1)  # a bug, not a lost peer; torchrun still restarts (max-restarts)
        # Name a culprit only if the heartbeat already knows one: waiting for a peer to
        # miss beats would delay the restart by seconds. The summary later names the
        # ranks that left no record of their own (they died without a word).
        loss = None
        if self._heartbeat is not None:
            loss = self._heartbeat.diagnose(self.diagnose_grace)
        self._give_up("collective failed", loss, e)

    def _release(self) -> None:
        """After an error in a plain process: close the manager (finishing the save in
        flight, releasing the root's lock) and the record files; errors are ignored."""
        if self._manager is not None:
            with contextlib.suppress(Exception):
                self._manager.close()
        self._close_records()
        with contextlib.suppress(Exception):
            self.metrics.write_textfile()

    def _preempted(self, step: int, handle: Any) -> None:
        """Every rank agreed that one of them got SIGTERM: checkpoint this step and leave."""
        mgr = self._manager
        assert mgr is not None
        if self._heartbeat is not None:
            self._heartbeat.stop(final_state="preempted")
        t0 = time.time()
        if handle is None:
            mgr.save(step, self.state, force=True)
        mgr.wait()
        log.warning("rank %d: preemption checkpoint of step %d committed in %.2fs; exiting "
                    "with status %d", self.rank, step, time.time() - t0, EXIT_PREEMPTED)
        self._record("preempted", step=step, signalled=self._sigterm, seconds=time.time() - t0)
        events.warning(format_event("train.preempted", rank=self.rank, step=step,
                                    signalled=self._sigterm, seconds=round(time.time() - t0, 3),
                                    exit_status=EXIT_PREEMPTED))
        self.metrics.write_textfile()
        # A rank whose agent has not signalled it yet waits a little for its SIGTERM: an exit
        # before it would count as a failure (a restart used up) instead of a membership change.
        deadline = time.time() + min(10.0, self.collective_timeout)
        while self.elastic and not self._sigterm and time.time() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(Exception):
            mgr.close()
        flush_streams()
        if self.hard_exit:
            os._exit(EXIT_PREEMPTED)
        raise SystemExit(EXIT_PREEMPTED)


__all__ = ["EXIT_PEER_LOST", "EXIT_PREEMPTED", "WorkerExits", "flush_streams",
           "is_distributed_error"]
