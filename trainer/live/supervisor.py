"""Run a live job on one machine: the lighthouse and the processes of each replica group
(``group_size`` ranks each), all bound to the job's address, with the supervision live
recovery needs.

- a group that loses a rank (any status but 0 and :data:`EXIT_QUORUM_LOST`) is lost as a
  whole: its other ranks are stopped and the group is started again, with a store of its
  own, as a replacement that heals from a peer while the others train on;
- a lighthouse that dies is started again at once at the same address (the groups'
  quorum retries cover the gap);
- a group that exits with :data:`EXIT_QUORUM_LOST` means live recovery gave up (a
  majority lost for ``quorum_timeout``, or the lighthouse for the retry window): every
  group is stopped and the job starts again, resuming from ckpt's newest good step;
- the job is done when every group has exited with status 0.

``mode="restart"`` handles every lost group like a lost quorum (the restart path of
torchrun-style jobs, for comparison); ``spares=N`` keeps N processes that have paid their
imports and wait for a group number on stdin (:data:`trainer.live.config.SPARE_ENV`), so
a replacement or a restart starts without importing torch (warm).

On a cluster the same roles fall to the scheduler: one lighthouse per job (restarted by
the scheduler at the same address), one torchrun or task per replica group with restarts.

``python -m trainer.live.supervisor --groups 3 --run-dir D -- python train.py ...``; it
writes ``supervisor.jsonl`` in the run directory (every start, loss, replacement and
restart, with pids and times). No torch import here.

A rank whose group lost another rank may itself exit with :data:`EXIT_QUORUM_LOST` (its
group's manager, in rank 0, is gone): a group's status 76 counts as a lost quorum only
when no rank of the group died otherwise (the supervisor waits for every rank of the
group to exit, up to ``heartbeat_timeout``, before it decides).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainer.live.config import (EXIT_QUORUM_LOST, LIVE_KEY_ENV, SPARE_ENV, LiveConfig,
                                 assignment)
from trainer.progress import JsonLines


def free_port(host: str) -> int:
    """A port free on ``host`` now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LighthouseError(RuntimeError):
    """The lighthouse could not listen on the job's address and port."""


@dataclasses.dataclass
class LiveJob:
    """The lighthouse and ``config.replica_groups`` groups of ``config.group_size``
    processes of ``command``.

    Args:
        command: a rank's command line (it builds a :class:`trainer.live.LiveTrainer`
            with ``LiveConfig.from_env()``); each process gets ``CKPT_LIVE_GROUP``,
            ``CKPT_LIVE_GROUP_RANK``, its group's store (``CKPT_LIVE_GROUP_STORE``) and the
            job's ``CKPT_LIVE_*`` settings and key in its environment.
        config: the job's settings (``replica_group``, ``group_rank`` and
            ``group_store`` are ignored; ``lighthouse``'s port 0 picks a free one).
        run_dir: where ``supervisor.jsonl`` goes.
        respawn_delay: seconds before a lost group is started again (a node's
            replacement time; 0 on one machine).
        max_restarts: whole-job restarts allowed after :data:`EXIT_QUORUM_LOST`; also
            how many times in a row a group may fail with the same error status (a
            failure replacing does not cure) before the job gives up.
        mode: ``"live"`` (replace a lost group) or ``"restart"`` (restart the job).
        spares: processes kept warm (imports done) to become ranks of replacements or
            restarted groups (``group_size`` of them make a whole group warm).
    """

    command: list[str]
    config: LiveConfig
    run_dir: Path
    respawn_delay: float = 0.0
    max_restarts: int = 3
    mode: str = "live"
    spares: int = 0

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        host, port = self.config.lighthouse.rsplit(":", 1)
        if int(port) == 0:
            self.config = dataclasses.replace(self.config,
                                              lighthouse=f"{host}:{free_port(host)}")
        self.key = secrets.token_hex(32)
        self.events = JsonLines(self.run_dir / "supervisor.jsonl")
        self.groups: dict[int, list[subprocess.Popen]] = {}
        self.started: dict[int, float] = {}  # group -> when its processes started
        self.failures: dict[int, tuple[int, int]] = {}  # group -> (status, times in a row)
        self.lighthouse: subprocess.Popen | None = None
        self.restarts = 0
        self.pool: list[subprocess.Popen] = []  # the warm spares
        if self.mode not in ("live", "restart"):
            raise ValueError(f"mode must be 'live' or 'restart', not {self.mode!r}")

    def _event(self, event: str, **fields: object) -> None:
        self.events.write({"event": event, "time": time.time(), **fields})

    def start_lighthouse(self) -> None:
        """Start the lighthouse and wait until it says it listens (a byte on a pipe of
        ours, written once bound: a connect could reach someone else's socket on the port,
        and a file could be planted by another user).

        Raises:
            LighthouseError: it exited without listening (the port taken: by another
                process, or another user), three times in a row.
        """
        c = self.config
        for attempt in range(3):
            read_end, write_end = os.pipe()
            try:
                self.lighthouse = subprocess.Popen(
                    [sys.executable, "-m", "trainer.live.lighthouse", "--bind", c.lighthouse,
                     "--min-replicas", str(c.quorum_size),
                     "--heartbeat-timeout", str(c.heartbeat_timeout),
                     "--join-timeout", str(c.join_timeout), "--ready-fd", str(write_end)],
                    pass_fds=(write_end,))
            finally:
                os.close(write_end)
            try:
                # a byte once bound; end of file (b"") when it exits without binding
                ready, _, _ = select.select([read_end], [], [], 30.0)
                said = os.read(read_end, 1) if ready else b""
            finally:
                os.close(read_end)
            up = said == b"1" and self.lighthouse.poll() is None
            self._event("lighthouse", pid=self.lighthouse.pid, listening=up)
            if up:
                return
            if self.lighthouse.poll() is None:
                self.lighthouse.kill()
            self.lighthouse.wait()
            time.sleep(0.5 * (attempt + 1))  # a port freed a moment later
        raise LighthouseError(f"the lighthouse could not listen on {c.lighthouse} (3 tries; "
                              f"the port is taken?): pass a free --lighthouse-port, or 0")

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.config.to_env(), LIVE_KEY_ENV: self.key}

    def fill_spares(self) -> None:
        """Keep ``spares`` warm processes."""
        self.pool = [p for p in self.pool if p.poll() is None]
        while len(self.pool) < self.spares:
            self.pool.append(subprocess.Popen(self.command, env={**self._env(),
                                                SPARE_ENV: "1"}, stdin=subprocess.PIPE,
                                                text=True))

    def start_group(self, group: int, why: str) -> None:
        """Start ``group``'s ranks (from warm spares when there are, except at the job's
        start), with a fresh store address: a replacement never meets its predecessor's
        keys."""
        size = self.config.group_size
        host = self.config.host
        store = f"{host}:{free_port(host)}" if size > 1 else None
        procs = []
        for rank in range(size):
            spare = next((p for p in self.pool if p.poll() is None), None)
            if spare is not None and why != "start":
                self.pool.remove(spare)
                assert spare.stdin is not None
                try:
                    spare.stdin.write(assignment(group, rank, store))
                    spare.stdin.flush()
                except OSError:  # the spare died since the poll: start a fresh one
                    spare.kill()
                    spare.wait()
                    spare = None
            if spare is not None and why != "start":
                proc = spare
            else:
                env = {**self._env(), "CKPT_LIVE_GROUP": str(group),
                       "CKPT_LIVE_GROUP_RANK": str(rank)}
                if store is not None:
                    env["CKPT_LIVE_GROUP_STORE"] = store
                proc = subprocess.Popen(self.command, env=env)
            procs.append(proc)
            self._event("group", group=group, rank=rank, pid=proc.pid, why=why,
                        warm=proc is spare)
        self.groups[group] = procs
        self.started[group] = time.monotonic()

    def stop_groups(self) -> None:
        for procs in self.groups.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        for procs in self.groups.values():
            for proc in procs:
                proc.wait()

    def _group_status(self, group: int) -> int | None:
        """None while ``group`` runs; else its outcome: 0 (every rank finished),
        :data:`EXIT_QUORUM_LOST` (its ranks gave up on the quorum) or the first other
        status of a rank (the group is lost; its other ranks are stopped)."""
        procs = self.groups[group]
        codes = [p.poll() for p in procs]
        if all(c is None for c in codes):
            return None
        if EXIT_QUORUM_LOST in codes and None in codes:
            # a rank whose group lost a peer rank gives up on the quorum too: the other
            # ranks' statuses say which it was (a lost quorum: they all give up). The
            # supervision waits here (at most a heartbeat timeout, only in this case).
            deadline = time.monotonic() + self.config.heartbeat_timeout
            while None in codes and time.monotonic() < deadline and \
                    all(c in (None, 0, EXIT_QUORUM_LOST) for c in codes):
                time.sleep(0.01)
                codes = [p.poll() for p in procs]
        lost = [c for c in codes if c not in (None, 0, EXIT_QUORUM_LOST)]
        if not lost and EXIT_QUORUM_LOST not in codes:
            return 0 if None not in codes else None  # ranks finishing one after another
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        return lost[0] if lost else EXIT_QUORUM_LOST

    def run(self, timeout: float = 3600.0) -> int:
        """Supervise until every group finished (0), the restarts are used up, a group
        fails the same way ``max_restarts + 1`` times in a row, or ``timeout`` passed
        (1)."""
        pending: dict[int, float] = {}  # group -> when to start its replacement
        finished = False  # a group reached the last step: the job's training is done
        lost_after_done: list[int] = []
        deadline = time.monotonic() + timeout
        try:
            # inside the try: whatever started is stopped if a start fails
            self.start_lighthouse()
            for g in range(self.config.replica_groups):
                self.start_group(g, "start")
            self.fill_spares()
            while time.monotonic() < deadline:
                if self.lighthouse is not None and self.lighthouse.poll() is not None:
                    self._event("lighthouse_lost", rc=self.lighthouse.returncode)
                    try:
                        self.start_lighthouse()
                    except LighthouseError as e:
                        self._event("gave_up", reason=str(e))
                        return 1
                for g, procs in list(self.groups.items()):
                    rc = self._group_status(g)
                    if rc is None:
                        continue
                    pids = [p.pid for p in procs]
                    self.groups.pop(g)
                    started = self.started.pop(g, time.monotonic())
                    if rc == 0:
                        self._event("group_done", group=g, pid=pids[0], pids=pids)
                        finished = True
                    elif rc == EXIT_QUORUM_LOST:
                        return_code = self._restart_job(g)
                        if return_code is not None:
                            return return_code
                        pending.clear()
                        break
                    else:
                        self._event("group_lost", group=g, pid=pids[0], pids=pids, rc=rc,
                                    rcs=[p.returncode for p in procs])
                        if finished:
                            # the training is over: the groups that finished hold the
                            # final state; the loss is only reported
                            lost_after_done.append(g)
                            continue
                        if self._same_failure_again(g, rc, time.monotonic() - started):
                            return 1
                            return_code = self._restart_job(g)
                            if return_code is not None:
                                return return_code
                            pending.clear()
                            break
                        pending[g] = time.monotonic() + self.respawn_delay
                for g, when in list(pending.items()):
                    if time.monotonic() >= when:
                        pending.pop(g)
                        self.start_group(g, "replacement")
                self.fill_spares()
                if not self.groups and not pending:
                    self._event("done", restarts=self.restarts, lost_after_done=lost_after_done)
                    return 0
                time.sleep(0.01)
            self._event("timeout")
            return 1
        finally:
            self.stop_groups()
            for spare in self.pool:
                spare.kill()
                spare.wait()
            if self.lighthouse is not None and self.lighthouse.poll() is None:
                self.lighthouse.terminate()
                self.lighthouse.wait()

    def _same_failure_again(self, group: int, rc: int, ran: float) -> bool:
        """Count ``group``'s loss; True (the job gives up) when its processes exited by
        themselves with the same error status ``max_restarts + 1`` times in a row, each
        within 10 minutes of their start: a failure that replacing does not cure (a bug,
        a bad input). Losses by a signal (a killed node) reset the count."""
        if rc < 0 or ran > 600:
            self.failures.pop(group, None)
            return False
        last, count = self.failures.get(group, (rc, 0))
        count = count + 1 if last == rc else 1
        self.failures[group] = (rc, count)
        if count <= self.max_restarts:
            return False
        self._event("gave_up", group=group, rc=rc, failures=count,
                    reason=f"group {group} failed with status {rc} {count} times in a row: "
                           f"the same failure repeats; see the group's log")
        return True

    def _restart_job(self, group: int) -> int | None:
        """Live recovery gave up: stop every group and start the job again from ckpt."""
        self._event("restart" if self.mode == "restart" else "quorum_lost", group=group)
        self.stop_groups()
        if self.restarts >= self.max_restarts:
            self._event("gave_up", restarts=self.restarts)
            return 1
        self.restarts += 1
        # The lighthouse counts a stopped group's pending quorum request until its
        # heartbeat expires: a group started sooner (a warm spare, in milliseconds) can be
        # put in a quorum with it and wait out a gloo rendezvous with a dead peer.
        time.sleep(self.config.heartbeat_timeout + 0.5)
        for g in range(self.config.replica_groups):
            self.start_group(g, "restart")
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.live.supervisor")
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--group-size", type=int, default=1,
                   help="processes per replica group (a local gloo process group)")
    p.add_argument("--host", default="127.0.0.1", help="the job's address")
    p.add_argument("--lighthouse-port", type=int, default=0)
    p.add_argument("--min-replicas", type=int, default=None)
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--quorum-retries", type=int, default=3)
    p.add_argument("--join-timeout", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--start-timeout", type=float, default=60.0,
                   help="seconds a process's first quorum may take")
    p.add_argument("--respawn-delay", type=float, default=0.0)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--mode", choices=("live", "restart"), default="live")
    p.add_argument("--spares", type=int, default=0,
                   help="processes kept warm to start groups from")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--job-timeout", type=float, default=3600.0)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the group's command after --")
    config = LiveConfig(lighthouse=f"{a.host}:{a.lighthouse_port}", host=a.host,
                        replica_groups=a.groups, group_size=a.group_size,
                        min_replicas=a.min_replicas,
                        heartbeat_timeout=a.heartbeat_timeout,
                        quorum_timeout=a.quorum_timeout, quorum_retries=a.quorum_retries,
                        join_timeout=a.join_timeout, timeout=a.timeout,
                        start_timeout=a.start_timeout)
    job = LiveJob(command, config, Path(a.run_dir), respawn_delay=a.respawn_delay,
                  max_restarts=a.max_restarts, mode=a.mode, spares=a.spares)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return job.run(a.job_timeout)
    except LighthouseError as e:
        print(f"supervisor: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
