"""What the ``ckpt`` command tells a newcomer when a command cannot run: one line on stderr
(one JSON document with ``--json``), exit 2, saying what failed and what to do instead."""

from __future__ import annotations

import json

import pytest
import torch

import ckpt
from verify.cli import main


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code: int, err: str, command: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith(f"ckpt {command}: "), err
    return lines[-1]


def test_an_s3_url_without_credentials_says_where_to_give_them(capsys, monkeypatch):
    """botocore finds no credentials: the error names its cause and the ways to give them."""
    s3fs = pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance to ask either
    s3fs.S3FileSystem.clear_instance_cache()  # not one made with an earlier test's keys
    try:
        line = one_line(*cli(capsys, "ls", "s3://bucket/run")[::2], "ls")
        code, out, err = cli(capsys, "verify", "s3://bucket/run", "--json")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert "NoCredentialsError" in line and "AWS_ACCESS_KEY_ID" in line, line
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2 and "AWS_PROFILE" in doc["error"]
    assert doc["path"] == "s3://bucket/run"


def test_diff_of_a_root_and_one_step_asks_for_the_second(tmp_path, capsys):
    """``ckpt diff ROOT 1`` (B left out) is not read as a second root named "1"."""
    with ckpt.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    line = one_line(*cli(capsys, "diff", tmp_path / "run", "1")[::2], "diff")
    assert "1 is no path" in line and "ckpt diff ROOT A B" in line, line
    code, out, _ = cli(capsys, "diff", tmp_path / "run", "1", "--json")
    assert code == 2 and "give both" in json.loads(out)["error"]


def test_import_of_a_source_that_is_not_there_says_so(tmp_path, capsys):
    """A missing SOURCE is named as missing, not as "not a DCP checkpoint"; a file is named
    as not a folder; no root is created."""
    for source_format in ("dcp", "hf"):
        line = one_line(*cli(capsys, "import", "--from", source_format, tmp_path / "nowhere",
                             tmp_path / "root")[::2], "import")
        assert "nowhere does not exist" in line, line
    (tmp_path / "notes.txt").write_text("x")
    line = one_line(*cli(capsys, "import", tmp_path / "notes.txt", tmp_path / "root")[::2],
                    "import")
    assert "notes.txt is not a folder" in line, line
    assert not (tmp_path / "root").exists()


def test_a_diff_filter_that_names_nothing_is_refused_not_answered_with_no_difference(
        tmp_path, capsys):
    """``--filter`` mistyped (``model.weight`` for ``model/weight``) would compare nothing
    and report no difference, ``--exit-code`` 0: it is a usage error naming the pattern.
    A pattern that matches a name whose values are equal is no error."""
    with ckpt.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2), "epoch": 1})
        mgr.save(2, {"model": torch.nn.Linear(2, 2), "epoch": 1})
    root = tmp_path / "run"
    line = one_line(*cli(capsys, "diff", root, 1, 2, "--filter", "model.weight",
                         "--filter", "model/*", "--exit-code")[::2], "diff")
    assert "--filter 'model.weight' matches no tensor" in line and "model/*" not in line
    code, out, _ = cli(capsys, "diff", root, 1, 2, "--filter", "epoch", "--exit-code")
    assert code == 0 and "0 values differ" in out
    code, out, _ = cli(capsys, "diff", root, 1, 2, "--filter", "model/w*", "--exit-code")
    assert code == 1 and "model/weight" in out


def test_counts_are_printed_with_the_noun_in_the_singular_for_one(tmp_path, capsys):
    """Every count the command prints agrees with its noun: ``1 tensor in 1 file``, ``1
    value differs``, ``1 alias``, ``2 tensors``."""
    tied = torch.nn.Linear(2, 2, bias=False)
    with ckpt.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(1, {"w": torch.zeros(3), "epoch": 1})
        mgr.save(2, {"w": torch.zeros(3), "epoch": 2})
        mgr.save(3, {"model": {"a": tied.weight, "b": tied.weight}})
    root = tmp_path / "run"
    code, out, _ = cli(capsys, "verify", root, "--step", "1")
    assert code == 0 and "; 1 tensor in 1 file, " in out, out
    code, out, _ = cli(capsys, "inspect", root, "--step", "1")
    assert code == 0 and "  1 tensor  " in out.splitlines()[0], out
    code, out, _ = cli(capsys, "diff", root, 1, 2)
    assert code == 0 and "1 tensor: 1 equal, 0 changed, 0 added, 0 removed; 1 value differs (" \
        in out, out
    code, out, _ = cli(capsys, "export", root, "--to", "torch", tmp_path / "m.pt")
    assert code == 0 and ", 2 tensors, " in out and "\n1 alias (sharing their storage)" in out, out
    code, out, _ = cli(capsys, "gc", root, "--keep-last", "2")
    assert code == 0 and "would remove: 1 step [1], 1 file (" in out, out
