"""The ``ckpt`` command run as a user runs it: ``python -m ckpt ...`` in a subprocess, from
the directory that holds the user's model code. Output is readable, ``--json`` parses, the
exit status is right (0 good, 1 a check failed, 2 usage or environment), and what
``ckpt export`` writes loads with safetensors / ``torch.load(weights_only=True)`` and equals
the checkpoint's tensors.

Each command pays for importing torch (~2 s of CPU here), so only a few representative
commands run in subprocesses, a few at a time (``run_all``); the rest run in-process.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pty
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckpt

REPO = Path(__file__).resolve().parent.parent
USER_MODELS = '''
import torch


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx):
        return self.head(torch.tanh(self.mix(self.embed(idx))))


def build():
    return TiedLM()
'''


@dataclass
class Run:
    args: list[str]
    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


def run_all(cwd: Path, *commands: list[str], parallel: int = 4) -> list[Run]:
    """``python -m ckpt ARGS`` for each command, from ``cwd``, a few at a time."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def one(args: list[str]) -> Run:
        p = subprocess.run([sys.executable, "-m", "ckpt", *map(str, args)], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=120)
        return Run(list(map(str, args)), p.returncode, p.stdout, p.stderr)

    with cf.ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(one, commands))


def make_root(tmp_path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Two steps of the user's tied model with a probe (factory usermodels:build, found in
    the current directory at verify time); returns each step's model tensors."""
    (tmp_path / "usermodels.py").write_text(USER_MODELS)
    sys.path.insert(0, str(tmp_path))
    try:
        import usermodels
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("usermodels", None)
    torch.manual_seed(0)
    model = usermodels.build()
    probe = ckpt.Probe(model_key="model", inputs=torch.randint(0, 50, (3, 7)),
                       factory="usermodels:build")
    saved = {}
    with ckpt.CheckpointManager(tmp_path / "root", probe=probe, async_save=False,
                                options=ckpt.SaveOptions(chunk_bytes=4096)) as mgr:
        for step in (1, 2):
            if step == 2:
                with torch.no_grad():
                    model.mix.weight.mul_(1.5)
            mgr.save(step, {"model": model, "epoch": step})
            saved[step] = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    return saved


@pytest.mark.multiproc
def test_the_command_in_a_terminal_on_a_good_root(tmp_path):
    saved = make_root(tmp_path)
    runs = run_all(
        tmp_path,
        ["--help"],
        ["verify", "root"],
        ["verify", "root", "--all", "--level", "forward", "--json"],
        ["diff", "root", "1", "2", "--json"],
        ["export", "root", "--step", "1", "--to", "safetensors", "out.safetensors"],
        ["export", "root", "--to", "torch", "out.pt", "--item", "model", "--json"],
    )
    for r in runs:
        assert r.code == 0, f"{r.args}: exit {r.code}\n{r.out}\n{r.err}"
    help_, verify_, verify_all, diff_json, export_st, export_pt = runs

    assert "exit status:" in help_.out and "2  usage or environment error" in help_.out
    for command in ("ls", "inspect", "verify", "diff", "export", "gc"):
        assert f"  ckpt {command} /ckpt/run1" in help_.out, command  # an example of each
    assert verify_.out.startswith("step 2: OK (digest:"), verify_.out
    doc = verify_all.json()
    assert doc["ok"] and doc["exit_code"] == 0 and [s["step"] for s in doc["steps"]] == [1, 2]
    # the probe's recorded factory, imported from the current directory
    assert all(s["forward"]["factory"] == "usermodels:build" for s in doc["steps"])

    tensors = {t["key"]: t for t in diff_json.json()["tensors"]}
    mix = tensors["model/mix.weight"]
    expected = (saved[2]["model/mix.weight"] - saved[1]["model/mix.weight"]).abs()
    assert mix["status"] == "changed"
    assert mix["max_abs_diff"] == pytest.approx(float(expected.max()))
    assert mix["rel_l2"] == pytest.approx(0.5)  # ||1.5 w - w|| / ||w||
    assert tensors["model/embed.weight"]["status"] == "equal"

    from safetensors import safe_open
    from safetensors.torch import load_file

    assert "wrote" in export_st.out and "model/head.weight -> model/embed.weight" in export_st.out
    loaded = load_file(tmp_path / "out.safetensors")
    assert "model/head.weight" not in loaded  # tied: stored once ...
    with safe_open(tmp_path / "out.safetensors", "pt") as f:  # ... and recorded
        assert json.loads(f.metadata()["ckpt_aliases"]) == {
            "model/head.weight": "model/embed.weight"}
    for key, value in saved[1].items():
        if key != "model/head.weight":
            assert torch.equal(loaded[key], value), key
    with ckpt.CheckpointManager(tmp_path / "root", read_only=True) as mgr:
        assert set(loaded) == set(mgr.manifest(1).tensors)  # every tensor key, probe's too

    assert export_pt.json()["aliases"] == {"head.weight": "embed.weight"}
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(state) == sorted(k.removeprefix("model/") for k in saved[2])
    for key, value in saved[2].items():
        assert torch.equal(state[key.removeprefix("model/")], value), key
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()


def flip_a_bit_of(tmp_path: Path, key: str = "model/mix.weight") -> Path:
    """Flip one bit in step 2's first chunk of ``key``; returns the damaged file."""
    manifest = json.loads((tmp_path / "root/step-00000002/manifest.json").read_bytes())
    chunk = manifest["tensors"][key]["chunks"][0]
    path = tmp_path / "root/step-00000002" / chunk["file"]
    raw = bytearray(path.read_bytes())
    raw[chunk["start"] + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.multiproc
def test_the_command_in_a_terminal_exits_1_on_damage_and_2_on_a_missing_root(tmp_path):
    make_root(tmp_path)
    path = flip_a_bit_of(tmp_path)
    corrupt, missing = run_all(tmp_path, ["verify", "root", "--all", "--json"],
                               ["verify", "nowhere"])
    doc = corrupt.json()
    assert corrupt.code == 1 and doc["exit_code"] == 1 and doc["ok"] is False
    assert [s["status"] for s in doc["steps"]] == ["ok", "failed"]
    problem, = doc["steps"][1]["problems"]
    assert problem["check"] == "digest" and problem["file"] == str(path)
    assert "digest mismatch in model/mix.weight" in problem["message"]
    assert missing.code == 2 and missing.out == ""
    assert "ckpt verify: checkpoint root nowhere does not exist" in missing.err


# ------------------------------------------------- the same commands in-process (cheaper)


def cli(capsys, *args) -> tuple[int, str, str]:
    from ckpt.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_inspect_gc_and_diff_read_well_and_their_json_parses(tmp_path, capsys):
    make_root(tmp_path)
    root = tmp_path / "root"
    code, out, _ = cli(capsys, "ls", root)
    assert code == 0 and out.splitlines()[0].split()[:3] == ["STEP", "CREATED", "SIZE"]
    assert [ln.split()[0] for ln in out.splitlines()[2:]] == ["1", "2"]
    code, out, _ = cli(capsys, "inspect", root, "--step", "1")
    assert code == 0 and "model/head.weight -> model/embed.weight (same storage)" in out
    code, out, _ = cli(capsys, "diff", root, "1", "2")
    assert code == 0
    assert next(ln for ln in out.splitlines() if ln.startswith("model/mix.weight")).split()[1] \
        == "changed"
    assert "model/embed.weight" not in out  # equal tensors are only counted ...
    assert "3 equal, 2 changed, 0 added, 0 removed" in out  # ... here (+ the probe output)
    assert "epoch: 1 -> 2" in out
    for args in (["ls", root], ["inspect", root], ["gc", root], ["diff", root, 1, 2],
                 ["verify", root, "--all", "--level", "structure"]):
        code, out, _ = cli(capsys, *args, "--json")
        assert code == 0 and isinstance(json.loads(out), dict), args


def test_usage_errors_exit_2_and_damage_exits_1(tmp_path, capsys):
    make_root(tmp_path)
    root = tmp_path / "root"
    path = flip_a_bit_of(tmp_path)
    code, out, err = cli(capsys, "verify", root)
    assert code == 1 and out.startswith("step 2: FAILED"), out
    assert f"  - digest: {path}: digest mismatch in model/mix.weight" in out
    code, out, err = cli(capsys, "diff", root, 1, 2, "--json")
    assert code == 1 and json.loads(out)["exit_code"] == 1 and "digest mismatch" in err
    code, out, err = cli(capsys, "export", root, "--to", "safetensors", tmp_path / "bad.st")
    assert code == 1 and "digest mismatch" in err
    assert not list(tmp_path.glob("bad.st*"))  # nothing half-written is left
    code, out, err = cli(capsys, "export", root, "--step", 1, "--to", "torch", tmp_path /
                         "usermodels.py")
    assert code == 2 and "--force" in err
    code, out, err = cli(capsys, "diff", root, 1, 9)
    assert code == 2 and "no committed step 9" in err
    code, out, err = cli(capsys, "verify", tmp_path / "nowhere", "--json")
    assert code == 2 and json.loads(out)["ok"] is False
    code, out, err = cli(capsys, "verify", root, "--level", "sideways")
    assert code == 2 and "invalid choice" in err


@pytest.mark.multiproc
def test_the_digest_progress_bar_is_drawn_on_a_terminal(tmp_path):
    make_root(tmp_path)
    main, secondary = pty.openpty()  # stderr is a terminal, stdout is not
    try:
        p = subprocess.run([sys.executable, "-m", "ckpt", "verify", "root"], cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                           stderr=secondary, text=True, timeout=120)
        os.close(secondary)
        secondary = -1
        drawn = b""
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: the other end is closed
                break
            if not data:
                break
            drawn += data
    finally:
        os.close(main)
        if secondary != -1:
            os.close(secondary)
    assert p.returncode == 0, p.stdout
    assert b"step 2 [" in drawn and b"100.0%" in drawn, drawn
    assert "[" not in p.stdout.splitlines()[0].split("(")[0]  # the report stays clean
