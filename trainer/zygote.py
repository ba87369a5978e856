"""The zygote of warm restarts (see :mod:`trainer.warm`): a process per node and torchrun
agent that has imported torch and the trainer once and forks each worker from that state.

    python -u -m trainer.zygote --socket PATH --agent-pid PID --agent-start TICKS \\
        [--preload MOD,...] [--no-default-preload] [--idle SECONDS]

Started by :mod:`trainer.warm`'s launcher. It imports the modules a worker needs (torch,
torch.distributed, torch._dynamo, which DDP and the first optimizer import, ckpt and the
trainer, then ``--preload``), but initializes no device and starts no thread, so that
``fork`` is safe; then it listens on its unix socket. Each request comes from a launcher
(this user's process whose parent is the agent; others are refused) with the command
line, the working directory, the environment and the launcher's stdin/stdout/stderr. The
zygote forks a child that takes them on and runs the script as ``__main__``; it reports the
child's pid and, when the child ends, its exit status to the launcher. If the launcher's
connection closes first (the launcher was killed), the child's process group is SIGKILLed;
if the zygote dies, its children die with it (``PR_SET_PDEATHSIG``). The zygote exits when
its agent exits, after ``--idle`` seconds without children, or on SIGTERM, and removes its
socket then.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from typing import Any

from trainer.warm import (LAUNCHER_ENV, MAX_MESSAGE, ZYGOTE_ENV, Target, peer_credentials,
                          proc_stat, run_target, send_message)

#: What a worker of the trainer imports before its first step: torch._dynamo (DDP's
#: constructor and the first optimizer import it; seconds on a small CPU) above all.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                   "torch.optim", "numpy", "ckpt", "trainer.elastic")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} zygote[{os.getpid()}]: {msg}", file=sys.stderr,
          flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.zygote")
    p.add_argument("--socket", required=True)
    p.add_argument("--agent-pid", type=int, required=True)
    p.add_argument("--agent-start", required=True,
                   help="the agent's start time in clock ticks (/proc/PID/stat)")
    p.add_argument("--preload", default="", help="more modules to import, comma-separated")
    p.add_argument("--no-default-preload", action="store_true")
    p.add_argument("--idle", type=float, default=3600.0)
    return p.parse_args(argv)


def preload(modules: list[str], required: list[str]) -> None:
    """Import ``modules`` (those of ``required`` must import; the others may be missing)."""
    for name in modules:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
        except ImportError as e:
            if name in required:
                raise
            log(f"preload {name}: skipped ({e})")
            continue
        log(f"preload {name}: {time.perf_counter() - t0:.2f}s")
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:  # a fork would copy their locks in whatever state, and not the threads
        raise RuntimeError(f"the preloaded modules started threads {extra}: forking is not "
                           "safe; drop the module that starts them from --preload")


class _BecomeWorker(BaseException):
    """Raised in a freshly forked child to leave the zygote's loop (BaseException: no
    handler on the way catches it) and run the worker from the top of :func:`main`."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__()
        self.request = request


class _Stop(Exception):
    pass


class Zygote:
    """The listening socket, the agent's liveness and the children being run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.owner = os.getpid()
        self.path = args.socket
        self.agent = args.agent_pid
        self.idle = args.idle
        if proc_stat(self.agent)[19] != args.agent_start:
            raise RuntimeError(f"agent {self.agent} is not the process that started the "
                               "zygote (its start time differs)")
        self.agent_fd = os.pidfd_open(self.agent)  # readable once the agent exits
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o077)
        try:
            self.server.bind(self.path)
        finally:
            os.umask(old)
        self.server.listen(64)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ, ("accept", None))
        self.sel.register(self.agent_fd, selectors.EVENT_READ, ("agent", None))
        # pid -> (connection to its launcher or None once gone, pidfd)
        self.children: dict[int, tuple[socket.socket | None, int]] = {}
        self.quiet_since = time.monotonic()

    # -- the loop -----------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until the agent exits, the idle time passes or SIGTERM; in a forked
        child, raises :class:`_BecomeWorker`."""
        log(f"ready on {self.path} for agent {self.agent}")
        while True:
            timeout = None if self.children else max(
                0.0, self.quiet_since + self.idle - time.monotonic())
            events = self.sel.select(timeout)
            if not events and not self.children \
                    and time.monotonic() >= self.quiet_since + self.idle:
                log(f"idle for {self.idle:.0f}s: exiting")
                return
            for key, _ in events:
                kind, pid = key.data
                if kind == "agent":
                    log(f"agent {self.agent} exited: exiting")
                    return
                if kind == "accept":
                    self.accept()
                elif kind == "child":
                    self.reap(pid)
                elif kind == "launcher":
                    self.launcher_gone(pid)

    def accept(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError as e:  # out of descriptors, ...: the launcher falls back to cold
            log(f"accept failed: {e}")
            return
        fds: list[int] = []
        try:
            conn.settimeout(10)
            request, fds = self.read_request(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self.become_worker(conn, request, fds)
        except (OSError, ValueError, PermissionError) as e:
            log(f"refused a request: {e}")
            try:
                send_message(conn, {"error": str(e)})
            except OSError:
                pass
            conn.close()
            return
        finally:
            for fd in fds:
                if os.getpid() == self.owner:
                    os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.sel.register(pidfd, selectors.EVENT_READ, ("child", pid))
        try:
            send_message(conn, {"pid": pid})
        except OSError:  # the launcher is gone already
            conn.close()
            self.children[pid] = (None, pidfd)
            _kill_group(pid)
            return
        self.children[pid] = (conn, pidfd)
        self.sel.register(conn, selectors.EVENT_READ, ("launcher", pid))
        log(f"forked worker {pid} (rank {request['env'].get('RANK')}, restart "
            f"{request['env'].get('TORCHELASTIC_RESTART_COUNT')})")

    def read_request(self, conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
        """The request of a launcher: this user's process whose parent is the agent.
        (Read before it is judged: a connection closed with its request unread would
        reset, and the launcher would not learn why it was refused.)"""
        data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        pid, uid, _ = peer_credentials(conn)
        try:
            parent = int(proc_stat(pid)[1])
        except (OSError, ValueError, IndexError):
            parent = None
        if uid != os.getuid() or parent != self.agent:
            for fd in fds:
                os.close(fd)
            if uid != os.getuid():
                raise PermissionError(f"process {pid} runs as uid {uid}, not {os.getuid()}")
            raise PermissionError(f"process {pid} is not a worker of agent {self.agent} "
                                  f"(its parent is {parent})")
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError("truncated request")
            request = json.loads(data)
            Target.from_dict(request["target"])
            env, cwd, stdio = request["env"], request["cwd"], request["stdio"]
            if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in env.items())
                    and isinstance(cwd, str) and isinstance(stdio, list)
                    and stdio == sorted(set(stdio) & {0, 1, 2}) and len(stdio) == len(fds)):
                raise ValueError("malformed request")
        except (ValueError, KeyError, TypeError) as e:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"bad request from process {pid}: {e}") from e
        request["launcher"] = pid
        return request, fds

    def reap(self, pid: int) -> None:
        conn, pidfd = self.children.pop(pid)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        if conn is not None:
            self.sel.unregister(conn)
            try:
                send_message(conn, {"signal": -code} if code < 0 else {"exit": code})
            except OSError:
                pass
            conn.close()
        log(f"worker {pid} ended: {'signal ' + str(-code) if code < 0 else 'exit ' + str(code)}")
        if not self.children:
            self.quiet_since = time.monotonic()

    def launcher_gone(self, pid: int) -> None:
        """The launcher's end of the connection closed before its worker ended: it was
        killed, and its worker must not outlive it."""
        conn, pidfd = self.children[pid]
        assert conn is not None
        self.sel.unregister(conn)
        conn.close()
        self.children[pid] = (None, pidfd)
        log(f"the launcher of worker {pid} is gone: killing the worker")
        _kill_group(pid)

    def close(self) -> None:
        """In the zygote: kill the children left, remove the socket, its lock and log
        (an orderly end; a zygote that failed to start leaves its log for the launcher)."""
        if os.getpid() != self.owner:
            return
        for pid in list(self.children):
            _kill_group(pid)
        stem = self.path[:-len(".sock")] if self.path.endswith(".sock") else self.path
        for path in (self.path, stem + ".lock", stem + ".log"):
            try:
                os.unlink(path)
            except OSError:
                pass
        self.server.close()

    # -- in the child -------------------------------------------------------------------------
    def become_worker(self, conn: socket.socket, request: dict[str, Any],
                      fds: list[int]) -> None:
        """Right after the fork, in the child: die with the zygote, lead a session of
        its own (as torchrun's workers do), drop the zygote's sockets and signal handlers,
        then leave the loop to run the worker."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self.owner:  # the zygote died before prctl took effect
            os._exit(1)
        os.setsid()
        self.sel.close()
        self.server.close()
        os.close(self.agent_fd)
        for other, pidfd in self.children.values():
            os.close(pidfd)
            if other is not None:
                other.close()
        conn.close()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        request["fds"] = list(fds)
        fds.clear()
        raise _BecomeWorker(request)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue


def run_worker(request: dict[str, Any], zygote: int) -> None:
    """In the forked child: take on the launcher's stdio, directory and environment, then
    run the script as ``python SCRIPT`` would."""
    for target_fd, fd in zip(request["stdio"], request["fds"]):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[ZYGOTE_ENV] = str(zygote)
    os.environ[LAUNCHER_ENV] = str(request["launcher"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # as a fresh process would have: its own entropy
        numpy.random.seed()
    run_target(Target.from_dict(request["target"]))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _OWNER.append(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    modules = [] if args.no_default_preload else list(DEFAULT_PRELOAD)
    required = [m for m in args.preload.split(",") if m]
    request = None
    zygote = None
    try:
        preload(modules + required, required)
        # The preloaded objects move out of the collector's reach: the children's
        # collections (and their exit) do not walk them, nor copy their pages.
        gc.freeze()
        zygote = Zygote(args)
        zygote.serve()
    except _BecomeWorker as become:
        request = become.request
    except _Stop:
        log("stopped by a signal")
    finally:
        if zygote is not None:
            zygote.close()
    if request is None:
        return 0
    return run_worker(request, os.getppid())


_OWNER: list[int] = []


def _stop(sig: int, frame: Any) -> None:
    if os.getpid() not in _OWNER:  # a child not yet past become_worker: die of it
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return
    raise _Stop()


if __name__ == "__main__":
    sys.exit(main())
