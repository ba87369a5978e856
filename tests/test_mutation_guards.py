"""Guards found by mutation testing (h-mutate): each test here kills a mutant of code landed
in this session that the module's own tests let survive. The mutant is named in each
docstring; deleting the guarded line makes the test fail."""

from __future__ import annotations

import json
import shutil
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from ckpt import CheckpointManager, CorruptCheckpointError, PartialLoadError, SaveOptions


def open_files_under(root: Path) -> list[str]:
    """Files under ``root`` this process holds open (its descriptors, from /proc)."""
    prefix = str(root.resolve()) + os.sep
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            continue
        if target.startswith(prefix):
            out.append(target)
    return out


def test_a_load_closes_every_data_file_it_opened_whether_it_succeeds_or_fails(tmp_path):
    """Mutants: storage_backends/posix.py _FileReader.close without os.close, and
    ckpt/_load/reader.py _Files.close without reader.close (a descriptor leaked per file per
    thread per load: a trainer that restores often runs out of descriptors)."""
    state = {f"t{i}": torch.randn(64, 64) for i in range(16)}
    with CheckpointManager(tmp_path, async_save=False, handle_sigterm=False, metrics=False,
                           options=SaveOptions(chunk_bytes=16 << 10, write_threads=2)) as mgr:
        mgr.save(1, state)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        mgr.restore(live, step=1)
        assert all(torch.equal(live[k], state[k]) for k in state)
        assert open_files_under(tmp_path) == [], "a restore left data files open"
        data = sorted((tmp_path / "step-00000001").glob("data-*"))
        last = data[-1].stat().st_size - 1  # a chunk's last byte
        with open(data[-1], "r+b") as f:  # one flipped bit: the verify pass fails
            f.seek(last)
            byte = f.read(1)
            f.seek(last)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(live, step=1)
        assert open_files_under(tmp_path) == [], "a failed restore left data files open"


def test_a_truncated_file_of_an_earlier_step_is_refused_before_anything_changes(tmp_path):
    """Mutant: ckpt/_step/integrity.py _check_files without its ``end > size`` check. An
    incremental step reads its unchanged chunks from an earlier step's files, whose size
    the step's manifest does not record; truncated, a structure-only restore must refuse
    them before it writes, not die half-way (PartialLoadError) in the apply pass."""
    frozen, trained = torch.randn(256, 64), torch.randn(64, 64)
    with CheckpointManager(tmp_path, async_save=False, handle_sigterm=False, metrics=False,
                           incremental=True, full_every=100,
                           options=SaveOptions(chunk_bytes=16 << 10, write_threads=1)) as mgr:
        mgr.save(1, {"frozen": frozen, "trained": trained})
        mgr.save(2, {"frozen": frozen, "trained": trained + 1}, force=True)
    for data in (tmp_path / "step-00000001").glob("data-*"):
        os.truncate(data, 60_000)  # into the last chunk of "frozen", which step 2 reuses
    live = {"frozen": torch.zeros(256, 64), "trained": torch.zeros(64, 64)}
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="is truncated") as info:
            mgr.restore(live, step=2, verify="structure")
    assert not isinstance(info.value, PartialLoadError)
    assert not live["frozen"].any() and not live["trained"].any(), "a refused restore wrote"


# ---------------------------------------------------- trainer.warm against a stand-in zygote

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(Path(__file__).resolve().parent / "_warm_script.py")
LIGHT = ["--no-default-preload"]


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
    """Mutant: trainer/warm.py main returning 1 instead of running the target cold after
    run_warm's WarmUnavailable (the zygote answered, but with an error)."""
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
    """Mutant: trainer/warm.py run_warm not re-raising the signals it held while waiting for
    the zygote (``pending``) when it falls back to a cold start: torchrun's SIGTERM would be
    lost and the script would start anyway."""
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
    """Mutant: trainer/warm.py _forward signalling only the worker (os.kill) instead of its
    process group: a cold worker's children (data loader processes) get torchrun's SIGTERM
    with it; a warm one's must too, or they outlive the restart."""
    from test_warm import wait_gone, zygotes_in

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
    """Mutant: trainer/zygote.py become_worker without PR_SET_PDEATHSIG. tests/test_warm.py
    waits for the launcher first, which only returns once the worker has ended by itself;
    here the worker (which would wait 60 s) must be gone while the launcher still waits."""
    from test_warm import wait_gone, zygotes_in

    out, directory = tmp_path / "seen.json", tmp_path / "w"
    launcher = start_launcher(tmp_path, directory, [SCRIPT, "wait", str(out)])
    seen = None
    try:
        seen = worker_report(launcher, out)
        os.kill(int(seen["zygote"]), signal.SIGKILL)
        assert wait_gone(seen["pid"], timeout=20), "the worker outlived its zygote"
    finally:
        kill_all(launcher, [*((seen["pid"],) if seen else ()), *zygotes_in(directory)])

# ------------------------------------------------------------------ rank tables (format 2)


def test_verify_names_every_damaged_rank_table_not_only_the_first():
    """Mutant: ckpt/_format/ranktable.py Tables.problems returning only the first damaged table
    (``ckpt verify`` must list each damaged file, so one repair pass fixes them all)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import scale_sim as sim
    from torch.distributed.tensor import Shard

    from ckpt._format.manifest import Manifest

    specs = [sim.TensorSpec("rows", "float32", (300, 16), (Shard(0),))]
    manifest, files = sim.step_of((4,), specs, SaveOptions(chunk_bytes=4096))

    def bound(files: dict[str, bytes]) -> Manifest:
        m = Manifest.from_json(manifest.to_json(), where="simulated")
        return m.bind(lambda name: files[name], "simulated")

    assert bound(files).table_problems() == []
    damaged = dict(files)
    for rank in (1, 3):
        name = manifest.tables[rank][0]
        raw = damaged[name]
        damaged[name] = raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:]
    problems = bound(damaged).table_problems()
    assert [str(p) for p in problems] == [
        next(str(p) for p in problems if f"rank {rank}'s chunk table" in str(p))
        for rank in (1, 3)]


# ------------------------------------------------------------------------- the memory tier


def test_the_memory_tiers_reader_never_follows_a_planted_link(tmp_path):
    """Mutant: ckpt/_memory/restore.py ShmReader._fd opening without O_NOFOLLOW (a link
    planted in a segment would make a restore read any file this user can)."""
    from ckpt._memory.restore import ShmReader

    segment, secret = tmp_path / "segment", tmp_path / "secret"
    (segment / "step-00000001").mkdir(parents=True)
    secret.write_bytes(b"not a checkpoint's bytes")
    (segment / "step-00000001" / "data.bin").write_bytes(b"0123456789")
    os.symlink(secret, segment / "step-00000001" / "planted.bin")
    reader = ShmReader.of_root(str(segment))
    try:
        assert reader.read("step-00000001/data.bin", 2, 3) == b"234"
        with pytest.raises(FileNotFoundError, match="planted.bin"):
            reader.read("step-00000001/planted.bin")
    finally:
        reader.close()


def test_the_memory_tiers_reader_reports_a_file_that_ends_early_never_zero_fills(tmp_path):
    """Mutant: ckpt/_memory/restore.py ShmReader.read_into ending its loop at end of file
    instead of raising EOFError (a segment file truncated after the verify pass would be
    applied with the buffer's old bytes in place of the missing ones)."""
    from ckpt._memory.restore import ShmReader

    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "data.bin").write_bytes(b"0123456789")
    reader = ShmReader.of_root(str(tmp_path))
    try:
        out = bytearray(b"x" * 8)
        reader.read_into("step-00000001/data.bin", 0, memoryview(out))
        assert out == b"01234567"
        with pytest.raises(EOFError, match="ends before byte 14"):
            reader.read_into("step-00000001/data.bin", 6, memoryview(out))
        handle = reader.open_reader("step-00000001/data.bin")  # the apply pass's reads
        with pytest.raises(EOFError, match="ends before byte 12"):
            handle.read_into(4, memoryview(out))
        handle.close()
    finally:
        reader.close()


def _sharded(world: int, seed: int) -> dict:
    """A row-sharded DTensor whose every shard spans several 4 KiB chunks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.randn(3 * 512, 8, generator=torch.Generator().manual_seed(seed))
    return {"w": distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])}


def _save_small_chunks(rank: int, world: int, root: str, shm: str, nodes: list[str]) -> bool:
    """Save step 1 to memory only in 4 KiB chunks (each rank's 16 KiB shard is four: a peer
    serving a lost rank sends several byte ranges) and wait for the replicas."""
    import torch.distributed as dist
    from _memory_workers import manager

    mgr = manager(root, shm, "guard", nodes[rank], options=SaveOptions(chunk_bytes=4096),
                  persist_every=2)  # step 1 stays in memory only
    mgr.save(1, _sharded(world, 1), force=True)
    replicated = mgr.wait_replicated(60)
    dist.barrier()
    mgr.close()
    return replicated


def _restore_from_peers(rank: int, world: int, root: str, shm: str, nodes: list[str]) -> dict:
    from _memory_workers import manager

    state = _sharded(world, 2)
    with manager(root, shm, "guard", nodes[rank]) as mgr:
        step = mgr.restore(state)
        tier = mgr.last_restore.tier if mgr.last_restore else None
    same = torch.equal(state["w"].full_tensor(), _sharded(world, 1)["w"].full_tensor())
    return {"step": step, "tier": tier, "same": same}


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_peer_serving_several_chunks_of_a_lost_rank_sends_each_one_right(tmp_path):
    """Mutant: ckpt/_memory/restore.py's holder serving every range of a round from the
    first range asked for (``mine[0]`` for ``mine[i]`` in MemorySource._serve: every chunk
    would get the first one's bytes; the digests fail and the restore falls to the root)."""
    from _dist import run_ranks

    root, shm = str(tmp_path / "root"), tmp_path / "shm"
    shm.mkdir()
    nodes = ["hostG_n0", "hostG_n1", "hostG_n2"]
    assert all(run_ranks(3, _save_small_chunks, root, str(shm), nodes, timeout=100))
    for name in os.listdir(shm):  # node 2 lost: its segment and the replicas it held
        if name.startswith("ckpt-guard-hostG_n2-"):
            shutil.rmtree(shm / name)
    assert not (Path(root) / "step-00000001").exists()  # the root cannot serve it
    for r in run_ranks(2, _restore_from_peers, root, str(shm), nodes[:2], timeout=100):
        assert r == {"step": 1, "tier": "peer", "same": True}
