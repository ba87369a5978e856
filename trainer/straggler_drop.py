"""How a rank dropped as a straggler leaves the job, and how the others leave.

Every rank decided at the same step (:class:`trainer.stragglers.StragglerWatch`) that one
rank is dropped. All of them checkpoint that step together, so the job resumes where it
stood. The straggler then asks its torchrun agent to stop: the agent stops its workers and
leaves the rendezvous without closing it, as a node that dies does, so torchrun restarts
the others without that node. See docs/elastic.md, "Stragglers".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

import torch.distributed as dist

from trainer.exits import EXIT_PEER_LOST, flush_streams
from trainer.launch import warm_start
from trainer.metrics import format_event

#: One ``event key=value ...`` line per event (docs/observability.md lists them).
events = logging.getLogger("ckpt.trainer")

#: Exit status of a worker dropped as a straggler (after it asked its torchrun agent to stop).
EXIT_DROPPED = 77


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def torchrun_agent() -> int | None:
    """The pid of the torchrun agent that started this worker, None if there is none (no
    ``TORCHELASTIC_RUN_ID``, or an ancestor that is another program).

    The agent is the worker's parent, or, for a worker forked by a zygote of
    :mod:`trainer.warm`, the parent of the launcher that torchrun started in its place;
    past any process between the agent and the worker (an entrypoint script, which the
    agent started with the workers' environment: :func:`_started_by_agent`)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    parent: int | None = os.getppid()
    launcher = warm_start().get("launcher")
    if launcher is not None:
        parent = _parent_of(launcher)
    for _ in range(MAX_WRAPPERS + 1):
        if parent is None or parent <= 1:
            return None
        if not _started_by_agent(parent, run_id):
            break
        parent = _parent_of(parent)
    else:
        return None
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    return parent if any("torchrun" in a or "torch.distributed.run" in a for a in argv) \
        else None


#: Processes between the agent and a worker that :func:`torchrun_agent` looks past.
MAX_WRAPPERS = 4


def _started_by_agent(pid: int, run_id: str) -> bool:
    """Whether ``pid`` began with this run's ``TORCHELASTIC_RUN_ID``: torchrun puts it in
    its workers' environment only, so such a process is a worker or a wrapper the agent
    started (``bash train.sh``, a ``python torchrun_job.py``), never the agent, even when
    its command line mentions torchrun: it must not receive the agent's SIGTERM."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"TORCHELASTIC_RUN_ID={run_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def leave_for_drop(exits: Any, straggler: int, step: int, handle: Any, *, score: float,
                   windows: int, section: str | None) -> None:
    """Every rank decided at ``step`` that rank ``straggler`` is dropped; this rank leaves.

    All ranks first checkpoint ``step`` together (unless ``handle``, its save, is in
    flight), so the job resumes where it stood. The straggler then records ``dropped`` and
    asks its torchrun agent to stop (SIGTERM: the agent stops its workers and leaves the
    rendezvous without closing it, as a node that dies), so the restarted job runs without
    that node; the others record a ``failure`` naming it and exit with ``EXIT_PEER_LOST``
    for torchrun to restart them. ``exits`` is the attempt's
    :class:`trainer.exits.ExitPolicy` (its records, metrics, heartbeat and checkpointer).
    """
    rank = exits.rank
    if exits.heartbeat is not None:  # peers stop watching: our silence is no failure now
        exits.heartbeat.stop(final_state="dropped")
    checkpointer = exits.checkpointer
    if checkpointer is not None:
        if handle is None:
            checkpointer.save(step, checkpointer.meta, force=True, stop="dropped")
        checkpointer.wait()
    # Nobody leaves before every rank has its save's outcome: rank 0 hosts the job's store,
    # and a peer still reading the commit from it would fail the save and exit with an error.
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer gone already: leave all the same
            dist.barrier()
    detail = (f"rank {straggler} was {score:.2f}x the median of the ranks in its own work "
              f"for {windows} window(s) (slowest in {section})")
    if rank == straggler:
        agent = torchrun_agent()
        exits.records.record("dropped", step=step, reason="straggler", score=score,
                             windows=windows, section=section, agent=agent)
        events.warning(format_event("train.dropped", rank=rank, step=step, reason="straggler",
                                    score=round(score, 3), windows=windows, section=section,
                                    agent=agent, exit_status=EXIT_DROPPED))
        with contextlib.suppress(Exception):
            exits.metrics.write_textfile()
        flush_streams()
        if agent is not None:
            os.kill(agent, signal.SIGTERM)
            # The agent stops its workers with SIGTERM (caught by the trainer's handler):
            # leaving before that could make it restart this worker instead of stopping.
            deadline = time.monotonic() + 10.0
            while not exits.sigterm and time.monotonic() < deadline:
                time.sleep(0.05)
        os._exit(EXIT_DROPPED)
    events.error(format_event("train.detect", rank=rank, step=step, reason="straggler",
                              lost=[straggler], last_steps=[step], error=None,
                              exit_status=EXIT_PEER_LOST))
    exits.records.record("failure", step=step, reason="straggler", lost=[straggler],
                         last_steps={str(straggler): step}, last_seen={}, detail=detail)
    with contextlib.suppress(Exception):
        exits.metrics.write_textfile()
    flush_streams()
    os._exit(EXIT_PEER_LOST)


__all__ = ["EXIT_DROPPED", "leave_for_drop", "torchrun_agent"]
