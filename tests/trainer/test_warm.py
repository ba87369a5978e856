"""Warm worker restarts (trainer.warm and trainer.zygote; docs/warm-restarts.md).

The launcher ``python -m trainer.warm SCRIPT`` asks its node's zygote to fork the worker.
The launcher's parent plays torchrun's agent: in the quick tests it is this pytest process
(so the zygote lives until the test stops it), in the last one a real torchrun agent.
The quick tests start the zygote with ``--no-default-preload`` (no torch to import).

- the worker is the zygote's child, with the launcher's argv, cwd, environment and stdio,
  and the launcher exits with its status; a second launch reuses the zygote; a module
  (``-m``) runs warm too; outside torchrun the script runs in the launcher;
- torchrun's SIGTERM to the launcher reaches the worker, and the launcher dies of the same
  signal; a SIGKILLed launcher takes its worker down; a dead zygote takes its workers down
  and the next launch starts another;
- only this user's processes whose parent is the agent may use the zygote;
- a launcher killed while the zygote it started still imports: the next one waits for that
  zygote rather than start a second;
- no usable zygote (a directory others may enter, a zygote that cannot start): the script
  runs cold, in the launcher, and a line says why;
- the zygote exits with its agent and leaves nothing in its directory;
- under a real torchrun agent: a SIGKILLed worker is restarted from the zygote, resumes from
  the memory tier bit-exact and the job finishes; afterwards no zygote and no socket remain.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).resolve().parents[1] / "support" / "warm_script.py")
LIGHT = ["--no-default-preload"]


@pytest.fixture
def warm(tmp_path):
    """Environment of a launcher "under torchrun" (a run id), its zygote directory, and the
    zygotes to stop at the end."""
    directory = tmp_path / "w"
    env = dict(os.environ, TORCHELASTIC_RUN_ID=f"warmtest-{uuid.uuid4().hex[:8]}",
               CKPT_WARM_DIR=str(directory), WARM_TEST_VALUE="from-the-launcher",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("CKPT_WARM", None)
    yield {"env": env, "dir": directory, "tmp": tmp_path}
    for pid in zygotes_in(directory):
        os.kill(pid, signal.SIGKILL)


def launch(warm: dict, *args: str, options: list[str] = LIGHT, stdin: str = "",
           timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.warm", *options, SCRIPT, *args],
                          env=warm["env"], cwd=warm["tmp"], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def start(warm: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.warm", *LIGHT, SCRIPT, *args],
                            env=warm["env"], cwd=warm["tmp"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_file(path: Path, proc: subprocess.Popen | None = None, timeout: float = 60
                  ) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"launcher exited {proc.returncode}: {proc.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {path} after {timeout}s")
        time.sleep(0.02)
    return json.loads(path.read_text())


def wait_gone(pid: int, timeout: float = 30) -> bool:
    """True once process ``pid`` has exited (a pidfd becomes readable: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def zygotes_in(directory: Path) -> list[int]:
    """Live zygote processes whose socket is in ``directory``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"trainer.zygote" in cmd and any(a.startswith(str(directory).encode() + b"/")
                                            for a in cmd) and alive(int(entry)):
            out.append(int(entry))
    return out


# ------------------------------------------------------------------------------ quick checks


def test_the_launcher_imports_no_torch_and_the_package_stays_usable():
    code = ("import sys, trainer, trainer.warm; assert 'torch' not in sys.modules, "
            "'torch imported'; assert 'ElasticTrainer' in dir(trainer)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
    import trainer
    from trainer import ElasticTrainer
    from trainer.elastic import ElasticTrainer as direct

    assert ElasticTrainer is direct and trainer.Hooks.__name__ == "Hooks"
    with pytest.raises(AttributeError):
        trainer.no_such_name


def test_worker_is_forked_by_the_zygote_with_the_launchers_argv_cwd_env_and_stdio(warm):
    out = warm["tmp"] / "seen.json"
    first = launch(warm, "report", str(out), "3", stdin="a line on stdin\n")
    assert first.returncode == 3, first.stderr
    seen = json.loads(out.read_text())
    assert seen["zygote"] is not None and seen["ppid"] == int(seen["zygote"])  # forked
    assert seen["pid"] != int(seen["launcher"]) and seen["pgid"] == seen["pid"]
    assert seen["argv"] == [SCRIPT, "report", str(out), "3"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(warm["tmp"]) and seen["path0"] == str(Path(SCRIPT).parent)
    assert seen["value"] == "from-the-launcher" and seen["stdin"] == "a line on stdin"
    assert first.stdout == "to stdout\n" and first.stderr == "to stderr\n"
    # The next worker comes from the same zygote, with its own launcher's environment.
    warm["env"]["WARM_TEST_VALUE"] = "second"
    again = launch(warm, "report", str(out), "0")
    assert again.returncode == 0, again.stderr
    second = json.loads(out.read_text())
    assert second["zygote"] == seen["zygote"] and second["value"] == "second"
    assert second["pid"] != seen["pid"]


def test_a_module_runs_warm_and_outside_torchrun_the_script_runs_in_the_launcher(warm):
    out = warm["tmp"] / "seen.json"
    warm["env"]["PYTHONPATH"] += os.pathsep + str(Path(SCRIPT).parent)
    argv = [sys.executable, "-m", "trainer.warm", *LIGHT, "-m", "warm_script", "report",
            str(out)]
    run = subprocess.run(argv, env=warm["env"], cwd=warm["tmp"], input="", text=True,
                         capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    seen = json.loads(out.read_text())
    assert seen["zygote"] is not None and seen["ppid"] == int(seen["zygote"])
    assert seen["argv"] == [SCRIPT, "report", str(out)] and seen["name"] == "__main__"
    assert seen["path0"] == str(warm["tmp"])  # python -m puts the working directory first
    # No torchrun (no run id): nothing will restart the script, no zygote to keep.
    env = {k: v for k, v in warm["env"].items() if k != "TORCHELASTIC_RUN_ID"}
    run = subprocess.run(argv, env=env, cwd=warm["tmp"], input="", text=True,
                         capture_output=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "to stderr\n", run.stderr
    seen = json.loads(out.read_text())
    assert seen["zygote"] is None and seen["ppid"] == os.getpid()


def test_the_launcher_relays_sigterm_and_dies_of_its_workers_signal(warm):
    out = warm["tmp"] / "seen.json"
    proc = start(warm, "wait", str(out))
    seen = wait_for_file(out, proc)
    proc.send_signal(signal.SIGTERM)  # what torchrun sends to stop a worker group
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert wait_gone(seen["pid"])
    # A worker SIGKILLed (OOM killer, a test): torchrun sees its launcher die of SIGKILL.
    out.unlink()
    proc = start(warm, "wait", str(out))
    seen = wait_for_file(out, proc)
    os.kill(seen["pid"], signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_a_sigkilled_launcher_takes_its_worker_down(warm):
    out = warm["tmp"] / "seen.json"
    proc = start(warm, "wait", str(out))
    seen = wait_for_file(out, proc)
    proc.kill()
    proc.wait(timeout=60)
    assert wait_gone(seen["pid"]), "the worker outlived its SIGKILLed launcher"
    assert alive(int(seen["zygote"]))  # the zygote serves the next restart


def test_a_dead_zygote_takes_its_worker_down_and_the_next_launch_starts_another(warm):
    out = warm["tmp"] / "seen.json"
    proc = start(warm, "wait", str(out))
    seen = wait_for_file(out, proc)
    os.kill(int(seen["zygote"]), signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
    assert "the zygote died" in proc.stderr.read()
    assert wait_gone(seen["pid"]), "the worker outlived its zygote"
    out.unlink()
    again = launch(warm, "report", str(out))
    assert again.returncode == 0, again.stderr
    after = json.loads(out.read_text())
    assert after["zygote"] not in (None, seen["zygote"]) and after["ppid"] == int(after["zygote"])


def test_only_this_users_workers_of_the_agent_may_use_the_zygote(warm):
    out = warm["tmp"] / "seen.json"
    assert launch(warm, "report", str(out)).returncode == 0
    [sock_path] = [p for p in warm["dir"].iterdir() if p.suffix == ".sock"]
    # This process is the agent itself, not one of its workers: refused.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(str(sock_path))
        s.send(json.dumps({"target": {"path": SCRIPT, "module": None, "args": ["x"]},
                           "cwd": "/", "env": {}, "stdio": []}).encode())
        reply = json.loads(s.recv(65536))
    assert "pid" not in reply and "not a worker of agent" in reply["error"]
    assert oct(warm["dir"].stat().st_mode & 0o777) == "0o700"
    if os.getuid() == 0:  # another user cannot even reach the socket
        pid = os.fork()
        if pid == 0:  # a child that only makes system calls, then leaves at once
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).connect(str(sock_path))
                code = 0
            except PermissionError:
                code = 13
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 13


def test_no_private_directory_runs_the_script_cold_and_says_why(warm):
    warm["dir"].mkdir(mode=0o755)
    os.chmod(warm["dir"], 0o755)
    out = warm["tmp"] / "seen.json"
    run = launch(warm, "report", str(out), "4")
    assert run.returncode == 4
    seen = json.loads(out.read_text())
    assert seen["zygote"] is None and seen["ppid"] == os.getpid()  # the launcher ran it
    assert "not a private directory" in run.stderr and "cold" in run.stderr
    assert seen["argv"] == [SCRIPT, "report", str(out), "4"] and seen["name"] == "__main__"


def test_a_zygote_that_cannot_start_leaves_the_script_cold_with_its_log(warm):
    out = warm["tmp"] / "seen.json"
    run = launch(warm, "report", str(out),
                 options=[*LIGHT, "--preload", "no_such_module_for_warm_test"])
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["zygote"] is None
    assert "exited with status" in run.stderr and "no_such_module_for_warm_test" in run.stderr


def test_a_launcher_killed_while_its_zygote_imports_leaves_it_to_the_next(warm):
    """torchrun restarts the group while the first launcher waits for the zygote's imports:
    the next launcher waits for that zygote instead of starting a second one."""
    release = warm["tmp"] / "release"
    warm["env"]["WARM_TEST_RELEASE"] = str(release)
    warm["env"]["PYTHONPATH"] += os.pathsep + str(Path(SCRIPT).parent)
    slow = [*LIGHT, "--preload", "warm_slow"]  # its import waits for the release file
    out = warm["tmp"] / "seen.json"
    argv = [sys.executable, "-m", "trainer.warm", *slow, SCRIPT, "report", str(out)]
    first = subprocess.Popen(argv, env=warm["env"], cwd=warm["tmp"], stdin=subprocess.DEVNULL)
    lock = wait_for_lock(warm["dir"], first)
    zygote = int(lock.read_text())
    first.kill()
    first.wait(timeout=60)
    second = subprocess.Popen(argv, env=warm["env"], cwd=warm["tmp"], stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    release.touch()
    assert second.wait(timeout=60) == 0, second.stderr.read()
    assert int(json.loads(out.read_text())["zygote"]) == zygote
    log = next(warm["dir"].glob("*.log")).read_text()
    assert {int(p) for p in re.findall(r"zygote\[(\d+)\]", log)} == {zygote}, log


def wait_for_lock(directory: Path, proc: subprocess.Popen, timeout: float = 60) -> Path:
    """The lock file of the zygote being started, once it names the zygote's pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for lock in directory.glob("*.lock") if directory.exists() else []:
            if lock.read_text().strip().isdigit():
                return lock
        assert proc.poll() is None, "the launcher exited before starting a zygote"
        time.sleep(0.02)
    pytest.fail("no zygote started")


def test_the_zygote_exits_with_its_agent_and_leaves_nothing(warm):
    out = warm["tmp"] / "seen.json"
    agent = ("import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-m', "
             "'trainer.warm', *sys.argv[1:]]))")
    run = subprocess.run([sys.executable, "-c", agent, *LIGHT, SCRIPT, "report", str(out)],
                         env=warm["env"], cwd=warm["tmp"], input="", capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    zygote = int(json.loads(out.read_text())["zygote"])
    assert wait_gone(zygote), "the zygote outlived its agent"
    assert list(warm["dir"].iterdir()) == []


# ------------------------------------------------------------------------- a torchrun agent


@pytest.mark.slow
@pytest.mark.multiproc
def test_worker_sigkilled_under_torchrun_restarts_from_the_zygote_from_memory(tmp_path):
    """One torchrun agent (world 1) runs tests/support/memory_job.py through ``-m trainer.warm``;
    the worker is SIGKILLed before step 12 (checkpoint 10 in memory only). The agent
    restarts it: forked by the same zygote, it resumes step 10 from the memory tier with
    the model and optimizer bit-exact, and the job finishes. Then the zygote is gone and
    its directory empty."""
    from tests.support import memory_job
    from tests.support.elastic_job import wait_for
    from ckpt._memory.tier import PREFIX, SHM_DIR, private_path
    from trainer.elastic import read_jsonl

    memjob = f"wz{uuid.uuid4().hex[:10]}"
    args = ["--root", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run"),
            "--digests", str(tmp_path / "digests"), "--steps", "15", "--every", "5",
            "--persist-every", "6", "--memory-job", memjob, "--memory", "on",
            "--hold-at", "12", "--collective-timeout", "30"]
    c = memory_job.Cluster(tmp_path, args, memjob, nnodes="1:1", warm=True, forked=True)
    try:
        node = c.add_node()
        marker = tmp_path / "digests" / "holding-s12-r0.json"
        held = wait_for(lambda: marker.exists() and json.loads(marker.read_text()), 180,
                        "the worker to hold before step 12", cluster=c)
        assert held["zygote"] is not None and held["ppid"] == int(held["zygote"])
        os.kill(held["pid"], signal.SIGKILL)  # the agent lives and restarts it
        try:
            code = node.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not finish\n{c.logs()[-20000:]}")
        assert code == 0, c.logs()[-20000:]
        assert "exitcode: -9" in node.log()  # the agent saw the worker's SIGKILL
        zygote = int(held["zygote"])
        assert wait_gone(zygote), "the zygote outlived its agent"
        assert zygotes_in(c.warm_dir) == [] and list(c.warm_dir.iterdir()) == []
    finally:
        c.close()
        segments = private_path(SHM_DIR)
        for entry in os.listdir(segments) if os.path.isdir(segments) else []:
            if entry.startswith(f"{PREFIX}{memjob}"):
                shutil.rmtree(os.path.join(segments, entry), ignore_errors=True)
    def records(attempt: int, event: str) -> list[dict]:
        [path] = (tmp_path / "run" / f"attempt-{attempt:04d}").glob("rank-*.jsonl")
        return [r for r in read_jsonl(path) if r["event"] == event]

    starts = {a: records(a, "start")[0] for a in (0, 1)}
    assert starts[1]["zygote"] == starts[0]["zygote"] == zygote  # the same zygote forked it
    assert starts[1]["pid"] != held["pid"]
    [restored] = records(1, "restored")
    assert (restored["step"], restored["tier"], restored["bytes_from_storage"]) == \
        (10, "memory", 0)
    [saved] = [r for r in read_jsonl(tmp_path / "digests" / "saved-a0-r0.jsonl")
               if r["step"] == 10]
    got = json.loads((tmp_path / "digests" / "restored-a1-r0.json").read_text())
    assert (got["step"], got["digest"]) == (10, saved["digest"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == 15


# ------------------------------------------------ the launcher against a stand-in zygote


def start_launcher(cwd: Path, directory: Path, args: list[str]) -> subprocess.Popen:
    """``python -m trainer.warm`` (light preload) for ``args``, its zygote kept in
    ``directory``, as torchrun's environment would start it."""
    env = dict(os.environ, TORCHELASTIC_RUN_ID=f"guard-{uuid.uuid4().hex[:8]}",
               CKPT_WARM_DIR=str(directory),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("CKPT_WARM", None)
    return subprocess.Popen([sys.executable, "-m", "trainer.warm", *LIGHT, *args], env=env,
                            cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def worker_report(launcher: subprocess.Popen, out: Path) -> dict:
    """The JSON the worker script writes to ``out`` once it runs (its pids), while the
    launcher lives."""
    while not out.exists():
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.02)
    return json.loads(out.read_text())


def kill_all(launcher: subprocess.Popen, pids: list[int]) -> None:
    """SIGKILL ``pids`` (the worker's processes first: they hold the launcher's stdout open),
    then the launcher, and collect its output."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if launcher.poll() is None:
        launcher.kill()
    launcher.communicate()


class StandInZygote:
    """A socket where the launcher looks for its zygote (the key it computes for this pytest
    process as its agent), served by the test: it takes the launcher's request and then
    answers as the test says, so the launcher's fallbacks run for real."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        from trainer.warm import parse, zygote_key

        self.dir = tmp_path / "w"
        self.dir.mkdir(mode=0o700)
        run_id = f"guard-{uuid.uuid4().hex[:8]}"
        key = zygote_key(run_id, os.getpid(), parse([*LIGHT, SCRIPT, *args])[1])
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(self.dir / f"{key}.sock"))
        self.listener.listen(1)
        self.listener.settimeout(60)
        env = dict(os.environ, TORCHELASTIC_RUN_ID=run_id, CKPT_WARM_DIR=str(self.dir),
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                              if p))
        env.pop("CKPT_WARM", None)
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "trainer.warm", *LIGHT, SCRIPT, *args], env=env, cwd=tmp_path,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(60)
        data, fds, _, _ = socket.recv_fds(self.conn, 1 << 20, 3)  # its request: it now waits
        for fd in fds:
            os.close(fd)
        assert json.loads(data)["target"]["args"] == args

    def close(self) -> None:
        if self.launcher.poll() is None:
            self.launcher.kill()
        self.launcher.communicate()
        self.conn.close()
        self.listener.close()


def signal_delivered(pid: int, sig: int) -> bool:
    """Whether ``sig`` sent to ``pid`` is no longer pending (its handler has it)."""
    with open(f"/proc/{pid}/status") as f:
        pending = [int(line.split()[1], 16) for line in f
                   if line.startswith(("SigPnd:", "ShdPnd:"))]
    return not any(mask & (1 << (sig - 1)) for mask in pending)


def test_a_zygote_that_refuses_the_worker_leaves_the_script_cold_in_the_launcher(tmp_path):
    """A zygote that answers the launcher's request with an error leaves the script to run cold in
    the launcher, which exits with the script's status and says why."""
    out = tmp_path / "seen.json"
    zygote = StandInZygote(tmp_path, ["report", str(out), "4"])
    try:
        zygote.conn.send(json.dumps({"error": "refused by the test"}).encode())
        assert zygote.launcher.wait(timeout=60) == 4
        seen = json.loads(out.read_text())
        assert seen["zygote"] is None and seen["pid"] == zygote.launcher.pid  # ran cold
        stderr = zygote.launcher.stderr.read()
        assert "refused by the test" in stderr and "cold" in stderr
    finally:
        zygote.close()


def test_a_sigterm_before_the_zygote_fails_reaches_the_cold_fallback(tmp_path):
    """A SIGTERM the launcher holds while it waits for the zygote is re-raised when it falls back to
    a cold start: torchrun's stop is not lost, and the script does not start."""
    out = tmp_path / "seen.json"
    zygote = StandInZygote(tmp_path, ["report", str(out), "0"])
    try:
        zygote.launcher.send_signal(signal.SIGTERM)  # its relay holds it: no worker yet
        while not signal_delivered(zygote.launcher.pid, signal.SIGTERM):
            time.sleep(0.01)
        zygote.conn.close()  # the zygote gone before it forked the worker
        assert zygote.launcher.wait(timeout=60) == -signal.SIGTERM
        assert not out.exists(), "the script ran although the launcher was told to stop"
    finally:
        zygote.close()


FAMILY = """import json, os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "child": child.pid}, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def test_a_relayed_sigterm_reaches_the_workers_whole_process_group(tmp_path):
    """The launcher relays torchrun's SIGTERM to the warm worker's whole process group, as a cold
    worker's children (data loader processes) get it with the worker: none of them outlives the
    restart."""
    script, out = tmp_path / "family.py", tmp_path / "family.json"
    script.write_text(FAMILY)
    directory = tmp_path / "w"
    launcher = start_launcher(tmp_path, directory, [str(script), str(out)])
    seen = None
    try:
        seen = worker_report(launcher, out)
        assert zygotes_in(directory), "the worker was not forked by a zygote"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == -signal.SIGTERM
        assert wait_gone(seen["pid"]), "the worker outlived the SIGTERM"
        assert wait_gone(seen["child"]), "the worker's child outlived the SIGTERM"
    finally:  # the processes first: the child holds the launcher's stdout open
        kill_all(launcher, [*(seen.values() if seen else ()), *zygotes_in(directory)])


def test_a_sigkilled_zygote_takes_its_worker_down_at_once(tmp_path):
    """A SIGKILLed zygote takes its worker down at once, while the launcher still waits (the worker
    here would otherwise wait 60 s)."""
    out, directory = tmp_path / "seen.json", tmp_path / "w"
    launcher = start_launcher(tmp_path, directory, [SCRIPT, "wait", str(out)])
    seen = None
    try:
        seen = worker_report(launcher, out)
        os.kill(int(seen["zygote"]), signal.SIGKILL)
        assert wait_gone(seen["pid"], timeout=20), "the worker outlived its zygote"
    finally:
        kill_all(launcher, [*((seen["pid"],) if seen else ()), *zygotes_in(directory)])
