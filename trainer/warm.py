"""Warm worker restarts under torchrun: ``torchrun ... -m trainer.warm train.py ARGS``.

A restarted worker normally pays for a fresh interpreter importing torch (seconds) before
it can restore anything. With this launcher, each worker process that torchrun starts is a
small program that imports no torch: it asks the node's *zygote* (:mod:`trainer.zygote`), a
process that has imported torch, torch.distributed, torch._dynamo, ckpt and the trainer
once, to fork the real worker, and passes it the command line, the working directory,
torchrun's environment of this attempt (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``TORCHELASTIC_RESTART_COUNT``, ...) and its stdin/stdout/stderr. The launcher then stands
in for the worker: it forwards torchrun's signals to it and exits with its status (or dies
of the same signal), so the agent sees what it would have seen of a plain worker.

The zygote is started by the first launcher of a node (per torchrun agent, job and Python)
and exits when that agent exits, when it has been idle for ``CKPT_WARM_IDLE_S`` seconds
(default 3600) or on SIGTERM. Its socket lives in a directory only this user can enter
(``CKPT_WARM_DIR``, else ``$XDG_RUNTIME_DIR/ckpt-warm``, else ``/tmp/ckpt-warm-<uid>``), and it
forks only for processes of this user whose parent is its agent. When the zygote cannot be
used the script runs here, cold, and a line on stderr says why; ``CKPT_WARM=0`` asks for
that. Outside torchrun (no ``TORCHELASTIC_RUN_ID``) there is nothing to restart and the
script simply runs here. See docs/warm-restarts.md.

    python -m trainer.warm [--preload MOD[,MOD...]] [--no-default-preload]
                           (SCRIPT | -m MODULE) [ARGS...]
"""

from __future__ import annotations

# Imported by every worker torchrun starts, before anything else: only what the warm path
# needs is imported here (no typing, dataclasses, subprocess, ...); the rest where used.
import json
import os
import signal
import socket
import struct
import sys
import time
import zlib

#: "0" runs every worker cold (no zygote).
ENV_SWITCH = "CKPT_WARM"
#: The directory of the zygotes' sockets and logs.
ENV_DIR = "CKPT_WARM_DIR"
#: Seconds a zygote without workers waits before it exits.
ENV_IDLE = "CKPT_WARM_IDLE_S"
#: Seconds a launcher waits for a zygote it started to be ready (its imports).
ENV_START_TIMEOUT = "CKPT_WARM_START_TIMEOUT_S"
#: Set in a worker forked by a zygote: the zygote's pid, and the launcher's.
ZYGOTE_ENV = "CKPT_WARM_ZYGOTE"
LAUNCHER_ENV = "CKPT_WARM_LAUNCHER"

MAX_MESSAGE = 200_000  # one SOCK_SEQPACKET datagram: under the default socket buffer
REPLY_TIMEOUT = 60.0  # seconds for the zygote to fork and answer (it answers in ms)
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)
_zygotes: list = []  # the zygotes started here (Popen); kept so they are not collected


class WarmUnavailable(RuntimeError):
    """The zygote cannot be used; the message says why. The script then runs cold."""


class Target:
    """What to run: a script path or a module (``-m``), and its arguments."""

    def __init__(self, path: str | None, module: str | None, args: tuple[str, ...]) -> None:
        self.path, self.module, self.args = path, module, tuple(args)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Target) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Target(path={self.path!r}, module={self.module!r}, args={self.args!r})"

    def to_dict(self) -> dict:
        return {"path": self.path, "module": self.module, "args": list(self.args)}

    @classmethod
    def from_dict(cls, d: dict) -> Target:
        path, module, args = d.get("path"), d.get("module"), d.get("args")
        if (path is None) == (module is None) or not isinstance(args, list) \
                or not all(isinstance(a, str) for a in args) \
                or not isinstance(path or module, str):
            raise ValueError(f"not a target: {d!r}")
        return cls(path, module, tuple(args))


class Options:
    """The launcher's own options: more modules for the zygote to import (``--preload``),
    and whether it imports its defaults (torch, the trainer; ``--no-default-preload``)."""

    def __init__(self, preload: tuple[str, ...] = (), default_preload: bool = True) -> None:
        self.preload, self.default_preload = tuple(preload), default_preload

    def zygote_args(self) -> list[str]:
        return ((["--preload", ",".join(self.preload)] if self.preload else [])
                + ([] if self.default_preload else ["--no-default-preload"]))


USAGE = ("usage: python -m trainer.warm [--preload MOD[,MOD...]] [--no-default-preload] "
         "(SCRIPT | -m MODULE) [ARGS...]   (under torchrun: torchrun ... -m trainer.warm "
         "SCRIPT [ARGS...])")


def parse(argv: list[str]) -> tuple[Target, Options]:
    """``[--preload MODS] [--no-default-preload] (SCRIPT | -m MODULE) [ARGS]``."""
    preload: list[str] = []
    defaults = True
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        arg = argv[i]
        if arg == "--no-default-preload":
            defaults, i = False, i + 1
            continue
        if arg == "--preload" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif arg.startswith("--preload="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            raise SystemExit(f"trainer.warm: unknown option {arg!r}\n{USAGE}")
        preload += [m for m in value.split(",") if m]
    rest = argv[i:]
    options = Options(tuple(preload), defaults)
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return Target(None, rest[1], tuple(rest[2:])), options
    if rest and not rest[0].startswith("-"):
        return Target(rest[0], None, tuple(rest[1:])), options
    raise SystemExit(USAGE)


def run_target(target: Target) -> None:
    """Run ``target`` in this process as ``python SCRIPT ARGS`` / ``python -m MODULE ARGS``
    would (``__main__``, ``sys.argv``, ``sys.path[0]``)."""
    import runpy

    if target.module is not None:
        sys.argv = [target.module, *target.args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        assert target.path is not None
        sys.argv = [target.path, *target.args]
        sys.path[0] = os.path.dirname(os.path.abspath(target.path))
        runpy.run_path(target.path, run_name="__main__")


# ------------------------------------------------------------------------ where the zygote is


def socket_dir() -> str:
    """The private directory of this user's zygote sockets (created 0700); WarmUnavailable
    if it exists and others could enter it, or is not this user's."""
    path = os.environ.get(ENV_DIR)
    if not path:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        path = (os.path.join(runtime, "ckpt-warm") if runtime
                else os.path.join(os.environ.get("TMPDIR") or "/tmp", f"ckpt-warm-{os.getuid()}"))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise WarmUnavailable(f"cannot create the zygote directory {path}: {e}") from e
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid() \
            or st.st_mode & 0o077:
        raise WarmUnavailable(
            f"{path} is not a private directory of this user (owner uid {st.st_uid}, mode "
            f"{oct(st.st_mode & 0o777)}; want uid {os.getuid()}, mode 0700): remove it, or set "
            f"{ENV_DIR} to another directory")
    return path


def proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (state is [0], ppid [1],
    start time in clock ticks since boot [19])."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def zygote_key(run_id: str, agent_pid: int, options: Options) -> str:
    """The name of the zygote of this agent (pid and start time: a reused pid is another
    agent), job, Python and preloads (a checksum of those: the directory is private, the
    name need not resist forgery, and the launcher need not import hashlib)."""
    rest = "\0".join([run_id, sys.executable, *options.zygote_args()])
    return f"{agent_pid}-{proc_stat(agent_pid)[19]}-{zlib.crc32(rest.encode()):08x}"


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    fmt = "3i"
    return struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                              struct.calcsize(fmt)))


def connect(path: str) -> socket.socket:
    """A connection to the zygote at ``path``, whose process must be this user's."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        _, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            raise WarmUnavailable(f"the process listening on {path} runs as uid {uid}, not "
                                  f"{os.getuid()}: not using it")
    except BaseException:
        sock.close()
        raise
    return sock


def _log_tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def start_zygote(sock_path: str, log_path: str, agent_pid: int, options: Options):
    """Start the zygote (a ``subprocess.Popen``) in a session of its own (torchrun's kill
    of a worker's process group does not reach it), its output appended to ``log_path``."""
    import subprocess

    cmd = [sys.executable, "-u", "-m", "trainer.zygote", "--socket", sock_path,
           "--agent-pid", str(agent_pid), "--agent-start", proc_stat(agent_pid)[19],
           "--idle", os.environ.get(ENV_IDLE, "3600"), *options.zygote_args()]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True)
    _zygotes.append(proc)
    return proc


def reach_zygote(options: Options) -> tuple[socket.socket, str]:
    """A connection to this node's zygote, started (and waited for) if there is none;
    returns it and the zygote's log path. WarmUnavailable when that fails."""
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    agent = os.getppid()
    directory = socket_dir()
    key = zygote_key(run_id, agent, options)
    sock_path = os.path.join(directory, f"{key}.sock")
    log_path = os.path.join(directory, f"{key}.log")
    if len(sock_path.encode()) > 107:
        raise WarmUnavailable(f"the socket path {sock_path} is too long for a unix socket: "
                              f"set {ENV_DIR} to a shorter directory")
    try:
        return connect(sock_path), log_path
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    import fcntl

    # One launcher of the node starts it; the others (local ranks) wait on the lock.
    with open(os.path.join(directory, f"{key}.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return connect(sock_path), log_path
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        # A launcher killed while it waited (torchrun restarting the group) leaves its
        # zygote importing, its pid in the lock file: wait for that one, start no other.
        lock.seek(0)
        recorded = lock.read().strip()
        pid = int(recorded) if recorded.isdigit() and _is_zygote(int(recorded), sock_path) \
            else None
        proc = None
        if pid is None:
            if os.path.lexists(sock_path):
                os.unlink(sock_path)  # a dead zygote's
            proc = start_zygote(sock_path, log_path, agent, options)
            pid = proc.pid
            lock.seek(0)
            lock.truncate()
            lock.write(str(pid))
            lock.flush()
        timeout = float(os.environ.get(ENV_START_TIMEOUT, "300"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return connect(sock_path), log_path
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            if (proc.poll() is not None) if proc is not None \
                    else not _is_zygote(pid, sock_path):
                status = proc.returncode if proc is not None else "unknown"
                raise WarmUnavailable(f"the zygote (pid {pid}) exited with status {status} "
                                      f"before it was ready; its log {log_path} ends: "
                                      f"{_log_tail(log_path)}")
            if time.monotonic() > deadline:
                if proc is not None:
                    proc.kill()
                raise WarmUnavailable(f"the zygote was not ready after {timeout:.0f}s "
                                      f"({ENV_START_TIMEOUT}); log: {log_path}")
            time.sleep(0.02)  # it binds its socket once its imports are done


def _is_zygote(pid: int, sock_path: str) -> bool:
    """Whether ``pid`` is a live zygote serving ``sock_path``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
        alive = proc_stat(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
    return alive and b"trainer.zygote" in cmd and os.fsencode(sock_path) in cmd


# ------------------------------------------------------------------------- the warm worker


def send_message(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise WarmUnavailable(f"the request is {len(data)} bytes (the environment?), over "
                              f"{MAX_MESSAGE}")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def receive_message(sock: socket.socket) -> dict | None:
    """The next message, None when the other end closed the connection."""
    data = sock.recv(MAX_MESSAGE)
    return json.loads(data) if data else None


def _forward(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the worker leads its own process group, as a cold one would
    except ProcessLookupError:
        try:
            os.kill(pid, sig)  # not yet its own group leader
        except ProcessLookupError:
            pass


def _die_like(sig: int) -> int:
    """End this process by ``sig``, as the worker ended (torchrun reports the signal)."""
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those have no handler to reset
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    return 128 + sig  # a signal that does not end a process


def run_warm(sock: socket.socket, target: Target, log_path: str) -> int:
    """Have the zygote fork the worker, stand in for it; returns its exit status."""
    child: list[int] = []
    pending: list[int] = []

    def relay(sig: int, frame: object) -> None:
        if child:
            _forward(child[0], sig)
        else:
            pending.append(sig)

    previous = {sig: signal.signal(sig, relay) for sig in RELAYED}
    stdio = [fd for fd in (0, 1, 2) if _valid_fd(fd)]
    try:
        sock.settimeout(REPLY_TIMEOUT)  # a zygote that does not answer: run cold
        send_message(sock, {"target": target.to_dict(), "cwd": os.getcwd(),
                            "env": dict(os.environ), "stdio": stdio}, stdio)
        reply = receive_message(sock)
        sock.settimeout(None)  # the worker runs as long as it runs
        if reply is None or "pid" not in reply:
            reason = reply.get("error") if reply else "it closed the connection"
            raise WarmUnavailable(f"the zygote did not start the worker: {reason} (log: "
                                  f"{log_path})")
    except (WarmUnavailable, OSError) as e:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:  # for the cold run to receive
            os.kill(os.getpid(), sig)
        if isinstance(e, WarmUnavailable):
            raise
        raise WarmUnavailable(f"cannot talk to the zygote: {e}") from e
    child.append(int(reply["pid"]))
    for sig in pending:
        _forward(child[0], sig)
    try:
        status = receive_message(sock)
    except OSError:
        status = None
    if status is None:
        print(f"trainer.warm: the zygote died while worker {child[0]} ran (its log: "
              f"{log_path}); exiting 1", file=sys.stderr, flush=True)
        return 1
    if "signal" in status:
        return _die_like(int(status["signal"]))
    return int(status["exit"])


def _valid_fd(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    target, options = parse(sys.argv[1:] if argv is None else argv)
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ.get(ENV_SWITCH) == "0":
        run_target(target)  # nothing will restart us: no zygote to keep
        return 0
    try:
        sock, log_path = reach_zygote(options)
    except (WarmUnavailable, OSError) as e:
        print(f"trainer.warm: no zygote ({e}); starting {target.path or target.module} cold",
              file=sys.stderr, flush=True)
        run_target(target)
        return 0
    try:
        return run_warm(sock, target, log_path)
    except WarmUnavailable as e:
        print(f"trainer.warm: {e}; starting {target.path or target.module} cold",
              file=sys.stderr, flush=True)
    finally:
        sock.close()
    run_target(target)
    return 0


__all__ = ["ENV_DIR", "ENV_IDLE", "ENV_START_TIMEOUT", "ENV_SWITCH", "LAUNCHER_ENV",
           "Options", "Target", "WarmUnavailable", "ZYGOTE_ENV", "main", "parse", "run_target",
           "socket_dir", "zygote_key"]


if __name__ == "__main__":
    sys.exit(main())
