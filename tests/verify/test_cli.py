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
import contextlib
import json
import os
import pty
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt._format.sealed import reseal, sealed_json
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]
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
    with ckpt.CheckpointManager(tmp_path / "root", async_save=False,
                                options=ckpt.SaveOptions(chunk_bytes=4096, probe=probe)) as mgr:
        for step in (1, 2):
            if step == 2:
                with torch.no_grad():
                    model.mix.weight.mul_(1.5)
            mgr.save(step, {"model": model, "epoch": step})
            saved[step] = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    return saved


@pytest.mark.multiproc
def test_the_command_in_a_terminal_on_a_good_root(tmp_path, capsys):
    """Two commands as the user runs them (the probe's model code imported from the current
    directory, a relative output path), in subprocesses; the others in-process meanwhile
    (each subprocess pays for importing torch)."""
    saved = make_root(tmp_path)
    with cf.ThreadPoolExecutor(1) as pool:
        terminal = pool.submit(
            run_all, tmp_path,
            ["verify", "root", "--all", "--level", "forward", "--trust-recorded", "--json"],
            ["export", "root", "--step", "1", "--to", "safetensors", "out.safetensors"])
        root = tmp_path / "root"
        here = [Run(list(map(str, args)), *cli(capsys, *args)) for args in (
            ["--help"], ["verify", root], ["diff", root, "1", "2", "--json"],
            ["export", root, "--to", "torch", tmp_path / "out.pt", "--item", "model",
             "--json"])]
        verify_all, export_st = terminal.result()
    for r in (*here, verify_all, export_st):
        assert r.code == 0, f"{r.args}: exit {r.code}\n{r.out}\n{r.err}"
    help_, verify_, diff_json, export_pt = here

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
    from verify.cli import main

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


# ------------------------------------------- any checkpoint: a root, a step dir, a ckpt.save dir


class Position:
    """A sampler-like stateful object: how many batches were consumed."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def training_state(seed: int = 0, steps: int = 3, lr: float = 1e-3) -> dict:
    """A model with its AdamW, a LambdaLR scheduler, a CPU GradScaler and a data position,
    after ``steps`` optimizer steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {"model": model, "optim": opt, "sched": sched, "data": Position(17 * steps),
            "scaler": torch.amp.GradScaler("cpu", init_scale=1024.0), "epoch": 1}


def test_ls_inspect_verify_and_export_take_a_ckpt_save_directory(tmp_path, capsys):
    ckpt.save(training_state(), tmp_path / "out", step=7)
    out_dir = tmp_path / "out"
    code, out, err = cli(capsys, "ls", out_dir)
    assert code == 0, err
    rows = out.splitlines()[2:]
    assert len(rows) == 1 and rows[0].split()[0] == "7" and rows[0].endswith("committed")

    code, out, err = cli(capsys, "inspect", out_dir)
    assert code == 0, err
    assert "step 7" in out.splitlines()[0]
    # the saved values of the stateful items: learning rate, scheduler step, data position,
    # scaler scale (AdamW's lr after 3 LambdaLR steps: 1e-3 * 0.5**3)
    assert "  optim/param_groups/0/lr: 0.000125" in out.splitlines()
    assert "  sched/last_epoch: 3" in out.splitlines()
    assert "  data/position: 51" in out.splitlines()
    assert "  scaler/scale: 1024.0" in out.splitlines()
    assert "  epoch: 1" in out.splitlines()
    code, out, _ = cli(capsys, "inspect", out_dir, "--json")
    doc = json.loads(out)
    assert doc["state"]["sched"]["_step_count"] == 4
    assert doc["state"]["optim"]["param_groups/0/lr"] == pytest.approx(1.25e-4)
    assert doc["parameter_names"]["optim"] == {"0": "0.weight", "1": "0.bias",
                                               "2": "2.weight", "3": "2.bias"}

    code, out, err = cli(capsys, "verify", out_dir)
    assert code == 0 and out.startswith("step 7: OK (digest:"), (out, err)
    code, out, err = cli(capsys, "export", out_dir, "--to", "torch", tmp_path / "m.pt",
                         "--item", "model")
    assert code == 0, err
    assert sorted(torch.load(tmp_path / "m.pt", weights_only=True)) == [
        "0.bias", "0.weight", "2.bias", "2.weight"]
    code, out, err = cli(capsys, "gc", out_dir)  # a root's command: says so
    assert code == 2 and "one checkpoint directory, not a root" in err


def test_verify_and_inspect_take_one_step_directory_of_a_root(tmp_path, capsys):
    make_root(tmp_path)
    flip_a_bit_of(tmp_path)  # step 2 is damaged, step 1 is not
    code, out, _ = cli(capsys, "verify", tmp_path / "root/step-00000001")
    assert code == 0 and out.startswith("step 1: OK")
    code, out, _ = cli(capsys, "verify", tmp_path / "root/step-00000002")
    assert code == 1 and out.startswith("step 2: FAILED")
    code, out, err = cli(capsys, "inspect", tmp_path / "root/step-00000001", "--step", 2)
    assert code == 2 and "has no committed step 2; it has [1]" in err
    code, out, _ = cli(capsys, "ls", tmp_path / "root/step-00000001", "--json")
    assert [s["step"] for s in json.loads(out)["steps"]] == [1]


def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two roots (two runs from one seed, the second with a higher learning rate)."""
    for name, lr in (("run1", 1e-3), ("run2", 2e-3)):
        state = training_state(lr=lr)
        with ckpt.CheckpointManager(tmp_path / name, async_save=False) as mgr:
            mgr.save(3, state)
    return tmp_path / "run1", tmp_path / "run2"


def test_diff_of_two_roots_names_optimizer_state_by_parameter_and_filters(tmp_path, capsys):
    run1, run2 = two_runs(tmp_path)
    code, out, err = cli(capsys, "diff", run1, run2, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["root"], doc["other"], doc["a"], doc["b"]) == (str(run1), str(run2), 3, 3)
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model/0.weight"]["status"] == "changed"  # another lr: other weights
    assert tensors["optim/state/0/exp_avg"]["name"] == "optim/state/0.weight/exp_avg"
    assert tensors["optim/state/3/exp_avg_sq"]["name"] == "optim/state/2.bias/exp_avg_sq"
    values = {v["path"]: (v["a"], v["b"]) for v in doc["values"]}
    assert values["optim/param_groups/0/lr"] == (pytest.approx(1.25e-4), pytest.approx(2.5e-4))

    code, out, err = cli(capsys, "diff", run1, run2, "--filter", "*/2.weight/*")
    assert code == 0, err
    rows = [ln.split()[0] for ln in out.splitlines() if ln.startswith("optim/")]
    assert rows == ["optim/state/2.weight/exp_avg", "optim/state/2.weight/exp_avg_sq"]
    assert "model/" not in out and "lr" not in out  # filtered out
    assert "3 tensors: 1 equal, 2 changed" in out  # exp_avg, exp_avg_sq; step is equal
    code, out, _ = cli(capsys, "diff", run1, run2, "--filter", "model/*", "--json")
    assert {t["key"] for t in json.loads(out)["tensors"]} == {
        "model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias"}
    code, out, err = cli(capsys, "diff", run1, run2, "--step-a", 9)
    assert code == 2 and "no committed step 9" in err


# ---------------------------------------------------------------------------------- gc


def root_of_steps(tmp_path: Path, steps=(1, 2, 3, 4)) -> Path:
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in steps:
            mgr.save(step, {"w": torch.full((64,), float(step)), "step": step})
    return root


def test_every_json_document_says_ok_and_its_exit_code(tmp_path, capsys):
    """Every subcommand's one JSON document carries ``ok`` (status 0) and ``exit_code`` (the
    status), whatever the command did, so a script reads one shape."""
    root = root_of_steps(tmp_path, steps=(1, 2))
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(3, {"w": torch.full((64,), 9.0), "step": 3})  # differs from step 2
    commands = [["ls", root], ["inspect", root], ["verify", root, "--all"],
                ["diff", root, 1, 2], ["diff", root, 2, 3, "--exit-code"],
                ["export", root, "--to", "safetensors", tmp_path / "w.safetensors"],
                ["export", root, "--to", "dcp", tmp_path / "dcp"],
                ["import", tmp_path / "dcp", tmp_path / "imported"],
                ["gc", root, "--keep-last", "1"], ["gc", "--memory", "--job", "nojob"],
                ["ls", tmp_path / "nowhere"]]
    seen = set()
    for args in commands:
        code, out, err = cli(capsys, *args, "--json")
        doc = json.loads(out)
        assert doc["exit_code"] == code and doc["ok"] is (code == 0), (args, out, err)
        seen.add(code)
    assert seen == {0, 1, 2}


def test_gc_on_a_root_whose_newest_manifest_is_broken_prints_its_own_line_only(tmp_path):
    """gc reports a step whose manifest it cannot read itself: the library's log line about
    the policy record it could not read there is not printed before gc's one-line error
    (nor in a dry run that goes on, where gc lists the step as failing)."""
    root = root_of_steps(tmp_path, steps=(1, 2, 3))
    (root / "step-00000003/manifest.json").write_text("garbage")
    stopped, listed = run_all(tmp_path, ["gc", "root"],
                              ["gc", "root", "--keep-best", "1", "--best-metric", "loss"])
    assert stopped.code == 1 and stopped.out == "", stopped
    assert stopped.err.startswith("ckpt gc: ") and len(stopped.err.splitlines()) == 1, stopped
    assert "manifest is not valid JSON" in stopped.err
    assert listed.code == 0 and listed.err == "", listed
    assert "step 3 does not verify: manifest:" in listed.out


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/manifest.json"))


def test_gc_rejects_a_negative_keep_last_and_keep_last_0_keeps_only_the_newest_good_step(
        tmp_path, capsys):
    root = root_of_steps(tmp_path)
    code, out, err = cli(capsys, "gc", root, "--keep-last", "-2", "--yes")
    assert code == 2 and "--keep-last: must be 0 or more, not -2" in err
    assert committed(root) == [1, 2, 3, 4]
    code, out, err = cli(capsys, "gc", root, "--keep-every", "2", "--yes")
    assert code == 2 and "give both" in err
    code, out, err = cli(capsys, "gc", root, "--keep-last", "0", "--keep-every", "2", "--yes")
    assert code == 0, err
    assert committed(root) == [2, 4]  # every 2nd step, and the newest that verifies
    code, out, err = cli(capsys, "gc", root, "--keep-last", "0", "--yes")
    assert code == 0 and committed(root) == [4]


def flip_chunk_of(root: Path, step: int, key: str = "w") -> None:
    step_dir = root / f"step-{step:08d}"
    chunk = json.loads((step_dir / "manifest.json").read_bytes())["tensors"][key]["chunks"][0]
    path = step_dir / chunk["file"]
    raw = bytearray(path.read_bytes())
    raw[chunk["start"] + 5] ^= 0x01
    path.write_bytes(bytes(raw))


def test_gc_keeps_the_newest_step_that_verifies_when_the_newest_is_corrupt(tmp_path, capsys):
    root = root_of_steps(tmp_path)
    flip_chunk_of(root, 4)
    code, out, err = cli(capsys, "gc", root, "--keep-last", "1")  # dry run
    assert code == 0, err
    assert "step 4 does not verify: digest:" in out
    assert "would remove: 2 steps [1, 2]" in out and "kept step 3 too" in out
    code, out, err = cli(capsys, "gc", root, "--keep-last", "1", "--yes", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["retired_steps"] == [1, 2] and doc["newest_good"] == 3
    assert committed(root) == [3, 4]
    state = {"w": torch.zeros(64), "step": None}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(state) == 3  # something good is left to fall back to
    assert torch.equal(state["w"], torch.full((64,), 3.0))

    flip_chunk_of(root, 3)  # now no step verifies: nothing is retired
    code, out, err = cli(capsys, "gc", root, "--keep-last", "1", "--yes")
    assert code == 1 and "no committed step verifies, so none was retired" in out
    assert committed(root) == [3, 4]


def root_with_an_old_best_step(tmp_path: Path) -> Path:
    """Steps 1..5 by a writer keeping the last 2 and the best 1 by val_loss: step 1 is the
    best, so the writer keeps 1, 4 and 5."""
    from ckpt._retention.policy import KeepBest, RetentionPolicy

    root = tmp_path / "root"
    policy = RetentionPolicy(keep_last=2, keep_best=KeepBest(1, "val_loss"))
    with ckpt.CheckpointManager(root, async_save=False, retention=policy) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": torch.full((64,), float(step))},
                     metrics={"val_loss": 0.1 if step == 1 else 1.0 + step})
    assert committed(root) == [1, 4, 5]
    return root


def test_gc_keep_last_keeps_the_best_step_the_writers_recorded_policy_keeps(tmp_path, capsys):
    """gc follows the policy the writer recorded in its manifests; --keep-last replaces only
    that rule, so the step kept for its best val_loss stays."""
    root = root_with_an_old_best_step(tmp_path)
    code, out, err = cli(capsys, "gc", root, "--keep-last", "1", "--yes")
    assert code == 0, err
    assert committed(root) == [1, 5]
    assert out.startswith("policy: keep_last=1, keep_best=1 by val_loss (min), and the newest "
                          "good step (recorded in step 5; --keep-last given)"), out


def test_gc_flags_replace_or_drop_recorded_rules_and_ignore_recorded_drops_them_all(
        tmp_path, capsys):
    root = root_with_an_old_best_step(tmp_path)
    code, out, err = cli(capsys, "gc", root, "--json")  # the writer's own policy: nothing to do
    doc = json.loads(out)
    assert code == 0 and doc["retired_steps"] == [] and doc["policy"] == {
        "keep_last": 2, "keep_every": None, "source": "recorded in step 5",
        "keep_best": {"n": 1, "metric": "val_loss", "mode": "min"}}
    code, out, err = cli(capsys, "gc", root, "--keep-best", "2", "--best-mode", "max",
                         "--json")  # the recorded metric, ranked the other way
    doc = json.loads(out)
    assert doc["policy"]["keep_best"] == {"n": 2, "metric": "val_loss", "mode": "max"}
    assert doc["retired_steps"] == [1]
    code, out, err = cli(capsys, "gc", root, "--keep-best", "0", "--json")
    assert json.loads(out)["retired_steps"] == [1] and committed(root) == [1, 4, 5]
    code, out, err = cli(capsys, "gc", root, "--ignore-recorded", "--keep-last", "1", "--yes")
    assert code == 0 and committed(root) == [5], err
    assert "policy: keep_last=1, and the newest good step (--keep-last given)" in out


def test_gc_refuses_rules_it_cannot_apply(tmp_path, capsys):
    root = root_of_steps(tmp_path)  # a writer keeping every step: no policy recorded
    code, out, err = cli(capsys, "gc", root, "--keep-best", "1", "--yes")
    one_line_exit_2(code, err, "gc", "--keep-best needs --best-metric NAME")
    code, out, err = cli(capsys, "gc", root, "--best-metric", "loss", "--yes")
    one_line_exit_2(code, err, "gc", "--best-metric and --best-mode are for --keep-best N")
    code, out, err = cli(capsys, "gc", root, "--keep-best", "1", "--best-metric", "loss")
    assert code == 0 and "keep_best=1 by loss (min)" in out  # no step has it: none ranks
    assert "would remove: 3 steps [1, 2, 3]" in out
    record = root / "step-00000004" / "manifest.json"
    doc = json.loads(record.read_bytes())
    doc["metadata"]["ckpt_retention"] = {"keep_last": 1, "keep_newest": 2}
    record.write_bytes(sealed_json(doc))
    code, out, err = cli(capsys, "gc", root, "--keep-last", "1", "--yes")
    assert code == 1 and "step 4 records a retention policy ckpt cannot apply" in err, err
    assert committed(root) == [1, 2, 3, 4]


def one_line_exit_2(code: int, err: str, command: str, needle: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"ckpt {command}: "), err
    assert needle in err.strip().splitlines()[-1], err


def test_environment_errors_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a checkpoint")
    code, out, err = cli(capsys, "gc", a_file, "--yes")
    one_line_exit_2(code, err, "gc", "is not a directory")
    code, out, err = cli(capsys, "gc", a_file)  # the dry run too
    one_line_exit_2(code, err, "gc", "is not a directory")
    assert a_file.read_text() == "not a checkpoint"
    code, out, err = cli(capsys, "ls", "nosuch://bucket/run")
    one_line_exit_2(code, err, "ls", "no storage backend for 'nosuch://bucket/run'")
    code, out, err = cli(capsys, "verify", "gs://bucket/run", "--json")
    one_line_exit_2(code, err, "verify", "gcsfs")
    assert json.loads(out)["exit_code"] == 2
    # an S3 endpoint nobody listens on (the port of a socket bound but never listening)
    import socket

    s3fs = pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
        s3fs.S3FileSystem.clear_instance_cache()  # not one cached by an earlier test's server
        try:
            code, out, err = cli(capsys, "gc", "s3://bucket/run", "--yes")
        finally:  # fsspec caches the file system, endpoint included: later tests need theirs
            s3fs.S3FileSystem.clear_instance_cache()
    one_line_exit_2(code, err, "gc", "Could not connect to the endpoint URL")


@contextlib.contextmanager
def as_nobody():
    """Run the block as an unprivileged user when the tests run as root (root ignores file
    permissions)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_gc_yes_under_a_live_writer_names_its_host_and_pid_and_deletes_nothing(
        tmp_path, capsys):
    import socket

    root = root_of_steps(tmp_path)
    with ckpt.CheckpointManager(root):  # a live writer holds the lock
        code, out, err = cli(capsys, "gc", root, "--keep-last", "1", "--yes", "--json")
    one_line_exit_2(code, err, "gc", f"in use by a writer (host {socket.gethostname()}, "
                    f"pid {os.getpid()}, since 20")
    assert "stop that job first" in err
    assert json.loads(out)["exit_code"] == 2
    assert committed(root) == [1, 2, 3, 4]


def test_gc_on_a_read_only_root_is_one_line_and_exit_2(tmp_path, capsys):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ckpt-ro-"))  # readable by another user
    try:
        base.chmod(0o755)
        root = root_of_steps(base, steps=(1, 2))
        root.chmod(0o555)
        with as_nobody():
            code, out, err = cli(capsys, "gc", root, "--keep-last", "1", "--yes")
            dry = cli(capsys, "gc", root, "--keep-last", "1")
        one_line_exit_2(code, err, "gc", "needs write access")
        assert dry[0] == 0 and "would remove: 1 step [1]" in dry[1]  # reading is fine
        assert committed(root) == [1, 2]
    finally:
        root.chmod(0o755)
        shutil.rmtree(base)


def test_verify_all_checks_every_step_when_one_cannot_be_read(tmp_path, capsys):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ckpt-perm-"))  # readable by another user
    try:
        base.chmod(0o755)
        root = root_of_steps(base, steps=(1, 2, 3))
        for path in root.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        unreadable = next((root / "step-00000002").glob("data-*"))
        unreadable.chmod(0o000)
        with as_nobody():
            code, out, err = cli(capsys, "verify", root, "--all")
            doc = cli(capsys, "verify", root, "--all", "--json")
            diff = cli(capsys, "diff", root, 1, 2, "--json")
        one_line_exit_2(diff[0], diff[2], "diff", "check the path and its permissions")
        assert json.loads(diff[1])["path"] == str(unreadable)
        assert code == 2 and "Traceback" not in err, err
        lines = out.splitlines()
        assert lines[0].startswith("step 1: OK") and lines[-1].startswith("step 3: OK"), out
        assert "step 2: NOT VERIFIED" in out and str(unreadable) in out
        assert "permissions" in out
        assert doc[0] == 2
        status = {s["step"]: s["status"] for s in json.loads(doc[1])["steps"]}
        assert status == {1: "ok", 2: "error", 3: "ok"}
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("created", ["NaN", "1e300", "-1e300"])
def test_ls_shows_an_absurd_creation_time_instead_of_crashing(tmp_path, capsys, created):
    root = root_of_steps(tmp_path, steps=(1,))
    manifest = root / "step-00000001/manifest.json"
    manifest.write_bytes(reseal(manifest.read_text().replace(
        f'"created":{json.loads(manifest.read_text())["created"]!r}', f'"created":{created}'
    ).encode()))
    assert created in manifest.read_text()
    code, out, err = cli(capsys, "ls", root)
    assert code == 0, err
    assert "invalid" in out.splitlines()[2]
    code, out, err = cli(capsys, "ls", root, "--json")
    assert code == 0 and json.loads(out)["steps"][0]["status"] == "committed"


def test_threads_is_bounded_and_verify_starts_no_more_threads_than_chunks(
        tmp_path, capsys, monkeypatch):
    import concurrent.futures as cf

    import verify.integrity

    root = root_of_steps(tmp_path, steps=(1,))  # one chunk
    code, out, err = cli(capsys, "verify", root, "--threads", "99999999999999999999")
    assert code == 2 and "--threads: must be at most 256" in err
    started = []

    class Pool(cf.ThreadPoolExecutor):
        def __init__(self, max_workers=None, *args, **kwargs):
            started.append(max_workers)
            super().__init__(max_workers, *args, **kwargs)

    monkeypatch.setattr(verify.integrity.cf, "ThreadPoolExecutor", Pool)
    code, out, err = cli(capsys, "verify", root, "--threads", "256")
    assert code == 0 and out.startswith("step 1: OK"), err
    assert started == [1]  # a thread (and its chunk buffer) per chunk at most


def test_forward_options_are_checked_and_a_failing_loss_function_is_named(
        tmp_path, capsys, monkeypatch):
    make_root(tmp_path)
    root = tmp_path / "root"
    for option, value in (("--rtol", "-1"), ("--atol", "nan"), ("--rtol", "inf"),
                          ("--atol", "abc")):
        code, out, err = cli(capsys, "verify", root, "--level", "forward",
                             "--trust-recorded", option, value)
        assert code == 2 and f"{option}: must be a finite number >= 0, not {value}" in err
    code, out, err = cli(capsys, "gc", root, "--keep-last", "x")
    assert code == 2 and "--keep-last: must be a whole number, not 'x'" in err
    (tmp_path / "userloss.py").write_text(
        "def broken(output, inputs):\n    raise ZeroDivisionError('loss exploded')\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "verify", root, "--level", "forward",
                         "--trust-recorded", "--loss",
                         "userloss:broken")
    assert code == 2, out
    assert "! the loss function userloss:broken raised ZeroDivisionError: loss exploded" \
        in out and "forward pass" not in out
    sys.modules.pop("userloss", None)


def test_diff_checks_sizes_before_sizing_buffers_from_a_hostile_manifest(tmp_path, capsys):
    root = root_of_steps(tmp_path, steps=(1, 2))
    n = 10**12  # a 4 TB chunk "in" a file of a few hundred bytes, sizes recorded to match
    for step, digest in ((1, "a" * 16), (2, "b" * 16)):
        path = root / f"step-{step:08d}/manifest.json"
        m = json.loads(path.read_text())
        entry = m["tensors"]["w"]
        chunk = entry["chunks"][0]
        entry["shape"] = chunk["shape"] = [n]
        chunk["length"], chunk["digest"] = 4 * n, digest
        m["files"][chunk["file"]] = chunk["start"] + 4 * n
        path.write_bytes(sealed_json(m))
    code, out, err = cli(capsys, "diff", root, 1, 2, "--json")
    assert code == 1 and "Traceback" not in err
    assert "the manifest recorded 4000000000" in json.loads(out)["error"]


def test_a_framework_pointer_is_followed_to_its_step(tmp_path, capsys):
    from ckpt._step.pointer import POINTER_NAME, write_pointer

    root = root_of_steps(tmp_path, steps=(1, 2))
    write_pointer(str(root / "last.ckpt"), 2)  # Lightning
    write_pointer(str(root / "checkpoint-1" / POINTER_NAME), 1)  # HF, Accelerate
    write_pointer(str(root / "checkpoint-3" / POINTER_NAME), 3)  # its save never committed
    code, out, err = cli(capsys, "ls", root / "last.ckpt", "--json")
    assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == [2], err
    assert f"points to step 2: reading {root / 'step-00000002'}" in err
    code, out, err = cli(capsys, "verify", root / "checkpoint-1")
    assert code == 0 and out.startswith("step 1: OK"), err
    code, out, err = cli(capsys, "inspect", root / "checkpoint-3")
    one_line_exit_2(code, err, "inspect", f"points to step 3 of {root}, which is not committed")


def test_options_that_do_not_apply_are_refused_not_ignored(tmp_path, capsys):
    root = root_of_steps(tmp_path, steps=(1, 2))
    for args, needle in (
            (["gc", "--memory", root, "--yes"], "gc --memory collects shared-memory segments"),
            (["gc", "--memory", "--keep-last", "1", "--yes"], "takes no ROOT or --keep-last"),
            (["gc", root, "--keep-last", "0", "--job", "j", "--yes"], "--job is for gc --memory"),
            (["export", root, "--to", "torch", tmp_path / "m.pt", "--max-shard-size", "5GB"],
             "--max-shard-size is for --to hf")):
        code, out, err = cli(capsys, *args, "--json")
        one_line_exit_2(code, err, args[0], needle)
        assert json.loads(out)["exit_code"] == 2
    assert committed(root) == [1, 2] and not (tmp_path / "m.pt").exists()


def test_verify_all_on_a_live_root_skips_a_step_its_writer_retires_midway(
        tmp_path, capsys, monkeypatch):
    import verify

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, keep_last=2, async_save=False,
                                options=ckpt.SaveOptions(chunk_bytes=4096)) as writer:
        for step in (1, 2):  # 16 chunks each
            writer.save(step, {"w": torch.full((16384,), float(step))})

        def progress(total: int, label: str):  # made after step 1's manifest was read
            if label == "step 1":
                writer.save(3, {"w": torch.full((16384,), 3.0)})  # retires step 1
            return lambda nbytes: None

        monkeypatch.setattr(verify, "ProgressBar", progress)
        code, out, err = cli(capsys, "verify", root, "--all")
    assert committed(root) == [2, 3]
    assert code == 0, out + err
    assert out.splitlines() == [ln for ln in out.splitlines() if ln.startswith("step 2: OK")]
    assert "skipped step 1, no longer committed: no committed checkpoint at" in err


def test_a_step_retired_while_verify_reads_it_is_not_reported_as_damaged(tmp_path):
    import verify

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, keep_last=2, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"w": torch.full((64,), float(step))})
        cps = ckpt.inspect.open(str(root))
        files = cps.files

        def files_then_retire(step, manifest):  # the manifest is read, no data file yet
            if 3 not in writer.steps():  # once (files are listed more than once)
                writer.save(3, {"w": torch.full((64,), 3.0)})  # retires step 1
            return files(step, manifest)

        cps.files = files_then_retire
        with pytest.raises(ckpt.CheckpointNotFoundError, match="step 1 of .* was retired "
                           r"\(deleted by its writer's retention\) while it was being checked"):
            verify.verify_step(cps, 1, "digest")
    assert committed(root) == [2, 3]


def test_a_gc_dry_run_passes_over_a_step_its_writer_retires_while_it_is_checked(tmp_path):
    from ckpt._retention.gc import collect_root
    from ckpt._retention.policy import RetentionPolicy
    from verify._gc import digest_check

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, retention=RetentionPolicy(keep_last=1, keep_every=2),
                                async_save=False) as writer:
        for step in (1, 2, 3):
            writer.save(step, {"w": torch.full((64,), float(step))})
        assert committed(root) == [2, 3]
        cps = ckpt.inspect.open(str(root))
        files = cps.files

        def files_then_retire(step, manifest):
            if step == 3 and 4 not in writer.steps():
                writer.save(4, {"w": torch.full((64,), 4.0)})  # retires step 3
            return files(step, manifest)

        cps.files = files_then_retire
        # A dry run (the writer keeps its lock), by keep_last alone: not the writer's policy.
        result = collect_root(cps.storage, RetentionPolicy(keep_last=1),
                              check=digest_check(cps, threads=4))
    assert committed(root) == [2, 4]
    assert result.newest_good == 2 and result.failed == {} and result.ok


def test_ls_on_a_live_root_leaves_out_a_step_retired_after_the_listing(tmp_path, capsys,
                                                                       monkeypatch):
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, keep_last=2, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"w": torch.full((64,), float(step))})
        steps = ckpt.inspect.Checkpoints.steps

        def steps_then_retire(self):
            listed = steps(self)
            writer.save(3, {"w": torch.full((64,), 3.0)})  # retires step 1
            return listed

        monkeypatch.setattr(ckpt.inspect.Checkpoints, "steps", steps_then_retire)
        code, out, err = cli(capsys, "ls", root)
    assert code == 0, err
    assert [ln.split()[0] for ln in out.splitlines()[2:]] == ["2"], out  # not "1 ... bad"


def test_a_probe_recorded_from_a_training_script_names_what_to_pass(tmp_path, capsys,
                                                                     monkeypatch):
    make_root(tmp_path)  # usermodels.py in tmp_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodels

    def my_loss(output, inputs):
        return output.float().pow(2).mean()

    my_loss.__module__, my_loss.__qualname__ = "__main__", "my_loss"  # as in train.py
    inputs = torch.randint(0, 50, (3, 7))
    for name, factory in (("script-loss", "usermodels:build"), ("script-factory",
                                                                "__main__:build")):
        probe = ckpt.Probe(model_key="model", inputs=inputs, factory=factory, loss_fn=my_loss)
        with ckpt.CheckpointManager(tmp_path / name, options=ckpt.SaveOptions(probe=probe),
                                    async_save=False) as mgr:
            mgr.save(1, {"model": usermodels.build()})
    sys.modules.pop("usermodels", None)
    code, out, err = cli(capsys, "verify", tmp_path / "script-loss", "--level", "forward",
                         "--trust-recorded")
    assert code == 0, out + err  # the weights and the output were checked
    assert ("recorded, not rechecked (the probe's recorded loss "
            "function: __main__:my_loss was defined in the training script, so it cannot be "
            "imported here; pass --loss module.path:callable)") in out, out
    code, out, err = cli(capsys, "verify", tmp_path / "script-factory", "--level", "forward",
                         "--trust-recorded")
    assert code == 2
    assert ("! the probe's recorded factory: __main__:build was defined in the training "
            "script, so it cannot be imported here; pass --model module.path:callable") in out
    code, out, err = cli(capsys, "verify", tmp_path / "script-factory", "--level", "forward",
                         "--model", "usermodels:build", "--loss", "nosuch:f")
    assert code == 2 and "cannot import 'nosuch' for --loss 'nosuch:f'" in out
    sys.modules.pop("usermodels", None)


def test_export_into_a_folder_it_cannot_write_names_the_target(tmp_path, capsys):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ckpt-export-"))  # readable by another user
    try:
        base.chmod(0o755)
        root = root_of_steps(base, steps=(1,))
        for path in root.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        closed = base / "closed"
        closed.mkdir(mode=0o555)
        target = closed / "model.safetensors"
        with as_nobody():
            code, out, err = cli(capsys, "export", root, "--to", "safetensors", target,
                                 "--json")
            hf = cli(capsys, "export", root, "--to", "hf", closed / "hf", "--item", "w")
        one_line_exit_2(code, err, "export",
                        f"cannot write {target}: Permission denied in {closed}")
        one_line_exit_2(hf[0], hf[2], "export",
                        f"cannot write {closed / 'hf'}: Permission denied in {closed}")
        assert json.loads(out)["exit_code"] == 2 and list(closed.iterdir()) == []
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("field,value,why", [
    ("output", 0, "its recorded output is a int, not a tensor"),
    ("loss", "low", "its recorded loss is a str, not a number")])
def test_a_hand_edited_probe_is_a_failed_check_not_a_traceback(tmp_path, capsys, monkeypatch,
                                                                field, value, why):
    make_root(tmp_path)
    monkeypatch.chdir(tmp_path)
    manifest = tmp_path / "root/step-00000002/manifest.json"
    doc = json.loads(manifest.read_text())
    doc["items"]["__probe__"]["tree"][field] = value
    manifest.write_bytes(sealed_json(doc))
    code, out, err = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                         "--trust-recorded")
    assert code == 1, out + err
    assert f"  - output: {manifest.parent}: the probe item is damaged: {why}" in out
    sys.modules.pop("usermodels", None)


def test_inspect_shows_the_metrics_saved_with_a_step_and_no_empty_value_line(tmp_path, capsys):
    with ckpt.CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2)}, metrics={"val_loss": 0.25})
    code, out, err = cli(capsys, "inspect", tmp_path / "root")
    assert code == 0, err
    values = out.split("saved values:\n")[1].splitlines()
    assert values == ["  metadata/metrics/val_loss: 0.25"], out  # no "  : {}" line either


def test_export_force_replaces_only_a_regular_file(tmp_path, capsys):
    import stat

    root = root_of_steps(tmp_path, steps=(1,))
    kept = tmp_path / "kept.pt"
    kept.write_text("the user's file")
    link = tmp_path / "link.pt"
    link.symlink_to(kept)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target, needle in ((tmp_path, "is a directory: give the path of the file"),
                           (link, "is not a regular file"), (fifo, "is not a regular file")):
        code, out, err = cli(capsys, "export", root, "--to", "torch", target, "--force")
        one_line_exit_2(code, err, "export", needle)
    assert link.is_symlink() and kept.read_text() == "the user's file"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    code, out, err = cli(capsys, "export", root, "--to", "torch", kept, "--force")
    assert code == 0, err  # a regular file is replaced, as asked
    assert torch.equal(torch.load(kept, weights_only=True)["w"], torch.full((64,), 1.0))


def test_ls_gives_the_whole_reason_a_step_is_bad_with_its_path(tmp_path, capsys):
    root = root_of_steps(tmp_path / "a-long-directory-name-that-fills-a-table-column", (1, 2))
    manifest = root / "step-00000001/manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # truncated
    code, out, err = cli(capsys, "ls", root)
    assert code == 0, err
    rows = out.splitlines()
    assert rows[2].split()[0] == "1" and rows[2].split()[-1] == "(below)"
    assert rows[3].split()[-1] == "committed"
    assert rows[4].startswith(f"step 1: bad: {manifest}: manifest is not valid JSON"), out
    (root / "step-00000002/manifest.json").write_text("{")  # now the newest is bad too
    code, out, err = cli(capsys, "inspect", root)
    assert code == 1 and err.startswith("ckpt inspect: ") and err.strip().endswith(
        "`ckpt verify --all` tells which steps are good and --step N picks one"), err


@pytest.mark.s3
def test_a_step_directory_on_s3_is_one_checkpoint_too(request, capsys, monkeypatch):
    endpoint = request.getfixturevalue("s3")
    with ckpt.CheckpointManager(endpoint.root("run"), async_save=False,
                                storage_options=endpoint.storage_options) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((8,), float(step)), "step": step})
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.url)
    step_1 = f"{endpoint.root('run')}/step-00000001"
    code, out, err = cli(capsys, "ls", step_1, "--json")
    assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == [1], err
    code, out, err = cli(capsys, "verify", step_1)
    assert code == 0 and out.startswith("step 1: OK"), err
    code, out, err = cli(capsys, "diff", step_1, endpoint.root("run"), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["a"], doc["b"]) == (1, 2)  # the directory's step against the root's newest
    assert {v["path"]: (v["a"], v["b"]) for v in doc["values"]} == {"step": (1, 2)}


def test_a_fifo_or_directory_planted_as_a_checkpoint_file_is_damage_not_a_hang(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: `ckpt ls` (and every reader)
    must report a FIFO in a manifest's place as damage, by name, instead of hanging; the POSIX
    storage refuses a FIFO or a directory where it reads a file, naming it."""
    from storage_backends import open_storage

    make_root(tmp_path)
    root = tmp_path / "root"
    fifo_manifest = root / "step-00000002" / "manifest.json"
    fifo_manifest.unlink()
    os.mkfifo(fifo_manifest)
    (ls,) = run_all(tmp_path, ["ls", "root", "--json"])
    bad = {r["step"]: r["status"] for r in ls.json()["steps"]}
    assert "not a regular file" in bad[2] and "manifest.json" in bad[2], ls.out
    assert bad[1] == "committed"
    storage = open_storage(str(root))
    (root / "a-dir").mkdir()
    for name, what in (("step-00000002/manifest.json", "not a regular file"),
                       ("a-dir", "a directory")):
        with pytest.raises(OSError, match=what) as caught:
            storage.read(name)
        assert caught.value.filename == str(root / name)


HOSTILE_KEY = "\ud800\x1b]0;pwned\x07\x1b[2J\u202etxt.exe\u200b"


def test_hostile_names_in_a_manifest_are_printed_escaped_and_a_closed_pipe_is_quiet(tmp_path,
                                                                                    capsys):
    """A tensor key holding a lone surrogate made `ckpt inspect` and `ckpt diff` die with a
    UnicodeEncodeError traceback, and terminal escapes in names reached the terminal raw. A
    reader that closes the pipe early (`| head -1`) got 'BrokenPipeError ... check the path
    and its permissions' and status 2."""
    make_root(tmp_path)
    root = tmp_path / "root"
    path = root / "step-00000002" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["aliases"][HOSTILE_KEY] = "model/mix.weight"
    doc["metadata"][HOSTILE_KEY] = HOSTILE_KEY
    path.write_bytes(sealed_json(doc))
    # The closed pipes need processes of their own: started first, checked last.
    procs = []
    for args in (["ls", "root"], ["verify", "root", "--all", "--json"]):
        p = subprocess.Popen([sys.executable, "-m", "ckpt", *args], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()  # before the command (which starts by importing torch) writes
        procs.append((args, p))
    # The names in-process: capsys's stdout encodes strictly as UTF-8, as a terminal's does
    # (a lone surrogate printed raw raises UnicodeEncodeError there too).
    inspect_, diff, as_json = (Run(list(map(str, args)), *cli(capsys, *args)) for args in (
        ["inspect", root], ["diff", root, "1", "2"], ["inspect", root, "--json"]))
    for r in (inspect_, diff):
        assert r.code == 0 and not r.err, (r.args, r.err)
        assert not {"\x1b", "\u202e", "\x07", "\u200b"} & set(r.out)
        assert "\\ud800\\x1b]0;pwned\\x07\\x1b[2J\\u202etxt.exe\\u200b" in r.out, r.out
    assert as_json.json()["aliases"][HOSTILE_KEY] == "model/mix.weight"  # JSON: exact
    for args, p in procs:
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and err == "", (args, err)


def test_an_empty_path_is_a_usage_error_not_the_current_directory(tmp_path, capsys,
                                                                   monkeypatch):
    """`ckpt gc "$ROOT" --yes` with ROOT unset collected the current directory."""
    from verify.cli import main

    make_root(tmp_path)
    monkeypatch.chdir(tmp_path / "root")
    (tmp_path / "root" / ".tmp-step-00000003-0123456789ab").mkdir()
    for args in (["gc", "", "--yes"], ["ls", " "], ["verify", ""]):
        assert main(args) == 2
        assert "PATH is empty" in capsys.readouterr().err
    assert (tmp_path / "root" / ".tmp-step-00000003-0123456789ab").is_dir()


def test_a_tensor_named_metadata_is_refused_by_safetensors_exports_and_kept_by_torch(tmp_path,
                                                                                   capsys):
    """A state dict may hold a tensor named '__metadata__'; exporting it to safetensors wrote
    that tensor's entry over the header's metadata: a file no safetensors reader opens."""
    from verify.cli import main

    ckpt.save({"model": {"__metadata__": torch.ones(3), "w": torch.zeros(2)}}, tmp_path / "c")
    for to, out in (("safetensors", "o.safetensors"), ("hf", "hf")):
        assert main(["export", str(tmp_path / "c"), "--to", to, str(tmp_path / out),
                     "--item", "model"]) == 2
        assert "'__metadata__'" in capsys.readouterr().err
        assert not (tmp_path / out).exists()
    assert main(["export", str(tmp_path / "c"), "--to", "torch", str(tmp_path / "o.pt"),
                 "--item", "model"]) == 0
    assert torch.equal(torch.load(tmp_path / "o.pt", weights_only=True)["__metadata__"],
                       torch.ones(3))


def test_a_bug_is_one_line_and_one_json_document_and_ctrl_c_is_quiet(tmp_path, capsys,
                                                                      monkeypatch):
    """The last line of defence of 'never a traceback': an exception nobody expected (here a
    bug planted in the listing) is reported in one line with exit status 3, naming it and
    where it was raised; CKPT_TRACEBACK=1 shows it whole."""
    from verify import cli

    make_root(tmp_path)
    root = str(tmp_path / "root")

    def bug(storage):
        raise ValueError("planted bug")

    monkeypatch.setattr("ckpt.inspect.committed_steps", bug)
    assert cli.main(["ls", root, "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out) == {"ok": False, "exit_code": 3, "path": None, "error": err.strip()[
        len("ckpt ls: "):]}
    assert err.count("\n") == 1 and "ValueError: planted bug (in test_cli.py:" in err, err
    assert "CKPT_TRACEBACK=1" in err
    monkeypatch.setenv("CKPT_TRACEBACK", "1")
    with pytest.raises(ValueError, match="planted bug"):
        cli.main(["ls", root])

    def interrupted(storage):
        raise KeyboardInterrupt

    monkeypatch.setattr("ckpt.inspect.committed_steps", interrupted)
    assert cli.main(["verify", root]) == 130
    assert capsys.readouterr().err == "ckpt verify: interrupted\n"


# ------------------------------------------ lock owners, export targets, verify options


def test_an_odd_lock_owner_file_still_gives_one_line_naming_the_lock(tmp_path, capsys):
    """``gc --yes`` on a root a live writer holds names the holder, as the manager's refusal does,
    in one line without a traceback: an owner file whose "since" is no time says "an unknown time",
    one that is no JSON object names no holder."""
    from verify.cli import main

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as writer:
        writer.save(1, {"w": torch.zeros(4)})
        for owner, needle in (('{"host": "h", "pid": 7, "since": "yesterday"}',
                               "(host h, pid 7, since an unknown time)"),
                              ("[1, 2]", "(an unknown process)")):
            (root / ".lock.owner").write_text(owner)
            assert main(["gc", str(root), "--keep-last", "1", "--yes"]) == 2
            err = capsys.readouterr().err
            assert f"is in use by a writer {needle}" in err and "Traceback" not in err, err
            with pytest.raises(ckpt.CheckpointLockedError) as caught:  # the same words
                ckpt.CheckpointManager(root)
            assert f"locked by another writer {needle}" in str(caught.value)
    assert (root / "step-00000001" / "manifest.json").exists()


def test_export_refuses_a_dangling_link_and_tolerances_may_be_zero(tmp_path, capsys):
    """A dangling symbolic link where the export goes is refused, not replaced, even though no file
    lies behind it; ``--rtol 0 --atol 0`` (an exact check) is accepted."""
    from verify.cli import build_parser, main

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
    link = tmp_path / "out.pt"
    link.symlink_to(tmp_path / "missing.pt")
    assert main(["export", str(root), "--to", "torch", str(link)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert link.is_symlink() and not (tmp_path / "missing.pt").exists()
    args = build_parser().parse_args(["verify", str(root), "--rtol", "0", "--atol", "0"])
    assert (args.rtol, args.atol) == (0.0, 0.0)


def test_a_loss_function_that_returns_no_number_is_named(tmp_path, capsys, monkeypatch):
    """``verify --loss`` with a function that returns text blames that function, not the forward
    pass of the model."""
    import sys

    from verify.cli import main

    make_root(tmp_path)
    (tmp_path / "userloss3.py").write_text("def text(output, inputs):\n    return 'low'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        code = main(["verify", str(tmp_path / "root"), "--level", "forward", "--trust-recorded",
                     "--loss", "userloss3:text"])
    finally:
        sys.modules.pop("userloss3", None)
    out = capsys.readouterr().out
    assert code == 2 and "the loss function userloss3:text raised ValueError" in out, out
    assert "forward pass" not in out


def test_forward_level_names_a_bool_loss_and_a_bad_model_option(tmp_path, capsys,
                                                                      monkeypatch):
    """``verify --level forward`` on a hand-edited probe: a recorded loss of ``true`` is no number;
    a bad ``--model`` is named as the user's error, not the recorded factory's."""
    import json

    from verify.cli import main

    make_root(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "root"
    manifest = root / "step-00000002" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["items"]["__probe__"]["tree"]["loss"] = True
    manifest.write_bytes(sealed_json(doc))
    code = main(["verify", str(root), "--level", "forward", "--trust-recorded", "--step", "2"])
    out = capsys.readouterr().out
    assert code == 1 and "the probe item is damaged: its recorded loss is a bool" in out, out
    assert main(["verify", str(root), "--level", "forward", "--step", "1",
                 "--model", "usermodels:no_such_builder"]) == 2
    out = capsys.readouterr().out
    assert "--model" in out and "no_such_builder" in out and "recorded factory" not in out, out
