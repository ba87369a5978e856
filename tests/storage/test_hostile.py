"""A hostile or careless root: planted symbolic links, reused step numbers, full and read-only
file systems, odd arguments. Nothing outside a root is ever touched, no kept step ever loses
data, and every failure is a CheckpointError that names the path and says what to do."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt
from verify.cli import main as cli
from ckpt._retention.collect import collect
from ckpt._format.names import MANIFEST_NAME
from ckpt._format.sealed import DIGEST_MEMBER, reseal, sealed_json
from storage_backends import PosixStorage

ROOT = Path(__file__).resolve().parents[2]
SMALL_CHUNKS = ckpt.SaveOptions(chunk_bytes=1 << 12, write_threads=1)


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (not following links) with its bytes."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in files:
            full = Path(dirpath) / name
            out[str(full.relative_to(path))] = full.read_bytes()
    return out


def state_of(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(16, generator=g)}


def fresh() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(64, 32), "b": torch.zeros(16)}


def assert_equal(state: dict, expected: dict) -> None:
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


# ------------------------------------------------------------------ planted symbolic links
@pytest.fixture
def victim(tmp_path):
    """A directory outside the root that holds a whole valid checkpoint, plus a plain file."""
    victim = tmp_path / "victim"
    ckpt.save(state_of(99), victim / "step-00000099", step=99)
    (victim / "precious.txt").write_text("do not touch")
    before = tree(victim)
    yield victim
    assert tree(victim) == before, "something outside the root was changed"


def plant_links(root: Path, victim: Path) -> None:
    """Links where ckpt looks: a step, a staging dir, a trash dir, a data file in a step."""
    os.symlink(victim / "step-00000099", root / "step-00000099")
    os.symlink(victim, root / "step-00000000")
    os.symlink(victim, root / ".tmp-step-00000005-0123456789ab")
    os.symlink(victim, root / ".trash-0123456789ab")
    os.symlink(victim / "precious.txt", root / "step-00000001" / "data-planted.safetensors")
    os.symlink(victim, root / "step-00000001" / "planted-dir")


# tensorstore's file driver follows links: its backend once listed, read and deleted through
# them (gc emptied a linked directory outside the root).
# fsspec's local:// did too (it is now the POSIX backend).
BACKENDS = {"posix": str, "tensorstore+file": lambda path: f"tensorstore+file://{path}",
            "local": lambda path: f"local://{path}"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_writer_open_retention_and_restore_never_follow_planted_links(tmp_path, victim,
                                                                      caplog, backend):
    root = tmp_path / "root"
    url = BACKENDS[backend](root)
    with ckpt.CheckpointManager(url, async_save=False) as mgr:
        mgr.save(1, state_of(1))
    plant_links(root, victim)
    with ckpt.CheckpointManager(url, async_save=False, keep_last=1) as mgr:  # cleanup at open
        assert mgr.steps() == [1]  # the linked step 99 is not a step of this root
        for step in (2, 3):
            mgr.save(step, state_of(step))  # retention retires 1 and 2, never a link
        assert mgr.steps() == [3]
        state = fresh()
        assert mgr.restore(state) == 3
        assert_equal(state, state_of(3))
        with pytest.raises(ckpt.CheckpointNotFoundError):
            mgr.restore(fresh(), step=99)  # reading through the link is refused
        os.symlink(victim, root / "step-00000004")
        with pytest.raises(ckpt.CheckpointError, match="step-00000004"):
            mgr.save(4, state_of(4))  # never written into
    assert "ckpt.symlink ignored" in caplog.text
    assert (root / "step-00000099").is_symlink()  # ignored, not deleted


@pytest.mark.parametrize("backend", BACKENDS)
def test_gc_api_and_cli_never_follow_planted_links(tmp_path, victim, capsys, backend):
    root = tmp_path / "root"
    url = BACKENDS[backend](root)
    with ckpt.CheckpointManager(url, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))
    plant_links(root, victim)
    report = collect(ckpt.CheckpointManager(url, read_only=True).storage, {2}, dry_run=True)
    assert report.retired_steps == [1]
    assert not any("planted" in f or "step-00000099" in f for f in report.deleted_files)
    assert cli(["gc", url, "--keep-last", "1", "--yes"]) == 0
    assert "removed: 1 step [" in capsys.readouterr().out
    state = fresh()
    assert ckpt.CheckpointManager(url, read_only=True).restore(state) == 2
    assert_equal(state, state_of(2))


def test_only_links_named_like_checkpoint_entries_are_warned_about(tmp_path, victim, caplog):
    """Listing warns about a link where ckpt would look (a step, a staging or trash directory,
    the lock, anything inside a step), once each; not about every link of any directory
    given as a root (`ckpt ls /` warned about /bin)."""
    from storage_backends import open_storage

    root = tmp_path / "root"
    ckpt.save(state_of(1), root / "step-00000001", step=1)
    plant_links(root, victim)
    for name in ("bin", "lib64", "notes.txt"):
        os.symlink(victim, root / name)
    storage = open_storage(str(root))
    with caplog.at_level("WARNING", logger="ckpt"):
        assert {e.name for e in storage.list()} == {"step-00000001"}
        assert [e.name for e in storage.list("step-00000001")] != []
        storage.list()  # once each
    warned = sorted(ast.literal_eval(r.getMessage().split("ignored=")[1].split(": ")[0])
                    for r in caplog.records)
    assert warned == sorted(str(root / n) for n in (
        ".tmp-step-00000005-0123456789ab", ".trash-0123456789ab", "step-00000000",
        "step-00000001/data-planted.safetensors", "step-00000001/planted-dir",
        "step-00000099"))
    assert cli(["ls", str(root)]) == 0


def test_linked_data_file_in_a_step_is_refused_and_restore_falls_back(tmp_path, victim):
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))
    # Replace step 2's data file by a link to a copy of it outside the root: same bytes,
    # but ckpt must not read through it.
    outside = victim.parent / "outside"
    outside.mkdir()
    for data in (root / "step-00000002").glob("data-*"):
        shutil.move(data, outside / data.name)
        os.symlink(outside / data.name, data)
    state = fresh()
    with ckpt.CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 1
        assert mgr.skipped and mgr.skipped[0][0] == 2
    assert_equal(state, state_of(1))
    assert len(list(outside.iterdir())) >= 1


def test_linked_lock_file_is_refused_with_a_checkpoint_error(tmp_path, victim):
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(victim / "precious.txt", root / ".lock")
    with pytest.raises(ckpt.CheckpointError, match=r"\.lock"):
        ckpt.CheckpointManager(root)
    os.unlink(root / ".lock")
    os.symlink(victim / "precious.txt", root / ".lock.owner")
    with ckpt.CheckpointManager(root, async_save=False) as mgr:  # the owner link is replaced
        mgr.save(1, state_of(1))
    assert not (root / ".lock.owner").exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".lock.owner")] == []


# ------------------------------------------------- other spellings of a step's directory name
def spellings(step: int) -> list[str]:
    """Names that are not step_dir(step) but whose digits int() reads as ``step``: more
    zeros, fewer, a final newline (which ``$`` matches before), other scripts' digits."""
    digits = f"{step:08d}"
    return [f"step-{step:09d}", f"step-{step}", f"step-{digits}\n",
            "step-" + digits.translate({ord(d): ord(d) - ord("0") + 0x660 for d in "0123456789"}),
            "step-" + digits.translate({ord(d): ord(d) - ord("0") + 0xFF10 for d in "0123456789"})]


def test_only_the_canonical_name_of_a_step_is_a_step():
    from ckpt._format.names import STEP_DIR
    assert [int(STEP_DIR.match(n).group(1)) for n in
            ("step-00000000", "step-00000007", "step-99999999", "step-100000000")] == [
        0, 7, 99999999, 100000000]
    for name in spellings(7) + ["step-012345678", "step-0000000a", "step-"]:
        assert STEP_DIR.match(name) is None, name


def test_stray_directories_spelling_a_steps_number_otherwise_never_cost_that_step(tmp_path):
    """An empty `step-000000002` (or `step-٠٠٠٠٠٠٠٢`) is not step 2: were it read as step 2,
    the collector would take step 2 for uncommitted whenever it is listed after the real one,
    and delete it."""
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_of(step))
    strays = [name for step in (1, 2, 3) for name in spellings(step)]
    for name in strays:
        (root / name).mkdir()
    assert cli(["gc", str(root), "--yes"]) == 0
    with ckpt.CheckpointManager(root, async_save=False) as mgr:  # a writer's open collects too
        assert mgr.steps() == [1, 2, 3]
        for step in (1, 2, 3):
            state = fresh()
            assert mgr.restore(state, step=step) == step
            assert_equal(state, state_of(step))
    assert all((root / name).is_dir() for name in strays)  # not ckpt's: left alone


# ------------------------------------------- a directory or FIFO where a checkpoint file is
def plant(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


@pytest.mark.parametrize("rank_tables", [False, True])
def test_a_directory_or_fifo_for_a_manifest_or_table_is_damage_restore_falls_back(
        tmp_path, capsys, rank_tables):
    """Such a step once made restore raise (instead of falling back), a writer fail to open
    the root with a bare IsADirectoryError, and gc fail with no hint of what to do."""
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False, options=ckpt.SaveOptions(
            rank_tables=rank_tables)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_of(step))
    name = "table-*.ckt" if rank_tables else "manifest.json"
    plant(next((root / "step-00000003").glob(name)), "fifo")
    plant(next((root / "step-00000002").glob(name)), "dir")
    for read_only in (True, False):
        with ckpt.CheckpointManager(root, read_only=read_only, async_save=False) as mgr:
            state = fresh()
            assert mgr.restore(state) == 1
            assert [s for s, _ in mgr.skipped] == [3, 2]
            if not rank_tables:
                assert "not a regular file" in mgr.skipped[0][1] and (
                    "a directory" in mgr.skipped[1][1])
            assert all(name.split("*")[0] in why for _, why in mgr.skipped)
    assert_equal(state, state_of(1))
    capsys.readouterr()
    assert cli(["inspect", str(root), "--step", "2"]) == 1
    assert f"step-00000002/{name.split('*')[0]}" in capsys.readouterr().err
    if not rank_tables:
        assert cli(["gc", str(root), "--keep-last", "1", "--yes"]) == 1
        err = capsys.readouterr().err
        assert "gc stopped before deleting anything" in err and "step 3" in err, err
    assert cli(["verify", str(root), "--step", "3"]) == 1
    assert "not a" in capsys.readouterr().out


def test_an_rng_state_out_of_range_is_refused_as_a_mismatch_not_an_overflow(tmp_path):
    """A hand-edited RNG state made restore raise a bare OverflowError from random.setstate
    (not a CheckpointError: a caller catching those saw it escape)."""
    ckpt.save({"rng": ckpt.RNGState(), "w": torch.ones(2)}, tmp_path / "c")
    path = tmp_path / "c" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["items"]["rng"]["per_rank"]["0"]["python"]["__tuple__"][1]["__tuple__"][5] = 2**64
    path.write_bytes(sealed_json(doc))
    with pytest.raises(ckpt.StateMismatchError, match="'rng'.load_state_dict refused"):
        ckpt.load({"rng": ckpt.RNGState(), "w": torch.zeros(2)}, tmp_path / "c")


# ------------------------------------------------------------- a reused step number (rollback)
@pytest.mark.parametrize("url", ["posix", "memory"])
def test_rollback_resave_keeps_every_later_step_loadable(tmp_path, url):
    root = str(tmp_path / "root") if url == "posix" else f"memory://rollback-{os.getpid()}"
    saved = {}

    def mgr(**kw):
        options = dataclasses.replace(SMALL_CHUNKS, incremental=True, full_every=100)
        return ckpt.CheckpointManager(root, async_save=False, options=options, **kw)

    state = state_of(0)
    with mgr() as m:
        for step in (1, 2, 3):
            state["b"] += step
            if step == 2:  # a's second chunk changes: step 3 references steps 1 and 2
                state["a"][40] += 1
            m.save(step, state)
            saved[step] = {k: v.clone() for k, v in state.items()}
        assert {c.step for c in m.manifest(3).tensors["a"].chunks} == {1, 2}
        m.restore(state, step=1)
        state["b"] -= 100
        m.save(2, state, overwrite=True)  # the rollback: step 2 again, from step 1, on purpose
        saved[2] = {k: v.clone() for k, v in state.items()}

    def check(steps):
        with ckpt.CheckpointManager(root) as m:  # reopening collects leftovers
            assert m.steps() == steps
            for step in steps:
                out = fresh()
                assert m.restore(out, step=step) == step
                assert_equal(out, saved[step])

    check([1, 2, 3])
    check([1, 2, 3])
    with mgr() as m:  # the rollback's new timeline wins: retire the old one's later steps
        assert m.retire(s for s in m.steps() if s > 2).retired_steps == [3]
    check([1, 2])
    with mgr(keep_last=1) as m:  # retire 1..3 except the newest; then old files may go
        m.save(4, state)
        saved[4] = {k: v.clone() for k, v in state.items()}
    check([4])
    if url == "posix":  # the step 2 files step 3 used are gone once nothing uses them
        assert sorted(p.name for p in Path(root).iterdir()) == [".lock", "step-00000004"]


# ------------------------------------------------------------------ arguments and the disk
@pytest.mark.parametrize("step", [True, False, 1.0, "1", None])
def test_save_refuses_a_step_that_is_not_an_int(tmp_path, step):
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(TypeError, match="step"):
            mgr.save(step, state_of(1))
        assert mgr.steps() == []


def _in_private_mount(script: str, where: Path) -> dict:
    """Run ``script`` as root of a user+mount namespace with a 1 MiB tmpfs at MNT, a new
    directory under ``where`` (so nothing is left outside the test's own directory)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    body = textwrap.dedent(script)
    mnt = where / "mnt"
    mnt.mkdir()
    shell = (f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(mnt))} "
             f"&& MNT={shlex.quote(str(mnt))} {sys.executable} -c \"$0\"")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", shell, body], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


SCRIPT_HEAD = """
import json, os, subprocess, torch, ckpt
root = os.path.join(os.environ["MNT"], "root")
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except ckpt.CheckpointError as e:
        out[name] = "CheckpointError: " + str(e)
    except BaseException as e:
        out[name] = type(e).__name__ + ": " + str(e)
    out[name + "_left"] = sorted(os.listdir(root)) if os.path.isdir(root) else None
"""


@pytest.mark.slow  # a subprocess that imports torch inside a private mount namespace
def test_writer_on_a_full_disk_or_a_read_only_root_raises_a_checkpoint_error(tmp_path):
    out = _in_private_mount(SCRIPT_HEAD + """
os.makedirs(root)
mgr = ckpt.CheckpointManager(root, async_save=False)
mgr.save(1, {"w": torch.ones(16)})
def fill(name):
    with open(os.path.join(os.environ["MNT"], name), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
fill("filler")
attempt("save", lambda: mgr.save(2, {"w": torch.ones(1 << 18)}))
mgr.close()
fill("filler2")  # what the failed save had written is free again
attempt("open", lambda: ckpt.CheckpointManager(root).close())
os.unlink(os.path.join(os.environ["MNT"], "filler"))
os.unlink(os.path.join(os.environ["MNT"], "filler2"))
ro = os.path.join(os.environ["MNT"], "ro")
os.mkdir(ro)
subprocess.run(["mount", "--bind", root, ro], check=True)
subprocess.run(["mount", "-o", "remount,bind,ro", ro], check=True)
root = ro
attempt("read_only", lambda: ckpt.CheckpointManager(ro))
state = {"w": torch.zeros(16)}
attempt("read", lambda: ckpt.CheckpointManager(ro, read_only=True).restore(state))
out["restored"] = state["w"].tolist() == [1.0] * 16
print(json.dumps(out))
""", tmp_path)
    # A full disk: the save fails and its staging directory is gone; opening a writer fails
    # without leaving its half-written owner file.
    assert out["save"].startswith("CheckpointError:") and "root" in out["save"], out
    assert out["save_left"] == [".lock", ".lock.owner", "step-00000001"], out
    assert out["open"].startswith("CheckpointError:"), out
    assert "root" in out["open"] and "free space" in out["open"], out
    assert out["open_left"] == [".lock", "step-00000001"], out
    # A read-only root: a writer is refused naming the root; reading still works.
    assert out["read_only"].startswith("CheckpointError:") and "/ro" in out["read_only"], out
    assert "writable" in out["read_only"] and "read_only=True" in out["read_only"], out
    assert out["read"] == "ok" and out["restored"], out


# ------------------------------------------------------------ malformed manifests and trees
class Holder:
    """A stateful item whose state holds tagged values (tuple, inf, bytes, an array)."""

    def __init__(self) -> None:
        self.state = {"t": (1, 2), "f": float("inf"), "raw": b"\x00\x01", "arr": None}

    def state_dict(self) -> dict:
        import numpy as np

        return {**self.state, "arr": np.arange(4.0)}

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd


def tagged_state(seed: int) -> dict:
    return {**state_of(seed), "holder": Holder(), "big": 0}


def edit(doc: dict, how: str) -> dict | str:
    items = doc["items"]
    tree = items["holder"]["tree"]
    if how == "dtype_list":
        doc["tensors"]["a"]["dtype"] = ["float32"]
    elif how == "deep_metadata":
        text = json.dumps(doc)
        return text.replace('"metadata": {', '"metadata": {"x": ' + "[" * 100_000 + "]" * 100_000
                            + ", ", 1)
    elif how == "deep_tree":
        items["holder"]["tree"]["t"] = json.loads("[" * 500 + "]" * 500)
    elif how == "huge_zstd":
        first = doc["tensors"]["a"]["chunks"][0]
        doc["tensors"]["big"] = {"dtype": "float32", "shape": [1 << 42], "chunks": [
            {**first, "offsets": [0], "shape": [1 << 42], "length": 13, "codec": "zstd"}]}
        items["big"] = {"kind": "value", "tree": {"__tensor__": "big"}}
    elif how == "missing_tensor":
        items["big"] = {"kind": "value", "tree": {"__tensor__": "nowhere"}}
    elif how == "bad_float":
        tree["f"] = {"__float__": "not a float"}
    elif how == "bad_float_type":
        tree["f"] = {"__float__": [1]}
    elif how == "bad_ndarray":
        tree["arr"] = {"__ndarray__": ["a"]}
    elif how == "bad_bytes":
        tree["raw"] = {"__bytes__": "%%%"}
    elif how == "bad_dict_pairs":
        tree["t"] = {"__dict__": [[1]]}
    elif how == "unhashable_key":
        tree["t"] = {"__dict__": [[[1, 2], 3]]}
    elif how == "no_kind":
        del items["holder"]["kind"]
    elif how == "unknown_kind":
        items["holder"]["kind"] = ["module"]
    elif how == "no_tree":
        del items["holder"]["tree"]
    elif how == "alias_list":
        doc["aliases"] = {"c": ["a"]}
    return doc


EDITS = ["dtype_list", "deep_metadata", "deep_tree", "huge_zstd", "missing_tensor", "bad_float",
         "bad_float_type", "bad_ndarray", "bad_bytes", "bad_dict_pairs", "unhashable_key",
         "no_kind", "unknown_kind", "no_tree", "alias_list"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A root with steps 1 and 2 (to copy and damage); compressed, so chunks are zstd."""
    root = tmp_path_factory.mktemp("two") / "root"
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(compression="zstd")) as mgr:
        for step in (1, 2):
            mgr.save(step, tagged_state(step))
    return root


@pytest.mark.parametrize("how", EDITS)
def test_malformed_manifest_is_corrupt_restore_falls_back_and_verify_rejects(
        tmp_path, two_steps, how, capsys):
    root = tmp_path / "root"
    shutil.copytree(two_steps, root)
    path = root / "step-00000002" / "manifest.json"
    doc = edit({k: v for k, v in json.loads(path.read_text()).items()
                if k != DIGEST_MEMBER}, how)
    # Sealed again: the edit, not a digest that no longer matches, is what is refused.
    path.write_bytes(reseal(doc.encode()) if isinstance(doc, str) else sealed_json(doc))
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        with pytest.raises(ckpt.CorruptCheckpointError):
            mgr.manifest(2)
        live = tagged_state(7)
        with pytest.raises(ckpt.CorruptCheckpointError):
            mgr.restore(live, step=2)
        assert_equal(live, state_of(7))  # nothing was written into the live state
        assert mgr.restore(live) == 1  # the fallback past step 2
        assert_equal(live, state_of(1))
    capsys.readouterr()
    code = cli(["verify", str(root), "--step", "2", "--level", "structure"])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in out + err


# ------------------------------------------------------- the commit protocol's durable order
class RecordingOs:
    """``os`` for storage_backends.posix, recording opens, writes, fsyncs and renames."""

    def __init__(self, log: list) -> None:
        self._log = log
        self._paths: dict[int, str] = {}

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777, **kw):
        fd = os.open(path, flags, mode, **kw)
        self._paths[fd] = os.fspath(path)
        if flags & os.O_CREAT:
            self._log.append(("create", os.fspath(path)))
        return fd

    def write(self, fd, data):
        self._log.append(("write", self._paths.get(fd)))
        return os.write(fd, data)

    def fsync(self, fd):
        self._log.append(("fsync", self._paths.get(fd)))
        return os.fsync(fd)

    def rename(self, src, dst):
        self._log.append(("rename", os.fspath(src), os.fspath(dst)))
        return os.rename(src, dst)


@pytest.fixture
def os_calls(monkeypatch):
    import storage_backends.files as files
    import storage_backends.posix as posix

    log: list = []
    recorder = RecordingOs(log)
    monkeypatch.setattr(posix, "os", recorder)
    monkeypatch.setattr(files, "os", recorder)  # the storage's fsync_dir lives there
    return log


def _first(log: list, pred) -> int:
    found = [i for i, e in enumerate(log) if pred(e)]
    assert found, f"a call the commit protocol needs was never made; calls: {log}"
    return found[0]


def _last(log: list, pred) -> int:
    found = [i for i, e in enumerate(log) if pred(e)]
    assert found, f"a call the commit protocol needs was never made; calls: {log}"
    return found[-1]


def test_save_makes_data_then_manifest_then_rename_durable_in_that_order(tmp_path, os_calls):
    root = str(tmp_path / "root")
    with ckpt.CheckpointManager(root, async_save=False, options=SMALL_CHUNKS) as mgr:
        os_calls.clear()
        mgr.save(1, state_of(1))
    final = f"{root}/step-00000001"
    commit = _first(os_calls, lambda e: e[0] == "rename" and e[2] == final)
    staging = os_calls[commit][1]
    assert os.path.basename(staging).startswith(".tmp-step-00000001")
    data = {e[1] for e in os_calls if e[0] == "create" and "/data-" in e[1]}
    manifest = f"{staging}/manifest.json"
    assert data and all(os.path.dirname(p) == staging for p in data)
    manifest_created = _first(os_calls, lambda e: e == ("create", manifest))
    for path in data:  # every data file is durable before the manifest exists
        assert _last(os_calls, lambda e: e[0] == "write" and e[1] == path) < _first(
            os_calls, lambda e: e == ("fsync", path)) < manifest_created, path
    # The manifest is written and fsynced, then the staging directory, then renamed.
    manifest_synced = _first(os_calls, lambda e: e == ("fsync", manifest))
    assert manifest_created < _last(os_calls, lambda e: e == ("write", manifest)) < \
        manifest_synced < _first(os_calls, lambda e: e == ("fsync", staging)) < commit
    # The rename is made durable by the root's fsync.
    assert commit < _first(os_calls, lambda e: e == ("fsync", root))


def test_resaved_step_moves_data_in_durably_before_its_manifest(tmp_path, os_calls):
    root = str(tmp_path / "root")
    with ckpt.CheckpointManager(root, async_save=False, options=SMALL_CHUNKS) as mgr:
        mgr.save(1, state_of(1))
        os_calls.clear()
        mgr.save(1, state_of(2), overwrite=True)  # the step number again (a rollback)
        out = fresh()
        assert mgr.restore(out, step=1) == 1
        assert_equal(out, state_of(2))
    final = f"{root}/step-00000001"
    moved = [e for e in os_calls if e[0] == "rename" and "/data-" in e[2]]
    commit = _first(os_calls, lambda e: e[0] == "rename" and e[2] == f"{final}/manifest.json")
    staging = os.path.dirname(os_calls[commit][1])
    assert moved and all(os.path.dirname(e[2]) == final for e in moved)
    assert _first(os_calls, lambda e: e == ("fsync", f"{staging}/manifest.json")) < commit
    last_move = _last(os_calls, lambda e: e in moved)
    assert last_move < _first(os_calls, lambda e: e == ("fsync", final)) < commit
    assert commit < _last(os_calls, lambda e: e == ("fsync", final))


def test_the_warning_about_a_planted_link_escapes_its_name(tmp_path, caplog):
    """A link named with a terminal escape (ESC [2J clears the screen) is logged escaped."""
    import logging

    from storage_backends.posix import PosixStorage

    root = tmp_path / "root"
    root.mkdir()
    os.symlink(tmp_path, root / "step-\x1b[2J")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        PosixStorage(str(root)).list("")
    messages = [r.getMessage() for r in caplog.records if "ckpt.symlink" in r.getMessage()]
    assert len(messages) == 1 and "step-\\x1b[2J" in messages[0], messages
    assert "\x1b" not in messages[0]


# ------------------------------------------------- the POSIX storage's own refusals


@pytest.mark.parametrize("path", ["../victim.txt", "step-1/../../victim.txt", "./x", "step-1/./x"])
def test_the_posix_storage_refuses_a_path_that_leaves_or_bends_its_root(tmp_path, path):
    """The POSIX storage refuses a path with a "." or ".." component: none reads, sizes or deletes a
    file outside the root."""
    root = tmp_path / "root"
    (tmp_path / "victim.txt").write_bytes(b"precious")
    (root / "step-1").mkdir(parents=True)
    storage = PosixStorage(str(root))
    for call in (storage.read, storage.size, storage.delete, storage.exists):
        with pytest.raises(ValueError, match="is not a plain path inside the root"):
            call(path)
    assert (tmp_path / "victim.txt").read_bytes() == b"precious"


def test_a_file_where_a_save_stages_is_refused_not_written_through(tmp_path):
    """A regular file at a save's staging name is refused with FileExistsError, not taken for the
    directory another rank made. (Every rank of one save calls begin(): an existing directory is
    fine.)"""
    storage = PosixStorage(str(tmp_path))
    assert storage.begin("step-00000001", "tok") == storage.begin("step-00000001", "tok")
    (tmp_path / ".tmp-step-00000002-tok").write_bytes(b"not a directory")
    with pytest.raises(FileExistsError):
        storage.begin("step-00000002", "tok")


def test_only_directories_under_the_staging_prefixes_are_leftovers(tmp_path):
    """Only directories under the staging prefix are a save's leftovers, never a file whose name
    starts like one."""
    storage = PosixStorage(str(tmp_path))
    staging = storage.begin("step-00000001", "tok")
    (tmp_path / ".tmp-notes.txt").write_bytes(b"someone's file")
    assert storage.uncommitted() == [staging]


def test_a_step_is_never_committed_over_a_file_of_its_name(tmp_path):
    """A step is never committed over a file of its name: the commit fails with the FileExistsError
    that names the file to remove, and the file stays."""
    storage = PosixStorage(str(tmp_path))
    (tmp_path / "step-00000001").write_bytes(b"not a step")
    staging = storage.begin("step-00000001", "tok")
    storage.write(f"{staging}/data", [b"x"])
    with pytest.raises(FileExistsError, match="exists and is not a step directory"):
        storage.commit(staging, "step-00000001", b"{}", MANIFEST_NAME)
    assert (tmp_path / "step-00000001").read_bytes() == b"not a step"


def test_deleting_through_a_planted_link_is_ignored_not_an_error(tmp_path):
    """A path through a planted link counts as absent, and deleting an absent path is no error: the
    link's target stays untouched."""
    root, victim = tmp_path / "root", tmp_path / "victim"
    (victim / "step-00000001").mkdir(parents=True)
    (victim / "step-00000001" / "f").write_bytes(b"precious")
    root.mkdir()
    os.symlink(victim / "step-00000001", root / "step-00000001")
    storage = PosixStorage(str(root))
    storage.delete("step-00000001/f")
    storage.delete("step-00000001")
    assert (victim / "step-00000001" / "f").read_bytes() == b"precious"
    assert os.path.islink(root / "step-00000001")


def test_abort_of_a_staging_name_that_is_a_planted_link_is_ignored(tmp_path):
    """A failed save's clean-up leaves a link planted at its staging name, as every path through a
    link is left, rather than raise over the save's own error."""
    root, victim = tmp_path / "root", tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_bytes(b"precious")
    root.mkdir()
    os.symlink(victim, root / ".tmp-step-00000001-tok")
    PosixStorage(str(root)).abort(".tmp-step-00000001-tok")
    assert (victim / "f").read_bytes() == b"precious"


def test_refused_opens_leave_no_descriptor_and_export_never_writes_through_a_link(
        tmp_path, capsys):
    """The POSIX storage refuses a FIFO or a directory where it reads a file and closes what it
    opened; export creates its temporary file exclusively, never writing through a link planted at
    that name."""
    from verify.cli import main
    from storage_backends import open_storage

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
    os.mkfifo(root / "fifo")
    (root / "a-dir").mkdir()
    storage = open_storage(str(root))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        for name in ("fifo", "a-dir"):
            with pytest.raises(OSError):
                storage.read(name)
    assert len(os.listdir("/proc/self/fd")) == before
    victim = tmp_path / "notes.txt"
    victim.write_text("the user's notes")
    target = tmp_path / "model.pt"
    os.symlink(victim, f"{target}.tmp-{os.getpid()}")  # a predictable temporary name
    assert main(["export", str(root), "--to", "torch", str(target)]) == 0
    assert victim.read_text() == "the user's notes"
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(8))
