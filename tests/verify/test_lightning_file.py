"""``ckpt verify FILE.ckpt`` on a Lightning file written by ``CkptCheckpointIO``: the file is
checked against the step in its hidden sibling root (size; xxh3 of the whole file and of
each zip record) and reported like a step; ``ls`` and ``inspect`` show that step. A file
ckpt did not write, or whose sibling root is missing, is a one-line usage error (exit 2); a
file whose step its root no longer holds fails the ``file`` check (exit 1), as ``verify
--all`` of its folder reports it.

Threat model: whoever can write the folder can put any file there (a FIFO, a link, another
tool's pickle, a file claiming any step) and, if the sibling root is theirs, any digests.
The command never unpickles a file, never blocks on a FIFO, reports a malformed record in
a manifest as a failed check (not a crash), and does not let a sibling root owned by
another user than the file's vouch for it.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("lightning")

import ckpt  # noqa: E402
from trainer.integrations import _pl_file  # noqa: E402
from trainer.integrations.lightning import CkptCheckpointIO  # noqa: E402
from verify.cli import main  # noqa: E402


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def written(tmp_path):
    """Two steps' files written by the plugin, as Lightning calls it: ``ckpts/e{1,2}.ckpt``."""
    io = CkptCheckpointIO()
    for s in (1, 2):
        io.save_checkpoint({"global_step": s, "state_dict": {"w": torch.full((64,), float(s))}},
                           str(tmp_path / "ckpts" / f"e{s}.ckpt"))
    io.teardown()
    return tmp_path / "ckpts"


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_verify_checks_the_file_against_its_step(written, capsys):
    path = written / "e2.ckpt"
    code, out, err = cli(capsys, "verify", path)
    assert code == 0, out + err
    assert out.startswith("step 2: OK (digest: manifest, structure, header, digest, file")
    assert "is the .ckpt file of step 2" in err
    code, out, _ = cli(capsys, "verify", path, "--json")
    step = json.loads(out)["steps"][0]
    assert code == 0 and step["checks"][-1] == "file" and step["bytes"] == path.stat().st_size
    assert str(path) in step["location"]

    record = json.loads(cli(capsys, "inspect", path, "--json")[1])["metadata"][
        "lightning_files"][0]["records"]["archive/data/0"]
    flip(path, record[0] + 5)                            # one bit inside the weight's bytes
    code, out, _ = cli(capsys, "verify", path, "--level", "structure")
    assert code == 0                                     # the size still matches
    code, out, _ = cli(capsys, "verify", path, "--json")
    problem = json.loads(out)["steps"][0]["problems"][0]
    assert code == 1 and problem["check"] == "file" and problem["file"] == str(path)
    assert "record archive/data/0 differ" in problem["message"]
    assert cli(capsys, "verify", written / "e1.ckpt")[0] == 0  # the other file is fine

    data = path.read_bytes()
    path.write_bytes(data[:100] + b"\0" + data[100:])   # a byte more, its claim still last
    code, out, _ = cli(capsys, "verify", path, "--level", "structure")
    assert code == 1 and "its step recorded" in out and "FAILED" in out
    path.write_bytes(data + b"\0")                       # appended to: it names no step now
    code, _, err = cli(capsys, "verify", path)
    assert code == 2 and "appended to" in err

    code, out, _ = cli(capsys, "ls", written / "e1.ckpt")
    assert code == 0 and out.splitlines()[2].split()[0] == "1"
    code, out, _ = cli(capsys, "inspect", written / "e1.ckpt", "--json")
    assert code == 0 and json.loads(out)["step"] == 1


def test_verify_all_of_the_folder_or_its_root_checks_every_file(written, capsys):
    os.link(written / "e2.ckpt", written / "last.ckpt")  # save_last: the same bytes, once
    for path in (written, written.parent / ".ckpts.ckpt"):
        code, out, err = cli(capsys, "verify", "--all", path)
        assert code == 0 and out.count("file checked; 0 tensors in 1 file,") == 2, out
        assert ("reading its steps in" in err) == (path == written)
    flip(written / "e2.ckpt", 1000)
    os.remove(written / "e1.ckpt")
    code, out, _ = cli(capsys, "verify", "--all", written, "--json")
    problems = {s["step"]: s["problems"][0]["message"] for s in json.loads(out)["steps"]}
    assert code == 1 and "no .ckpt file in" in problems[1] and "differ" in problems[2]


def test_a_link_to_a_file_of_the_folder_is_checked_as_that_file(written, capsys):
    os.symlink("e2.ckpt", written / "last.ckpt")         # save_last="link"
    code, out, _ = cli(capsys, "verify", written / "last.ckpt", "--json")
    assert code == 0 and "e2.ckpt (step 2" in json.loads(out)["steps"][0]["location"]


def test_files_ckpt_did_not_write_or_cannot_check_are_one_line_usage_errors(
        written, tmp_path, capsys):
    torch.save({"state_dict": {}}, tmp_path / "own.ckpt")   # Lightning's own IO's file
    (tmp_path / "junk.ckpt").write_bytes(b"hello")
    os.mkfifo(tmp_path / "fifo.ckpt")                         # must not block the command
    for name, says in (("own.ckpt", "torch.save file that names no ckpt step"),
                       ("junk.ckpt", "not a checkpoint ckpt knows"),
                       ("fifo.ckpt", "not a regular file")):
        code, out, err = cli(capsys, "verify", tmp_path / name)
        assert code == 2 and says in err and len(err.splitlines()) == 1, err
        code, out, _ = cli(capsys, "verify", tmp_path / name, "--json")
        assert code == 2 and json.loads(out)["exit_code"] == 2

    root = tmp_path / ".ckpts.ckpt"
    os.chown(root, 4242, 4242)                   # another user's root cannot vouch for it
    code, out, _ = cli(capsys, "verify", written / "e2.ckpt")
    assert code == 2 and "owned by uid 4242" in out and "cannot vouch" in out
    os.chown(root, os.getuid(), os.getgid())

    os.rename(root, tmp_path / "elsewhere")      # ckpts/ moved without its sibling root
    for command in ("verify", "ls", "inspect"):  # a missing root: the environment's error
        code, out, err = cli(capsys, command, written / "e2.ckpt", "--json")
        assert code == 2 and json.loads(out)["exit_code"] == 2, (command, out)
        assert "is the .ckpt file of step 2" in err and "which does not exist" in err, err


def test_a_malformed_record_in_the_step_fails_the_check(tmp_path, capsys):
    """A root whose writer recorded garbage for the file (a hand-made manifest): exit 1
    naming the record, never an internal error."""
    folder = tmp_path / "ckpts"
    folder.mkdir()
    with ckpt.CheckpointManager(str(tmp_path / ".ckpts.ckpt"), async_save=False) as mgr:
        mgr.save(5, {"lightning_file": "x.ckpt"},
                 metadata={"lightning_files": [{"name": "x.ckpt", "bytes": -1, "xxh3": 7,
                                                "records": {"a": "b"}}]})
    tmp, _ = _pl_file.write({"global_step": 5}, str(folder / "x.ckpt"), 5)
    _pl_file.publish(tmp, str(folder / "x.ckpt"))
    code, out, _ = cli(capsys, "verify", folder / "x.ckpt")
    assert code == 1 and "malformed" in out


def test_verify_all_reports_a_file_whose_step_the_root_does_not_hold(written, capsys):
    """A ``.ckpt`` of the folder that names a step the sibling root no longer holds (its
    step folder deleted) cannot be loaded as it is: ``verify --all`` of the folder fails it
    (exit 1) naming the file and why, also when the root holds no step at all."""
    shutil.rmtree(written.parent / ".ckpts.ckpt" / "step-00000001")
    code, out, _ = cli(capsys, "verify", "--all", written)
    assert code == 1 and "step 2: OK" in out, out
    assert "step 1: FAILED" in out and "e1.ckpt names step 1, which" in out
    assert "does not hold" in out and "step folder deleted" in out
    code, out, _ = cli(capsys, "verify", "--all", written.parent / ".ckpts.ckpt", "--json")
    doc = json.loads(out)
    assert code == 1 and [s["status"] for s in doc["steps"]] == ["failed", "ok"]
    assert doc["steps"][0]["problems"][0]["file"] == str(written / "e1.ckpt")
    # The file alone fails the same check with the same status (its state is gone, its
    # root is there: damage), in text and in JSON; ls and inspect refuse it as damaged.
    code, out, _ = cli(capsys, "verify", written / "e1.ckpt")
    assert code == 1 and out.startswith("step 1: FAILED") and "e1.ckpt names step 1" in out
    code, out, _ = cli(capsys, "verify", written / "e1.ckpt", "--json")
    alone = json.loads(out)
    assert code == 1 and alone["exit_code"] == 1 and alone["ok"] is False
    assert alone["steps"][0]["problems"] == doc["steps"][0]["problems"]
    for command in ("ls", "inspect"):
        code, out, err = cli(capsys, command, written / "e1.ckpt", "--json")
        assert code == 1 and json.loads(out)["exit_code"] == 1 and "names step 1" in err

    os.remove(written / "e1.ckpt")             # the file goes: nothing left to report
    os.mkfifo(written / "fifo.ckpt")           # planted: neither blocks nor is reported,
    elsewhere = written.parent / "elsewhere.ckpt"
    _pl_file.publish(_pl_file.write({"global_step": 7}, str(elsewhere), 7)[0], str(elsewhere))
    os.symlink(elsewhere, written / "link.ckpt")  # nor a link is followed out of the folder
    assert cli(capsys, "verify", "--all", written)[0] == 0
    _pl_file.publish(_pl_file.write({"global_step": 9}, str(written / "e9.ckpt"), 9)[0],
                     str(written / "e9.ckpt"))  # a file naming a step never saved here
    os.remove(written / "e2.ckpt")
    shutil.rmtree(written.parent / ".ckpts.ckpt" / "step-00000002")  # the root holds none
    code, out, _ = cli(capsys, "verify", "--all", written)
    assert code == 1 and out.startswith("step 9: FAILED") and "e9.ckpt names step 9" in out


def test_the_place_held_for_a_write_that_died_is_reported_as_such(written, capsys):
    """A killed background write leaves the place it held for its file (an empty archive
    claiming the step): verify names it as that, not as a file whose step was removed, and
    never reads it as a pickle."""
    _pl_file.reserve(str(written / "e3.ckpt"), 3)
    for args in (("verify", written / "e3.ckpt"), ("verify", "--all", written)):
        code, out, err = cli(capsys, *args)
        assert code == 1, out + err
        assert "e3.ckpt holds the place of step 3's file" in out + err
        assert "names step 3" not in out + err
    assert cli(capsys, "verify", written / "e2.ckpt")[0] == 0
