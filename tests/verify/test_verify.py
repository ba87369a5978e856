"""``ckpt verify`` (and the verify library): every injected fault is found, with exit status 1
and a message naming the file and the check; good checkpoints of every kind pass; the
forward level catches what bytes cannot (NaN weights, a model that computes differently);
``restore`` falls back past a corrupt newest step and training resumes from the one before.

Each fault is injected into a fresh checkpoint (``tmp_path``). The command runs in-process
here (``verify.cli.main``); tests/verify/test_cli.py runs it as a user would, in a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt._format.sealed import sealed_json
import verify
from tests.support.verify_workers import Net
from verify.cli import main as cli_main

OPTIONS = ckpt.SaveOptions(chunk_bytes=4096, write_threads=2)  # several chunks and files
FACTORY = "tests.support.verify_workers:build_net"


def cli(capsys, *args) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def probe(loss_fn=None) -> ckpt.Probe:
    return ckpt.Probe(model_key="model", inputs=torch.randn(5, 8, generator=torch.Generator()
                                                             .manual_seed(9)),
                      factory=FACTORY, loss_fn=loss_fn)


def save(root: Path, step: int = 1, *, net: Net | None = None, with_probe: bool = True,
         options: ckpt.SaveOptions = OPTIONS, **kw) -> dict:
    """Save a state with several chunks of several dtypes in two data files."""
    g = torch.Generator().manual_seed(step)
    state = {"model": net if net is not None else make_net(),
             "w": torch.randn(64, 64, generator=g),
             "half": torch.randn(40, 30, generator=g).to(torch.bfloat16),
             "ids": torch.arange(300, dtype=torch.int64) * step,
             "epoch": step}
    options = dataclasses.replace(options, probe=probe() if with_probe else None)
    with ckpt.CheckpointManager(root, options=options, async_save=False, **kw) as mgr:
        mgr.save(step, state, force=True)
    return state


def manifest_of(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_bytes())


def data_files(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("data-*.safetensors"))


def assert_names(text: str, path: Path | str, check: str) -> None:
    """The report names the damaged file and the failed check."""
    name = Path(path).name
    lines = [ln for ln in text.splitlines() if name in ln]
    assert lines, f"{name} not named in:\n{text}"
    assert any(f"- {check}: " in ln for ln in lines), f"check {check!r} not named in:\n{text}"


# ------------------------------------------------------------------ good checkpoints pass


KINDS = {
    "plain": {},
    "compressed": {"options": ckpt.SaveOptions(chunk_bytes=4096, write_threads=2,
                                               compression="zstd")},
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_good_checkpoint_passes_every_level(tmp_path, capsys, kind):
    save(tmp_path / "root", **KINDS[kind])
    for level in verify.LEVELS:
        trust = ["--trust-recorded"] if level == "forward" else []
        code, out, err = cli(capsys, "verify", tmp_path / "root", "--level", level, *trust)
        assert code == 0, out + err
        assert "step 1: OK" in out
    assert "forward: model tests.support.verify_workers:build_net" in out
    report = verify.verify(str(tmp_path / "root"), level="forward", trust_recorded=True)
    assert report.ok and report.problems == [] and report.error is None
    assert report.checks == ["manifest", "structure", "header", "digest", "weights", "output"]
    assert report.forward["max_abs_diff"] == 0.0  # the same machine: bit-identical rerun


def test_an_incremental_chain_passes_every_step(tmp_path, capsys):
    root = tmp_path / "root"
    net = make_net()
    options = dataclasses.replace(OPTIONS, incremental=True, probe=probe())
    with ckpt.CheckpointManager(root, options=options, async_save=False) as mgr:
        for step in range(1, 5):
            with torch.no_grad():
                net.fc2.bias.add_(1.0)  # fc1 and w never change: their chunks are reused
            mgr.save(step, {"model": net, "w": torch.ones(64, 64), "epoch": step})
    reused = [c for e in manifest_of(root / "step-00000004")["tensors"].values()
              for c in e["chunks"] if "step" in c]
    assert reused, "the chain reuses no chunk: the test would prove nothing"
    code, out, err = cli(capsys, "verify", root, "--all", "--level", "forward", "--trust-recorded")
    assert code == 0, out + err
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("step")] == [
        f"step {s}" for s in range(1, 5)]


# ------------------------------------------------------------------------ bit flips


def flip(path: Path, position: int, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[position] ^= 1 << bit
    path.write_bytes(bytes(raw))


def data_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize("seed", range(40))
def test_one_flipped_bit_anywhere_in_a_data_file_is_found(tmp_path, capsys, seed):
    """Even seeds flip in the safetensors header (length prefix included), odd ones in the
    chunk bytes; every third checkpoint is compressed."""
    rng = random.Random(seed)
    options = KINDS["compressed"]["options"] if seed % 3 == 0 else OPTIONS
    save(tmp_path / "root", options=options, with_probe=False)
    path = rng.choice(data_files(tmp_path / "root" / "step-00000001"))
    start, size = data_start(path), path.stat().st_size
    position = rng.randrange(0, start) if seed % 2 == 0 else rng.randrange(start, size)
    flip(path, position, rng.randrange(8))

    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "digest")

    assert code == 1, f"flip at byte {position} of {path.name} not found:\n{out}"
    assert_names(out, path, "header" if position < start else "digest")
    structure, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "structure")
    assert structure == (1 if position < start else 0), out  # structure reads no chunk bytes


def test_a_flip_in_the_header_length_is_found_by_the_structure_level(tmp_path, capsys):
    save(tmp_path / "root", with_probe=False)
    path = data_files(tmp_path / "root" / "step-00000001")[0]
    flip(path, 6, 3)  # a high byte of the length: it now points past the end of the file
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "structure")
    assert code == 1
    assert_names(out, path, "header")
    assert "does not fit the file" in out


# ------------------------------------------------------------- truncated, missing files


def test_a_truncated_data_file_is_found(tmp_path, capsys):
    save(tmp_path / "root")
    path = data_files(tmp_path / "root" / "step-00000001")[1]
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "structure")
    assert code == 1
    assert_names(out, path, "structure")
    assert "truncated" in out


def test_a_missing_data_file_is_found(tmp_path, capsys):
    save(tmp_path / "root")
    path = data_files(tmp_path / "root" / "step-00000001")[0]
    path.unlink()
    code, out, _ = cli(capsys, "verify", tmp_path / "root")
    assert code == 1
    assert_names(out, path, "structure")
    assert "is missing" in out


# --------------------------------------------------------------------- edited manifests


def _chunks(doc: dict) -> list[dict]:
    chunks = doc["tensors"]["w"]["chunks"]
    assert len(chunks) >= 3
    return chunks


def _wrong_shape(doc: dict) -> None:
    doc["tensors"]["w"]["shape"] = [64, 32]


def _wrong_offset(doc: dict) -> None:
    _chunks(doc)[1]["offsets"][0] += 1


def _overlap(doc: dict) -> None:
    _chunks(doc)[1]["offsets"][0] -= 1


def _parent_path(doc: dict) -> None:
    _chunks(doc)[0]["file"] = "../../etc/passwd"


def _absurd_file_size(doc: dict) -> None:
    doc["files"] = {k: 2**62 for k in doc["files"]}


def _absurd_length(doc: dict) -> None:
    _chunks(doc)[0]["length"] = 2**60


def _absurd_shape(doc: dict) -> None:
    doc["tensors"]["w"]["shape"] = [2**40, 2**40]


REJECTED = {"wrong_shape": _wrong_shape, "wrong_offset": _wrong_offset, "overlap": _overlap,
            "parent_path": _parent_path, "absurd_file_size": _absurd_file_size,
            "absurd_length": _absurd_length, "absurd_shape": _absurd_shape}




@pytest.mark.parametrize("kind", list(REJECTED))
def test_an_edited_manifest_is_rejected_before_any_data_file_is_opened(
        tmp_path, capsys, storage_reads, kind):
    save(tmp_path / "root")
    step_dir = tmp_path / "root" / "step-00000001"
    doc = manifest_of(step_dir)
    REJECTED[kind](doc)
    (step_dir / "manifest.json").write_bytes(sealed_json(doc))
    storage_reads.clear()

    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded")

    assert code == 1, out
    assert_names(out, step_dir / "manifest.json", "manifest")
    assert "invalid manifest" in out
    assert storage_reads and all(p.endswith("manifest.json") for p in storage_reads), storage_reads


def _moved_start(doc: dict) -> None:
    _chunks(doc)[0]["start"] += 8  # still inside the file, still valid JSON


def _swapped_starts(doc: dict) -> None:
    a, b = _chunks(doc)[:2]
    a["start"], b["start"] = b["start"], a["start"]


@pytest.mark.parametrize("edit", [_moved_start, _swapped_starts])
def test_a_manifest_pointing_at_the_wrong_bytes_is_found_by_the_structure_level(
        tmp_path, capsys, edit):
    save(tmp_path / "root")
    step_dir = tmp_path / "root" / "step-00000001"
    doc = manifest_of(step_dir)
    edit(doc)
    (step_dir / "manifest.json").write_bytes(sealed_json(doc))
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "structure")
    assert code == 1, out
    damaged = {c["file"] for c in _chunks(doc)[:2]}
    found = [ln for ln in out.splitlines() if any(n in ln for n in damaged)]
    # the header disagrees, or (a chunk moved past the end) the byte range does not fit
    assert any(ln.startswith(("  - header: ", "  - structure: ")) for ln in found), out


# ----------------------------------------------------------------------- forward level


def test_nan_and_inf_weights_fail_the_forward_level_naming_the_tensors(tmp_path, capsys):
    net = make_net()
    with torch.no_grad():
        net.fc1.weight[40, 3] = float("nan")
        net.fc2.bias[1] = float("inf")
    save(tmp_path / "root", net=net)

    digest, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "digest")
    assert digest == 0, out  # the bytes are exactly what was saved: only forward sees it
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded")

    assert code == 1, out
    doc = manifest_of(tmp_path / "root" / "step-00000001")
    for key, what in (("model/fc1.weight", "1 NaN and 0 Inf"), ("model/fc2.bias", "0 NaN and 1 Inf")):
        line = next(ln for ln in out.splitlines() if key in ln)
        assert line.startswith("  - weights: ") and what in line, line
        chunk = next(c for c in doc["tensors"][key]["chunks"]
                     if c["offsets"][0] <= (40 if "fc1" in key else 1)
                     < c["offsets"][0] + c["shape"][0])
        assert chunk["file"] in line, line
    assert "- output: " in out and "NaN/Inf" in out


def test_forward_without_a_probe_exits_2_saying_how_to_record_one(tmp_path, capsys):
    save(tmp_path / "root", with_probe=False)
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded")
    assert code == 2, out
    assert "no probe" in out and "ckpt.Probe(" in out
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2 and doc["steps"][0]["status"] == "error"


def test_a_corrupt_step_without_a_probe_still_exits_1(tmp_path, capsys):
    save(tmp_path / "root", with_probe=False)
    data_files(tmp_path / "root" / "step-00000001")[0].unlink()
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded")
    assert code == 1, out


@pytest.mark.parametrize("factory, code, needle", [
    ("tests.support.verify_workers:build_scaled", 1, "- output: "),  # 1% off: a real difference
    ("tests.support.verify_workers:build_nudged", 0, "step 1: OK"),  # 1e-6 relative: tolerated
    ("tests.support.verify_workers:build_wider", 2, "does not fit step 1"),
    ("tests.support.verify_workers:no_such_thing", 2, "has no 'no_such_thing'"),
    ("no_such_module_xyz:build", 2, "cannot import 'no_such_module_xyz'"),
    ("not a spec", 2, "module.path:callable"),
])
def test_forward_with_another_model_factory(tmp_path, capsys, factory, code, needle):
    save(tmp_path / "root")
    got, out, err = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                        "--model", factory)
    assert got == code, out + err
    assert needle in out + err


def test_forward_imports_the_factory_from_the_current_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "models_in_cwd_7f3a.py").write_text(
        "from tests.support.verify_workers import Net\n\ndef build():\n    return Net()\n")
    save(tmp_path / "root")
    monkeypatch.chdir(tmp_path)
    code, out, _ = cli(capsys, "verify", "root", "--level", "forward", "--model",
                       "models_in_cwd_7f3a:build")
    assert code == 0, out
    assert "model models_in_cwd_7f3a:build" in out


def test_forward_rechecks_a_recorded_loss(tmp_path, capsys):
    from tests.support.verify_workers import mse_loss

    local_loss = lambda output, inputs: mse_loss(output, inputs)  # noqa: E731  (not nameable)
    with ckpt.CheckpointManager(tmp_path / "root",
                                options=ckpt.SaveOptions(probe=probe(local_loss)),
                                async_save=False) as mgr:
        mgr.save(1, {"model": make_net()})
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded")
    assert code == 0 and "not rechecked" in out, out  # no loss function to recompute it
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded",
                       "--loss", "tests.support.verify_workers:mse_loss", "--json")
    step = json.loads(out)["steps"][0]
    assert code == 0 and "loss" in step["checks"]
    assert step["forward"]["loss_now"] == pytest.approx(step["forward"]["loss_recorded"])
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded",
                       "--loss", "tests.support.verify_workers:doubled_loss")
    assert code == 1 and "- loss: " in out, out


def test_forward_uses_a_loss_function_the_probe_names(tmp_path, capsys):
    """A probe item that names its loss function (``"loss_fn": "module:callable"``) is
    rechecked without --loss; written by hand here, as ckpt.Probe records no name yet."""
    from ckpt._load.probe import run_forward
    from tests.support.verify_workers import mse_loss

    net, inputs = make_net(), torch.randn(5, 8)
    output, loss = run_forward(net, inputs, mse_loss)
    item = {"model_key": "model", "inputs": inputs, "output": output, "loss": loss * 1.5,
            "factory": FACTORY, "loss_fn": "tests.support.verify_workers:mse_loss", "finite": True}
    with ckpt.CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        mgr.save(1, {"model": net, "__probe__": item})
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded")
    assert code == 1 and "- loss: " in out, out  # recorded 1.5x what it is: found


def test_bf16_outputs_get_the_bf16_tolerance(tmp_path):
    assert verify.tolerance_for(torch.bfloat16) > verify.tolerance_for(torch.float16) > (
        verify.tolerance_for(torch.float32))
    net = make_net().to(torch.bfloat16)
    p = ckpt.Probe(inputs=torch.randn(5, 8).to(torch.bfloat16),
                   factory="tests.support.verify_workers:build_bf16")
    with ckpt.CheckpointManager(tmp_path / "root", options=ckpt.SaveOptions(probe=p),
                                async_save=False) as mgr:
        mgr.save(1, {"model": net})
    report = verify.verify(str(tmp_path / "root"), level="forward", trust_recorded=True)
    assert report.ok, report.problems
    assert report.forward["output_dtype"] == "bfloat16"
    assert (report.forward["rtol"], report.forward["atol"]) == verify.tolerance_for(torch.bfloat16)


# ------------------------------------------------------------------------- usage errors


def test_missing_root_and_step_exit_2(tmp_path, capsys):
    code, out, err = cli(capsys, "verify", tmp_path / "nope")
    assert code == 2 and "does not exist" in err
    save(tmp_path / "root")
    code, out, err = cli(capsys, "verify", tmp_path / "root", "--step", "5", "--json")
    assert code == 2 and "no committed step 5" in err
    doc = json.loads(out)
    assert (doc["ok"], doc["exit_code"]) == (False, 2) and "no committed step 5" in doc["error"]
    code, _, err = cli(capsys, "verify", tmp_path / "root", "--model", FACTORY)
    assert code == 2 and "--level forward" in err


# --------------------------------------------------------------- restore falls back


def train_step(model: Net, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def weights(model: Net) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_restore_falls_back_past_a_corrupt_newest_step_and_training_resumes(
        tmp_path, capsys, caplog, one_thread):
    root = tmp_path / "root"
    model = make_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = {}
    with ckpt.CheckpointManager(root, options=OPTIONS, async_save=False) as mgr:
        for step in range(1, 5):
            train_step(model, opt, step)
            reference[step] = weights(model)
            mgr.save(step, {"model": model, "optim": opt, "step": step})
    doc = manifest_of(root / "step-00000004")
    chunk = doc["tensors"]["model/fc1.weight"]["chunks"][0]
    flip(root / "step-00000004" / chunk["file"], chunk["start"] + 17, 5)

    code, out, _ = cli(capsys, "verify", root, "--all")
    assert code == 1
    assert [ln.split(" (")[0] for ln in out.splitlines() if ln.startswith("step")] == [
        "step 1: OK", "step 2: OK", "step 3: OK", "step 4: FAILED"]
    assert_names(out, chunk["file"], "digest")

    model, opt = make_net(7), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optim": opt, "step": 0}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with ckpt.CheckpointManager(root, options=OPTIONS, async_save=False) as mgr:
            assert mgr.restore(state) == 3
            assert [s for s, _ in mgr.skipped] == [4]
            for k, v in reference[3].items():
                assert torch.equal(model.state_dict()[k], v), k
            train_step(model, opt, 4)  # resume: step 4 again, from step 3's weights and momentum
            for k, v in reference[4].items():
                assert torch.equal(model.state_dict()[k], v), k
            mgr.save(4, {"model": model, "optim": opt, "step": 4})  # replaces the bad step 4
    assert any("ckpt.restore skipping step=4" in r.getMessage() and chunk["file"] in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    code, out, _ = cli(capsys, "verify", root, "--all")
    assert code == 0, out


# ------------------------------------------------------------------------- the library


def test_the_library_returns_reports_and_renders_them(tmp_path):
    save(tmp_path / "root")
    data_files(tmp_path / "root" / "step-00000001")[0].unlink()
    save(tmp_path / "root", step=2)
    bad = verify.verify(str(tmp_path / "root"), 1, "digest")
    good = verify.verify(str(tmp_path / "root"), level="digest")
    assert (bad.ok, good.ok, good.step) == (False, True, 2)
    assert [p.check for p in bad.problems] == ["structure"] and bad.problems[0].file
    report = verify.Report(str(tmp_path / "root"), [bad, good])
    assert report.exit_code == 1
    doc = json.loads(verify.to_json(report.to_dict()))
    assert [s["status"] for s in doc["steps"]] == ["failed", "ok"]
    assert doc["steps"][0]["problems"][0]["file"] == bad.problems[0].file
    assert "step 1: FAILED" in verify.render_verify(report)


# ------------------------------------------------------------------- a sharded checkpoint


@pytest.mark.multiproc
def test_a_sharded_checkpoint_verifies_diffs_and_exports_whole(tmp_path, capsys):
    """Two gloo ranks save DTensor shards (uneven), a replicated model and per-rank RNG
    state (tests/support/sharded_workers.py); verify finds nothing wrong, diff against a one-rank
    save of the same values finds them equal although the chunks are cut differently, and
    export writes the full tensors."""
    from tests.support.ranks import run_ranks
    from tests.support.sharded_workers import global_tensors, make_model, save_world

    root = tmp_path / "root"
    run_ranks(2, save_world, str(root), 7)
    full = global_tensors()
    with ckpt.CheckpointManager(root, async_save=False) as mgr:  # step 8: the same values,
        mgr.save(8, {**full, "scalar": torch.tensor(2.5), "model": make_model(0),  # one rank
                     "epoch": 5})
    doc = manifest_of(root / "step-00000007")
    assert doc["world_size"] == 2 and len({n.split("-")[-2] for n in doc["files"]}) == 2

    code, out, _ = cli(capsys, "verify", root, "--all")
    assert code == 0, out
    code, out, _ = cli(capsys, "diff", root, 7, 8, "--json")
    assert code == 0, out
    diff = {t["key"]: t for t in json.loads(out)["tensors"]}
    for key in full:
        assert diff[key]["status"] == "equal", diff[key]
    cps = ckpt.inspect.open(root)  # step 7 keeps its chunks in rank tables (format 2)
    assert ([(c.offsets, c.shape) for c in cps.manifest(7).tensors["row"].chunks]
            != [(c.offsets, c.shape) for c in cps.manifest(8).tensors["row"].chunks]
            )  # compared across different cuts, not by digest

    from safetensors.torch import load_file

    code, out, _ = cli(capsys, "export", root, "--step", 7, "--to", "safetensors",
                       tmp_path / "full.safetensors")
    assert code == 0, out
    exported = load_file(tmp_path / "full.safetensors")
    for key, value in full.items():
        assert torch.equal(exported[key], value), key
    for key, value in make_model(0).state_dict().items():
        assert torch.equal(exported[f"model/{key}"], value), key


# ------------------------------------------------------------------------------- diff


def test_diff_reports_each_kind_of_change_with_measured_figures(tmp_path):
    root = tmp_path / "root"
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(64, 64, generator=g), "same": torch.randn(32, 32, generator=g),
         "grows": torch.zeros(4), "gone": torch.ones(3), "ints": torch.arange(10),
         "nan": torch.tensor([1.0, float("nan")]), "epoch": 1, "cfg": {"lr": 0.1, "wd": 0.0}}
    b = {**a, "w": a["w"].clone(), "grows": torch.zeros(5), "new": torch.ones(2),
         "ints": torch.arange(10) * 2, "nan": torch.tensor([1.0, float("nan")]), "epoch": 2,
         "cfg": {"lr": 0.05, "wd": 0.0}}
    del b["gone"]
    b["w"][20:22, :] += 0.5  # rows of one 4 KiB chunk (16 rows each) change
    b["w"][21, 7] = -3.0
    with ckpt.CheckpointManager(root, options=OPTIONS, async_save=False) as mgr:
        mgr.save(1, a)
        mgr.save(2, b)
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        d = verify.diff_steps(mgr, 1, 2)
    t = {x.key: x for x in d.tensors}
    delta = (b["w"].double() - a["w"].double())
    assert t["w"].status == "changed"
    assert t["w"].changed_elements == int((delta != 0).sum()) == 128
    assert t["w"].max_abs_diff == pytest.approx(float(delta.abs().max()))
    assert t["w"].rel_l2 == pytest.approx(float(delta.norm() / a["w"].double().norm()))
    assert (t["same"].status, t["same"].changed_elements) == ("equal", 0)
    assert (t["nan"].status, t["ints"].status, t["ints"].changed_elements) == (
        "equal", "changed", 9)
    assert (t["grows"].status, t["grows"].old_shape, t["grows"].shape) == ("changed", [4], [5])
    assert (t["gone"].status, t["new"].status) == ("removed", "added")
    # A's w (4 chunks) and B's changed chunk are read; "same" and B's equal chunks are not
    assert d.bytes_read == 64 * 64 * 4 + 4096 + 10 * 8 * 2
    values = {v.path: (v.a, v.b) for v in d.values}
    assert values == {"epoch": (1, 2), "cfg/lr": (0.1, 0.05), "gone": ("<tensor item>", None),
                      "new": (None, "<tensor item>")}
    text = verify.render_diff(d)
    assert "same" not in text and "cfg/lr: 0.1 -> 0.05" in text
    assert "7 tensors: 2 equal, 3 changed, 1 added, 1 removed; 4 values differ" in text


# ----------------------------------------------------- damaged compressed chunks


def damaged_compressed_root(tmp_path: Path) -> Path:
    """Steps 1 and 2, compressed; the zstd frame header of step 2's first chunk of w broken
    (a flipped bit in its magic number)."""
    root = tmp_path / "root"
    save(root, 1, options=KINDS["compressed"]["options"], with_probe=False)
    save(root, 2, options=KINDS["compressed"]["options"], with_probe=False)
    chunk = manifest_of(root / "step-00000002")["tensors"]["w"]["chunks"][0]
    assert chunk["codec"] == "zstd-grouped"
    flip(root / "step-00000002" / chunk["file"], chunk["start"], 7)
    return root


def test_a_damaged_compressed_chunk_fails_verify_diff_and_export_cleanly(tmp_path, capsys):
    root = damaged_compressed_root(tmp_path)
    code, out, err = cli(capsys, "verify", root)
    assert code == 1 and "- digest: " in out and "cannot read w" in out
    code, out, err = cli(capsys, "diff", root, 1, 2)
    assert code == 1 and "cannot read w" in err
    code, out, err = cli(capsys, "export", root, "--to", "torch", tmp_path / "w.pt")
    assert code == 1 and "cannot read w" in err
    assert not list(tmp_path.glob("w.pt*"))


def test_restore_falls_back_past_a_damaged_compressed_chunk(tmp_path):
    root = damaged_compressed_root(tmp_path)
    state = {"model": make_net(3), "w": torch.zeros(64, 64),
             "half": torch.zeros(40, 30, dtype=torch.bfloat16),
             "ids": torch.zeros(300, dtype=torch.int64), "epoch": 0}
    with ckpt.CheckpointManager(root, options=OPTIONS) as mgr:
        assert mgr.restore(state) == 1


def test_inspect_names_optimizer_state_only_when_a_module_fits(tmp_path):
    torch.manual_seed(0)
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 10, bias=False), torch.nn.Linear(10, 3))
    tied[2].weight = tied[0].weight
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    state = {"model": tied, "optim": torch.optim.Adam(tied.parameters()),
             "bn": bn, "bn_optim": torch.optim.SGD(bn.parameters(), lr=0.1, momentum=0.9)}
    for model, opt, x in ((tied, state["optim"], torch.randint(0, 10, (2, 4))),
                          (bn, state["bn_optim"], torch.randn(2, 3))):
        model(x).sum().backward()
        opt.step()
    ckpt.save(state, tmp_path / "c")
    cps = ckpt.inspect.open(tmp_path / "c")
    m = cps.manifest(0)
    names = ckpt.inspect.parameter_names(m)
    # the tied weight counts once, as in tied.parameters()
    assert names["optim"] == {i: n for i, (n, _) in enumerate(tied.named_parameters())}
    # a module with float buffers (BatchNorm's running stats) does not fit: no names
    # rather than wrong ones (bn has 4 parameters and 6 float tensors)
    assert "bn_optim" not in names
    # the layer reads one tensor whole and checks one chunk's digest
    key = next(k for k in m.tensors if k.startswith("model/"))
    assert torch.equal(cps.read_tensor(0, key), tied.state_dict()[key.split("/", 1)[1]])
    entry = m.tensors[key]
    cps.check_chunk(0, key, entry.chunks[0], entry.torch_dtype)


def _record_a_number_as_output(tree: dict) -> None:
    tree["output"] = 0


def _drop_the_inputs(tree: dict) -> None:
    del tree["inputs"]


@pytest.mark.parametrize("damage, reason", [
    (_record_a_number_as_output, "its recorded output is a int, not a tensor"),
    # The missing inputs are named, not blamed on the model ("running the probe's inputs
    # through the model raised KeyError: 'inputs'").
    (_drop_the_inputs, "it has no recorded inputs"),
])
def test_restore_at_the_forward_level_skips_a_step_whose_probe_item_is_damaged(
        tmp_path, caplog, damage, reason):
    root = tmp_path / "root"
    first = save(root, 1, net=make_net(1))
    save(root, 2, net=make_net(2))
    manifest = root / "step-00000002/manifest.json"
    doc = json.loads(manifest.read_text())
    damage(doc["items"]["__probe__"]["tree"])  # a hand-edited manifest
    manifest.write_bytes(sealed_json(doc))
    net = make_net(3)
    with caplog.at_level(logging.WARNING, logger="ckpt"), \
            ckpt.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore({"model": net}, verify="forward") == 1
    assert "skipping step=2" in caplog.text
    assert f"the probe item is damaged: {reason}" in caplog.text
    for key, value in first["model"].state_dict().items():
        assert torch.equal(net.state_dict()[key], value)


def test_the_recorded_factory_and_loss_run_only_when_trusted(tmp_path, capsys, monkeypatch):
    """A probe names code to import and call (its factory and loss function): like pickle,
    nothing a checkpoint names is imported unless the user says so. A hostile manifest could
    name any installed module; here the module's import leaves a mark."""
    (tmp_path / "marking.py").write_text(
        "import pathlib\npathlib.Path('imported').write_text('x')\n"
        "from tests.support.verify_workers import build_net\n"
        "def loss(output, inputs):\n    return output.float().pow(2).mean()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import marking

    probe = ckpt.Probe(model_key="model", inputs=torch.randn(5, 8), factory="marking:build_net",
                       loss_fn=marking.loss)
    with ckpt.CheckpointManager("root", options=ckpt.SaveOptions(probe=probe),
                                async_save=False) as mgr:
        mgr.save(1, {"model": make_net()})
    sys.modules.pop("marking")
    (tmp_path / "imported").unlink()

    code, out, _ = cli(capsys, "verify", "root", "--level", "forward")
    assert code == 2 and not (tmp_path / "imported").exists(), out
    assert ("the probe records the factory 'marking:build_net'; a factory a checkpoint names "
            "is imported and run only when asked") in out
    assert "pass --model marking:build_net to use it, or --trust-recorded" in out
    assert not verify.verify("root", level="forward").ok
    assert not (tmp_path / "imported").exists()

    # --model names the factory: the recorded loss function is still not imported.
    code, out, _ = cli(capsys, "verify", "root", "--level", "forward", "--model",
                       "tests.support.verify_workers:build_net")
    assert code == 0 and not (tmp_path / "imported").exists(), out
    assert "the probe's recorded loss function 'marking:loss' was not run" in out

    code, out, _ = cli(capsys, "verify", "root", "--level", "forward", "--trust-recorded",
                       "--json")
    assert code == 0 and (tmp_path / "imported").exists(), out
    assert json.loads(out)["steps"][0]["forward"]["factory"] == "marking:build_net"
    sys.modules.pop("marking", None)


def test_verify_of_one_named_step_its_writer_retires_midway_fails(tmp_path, capsys,
                                                                   monkeypatch):
    """Only ``--all`` passes over a step retired while it is checked; ``verify --step 1`` of a step
    its writer retires midway says it is gone and exits 2, having verified nothing."""
    import verify
    from verify.cli import main

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, keep_last=2, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"w": torch.full((64,), float(step))})

        def progress(total: int, label: str):  # made after step 1's manifest was read
            writer.save(3, {"w": torch.full((64,), 3.0)})  # retires step 1
            return lambda nbytes: None

        monkeypatch.setattr(verify, "ProgressBar", progress)
        code = main(["verify", str(root), "--step", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "skipped step" not in err, err
    assert "no committed checkpoint at" in err and "step-00000001" in err, err
    assert not (root / "step-00000001").exists()


def test_a_step_retired_while_its_read_fails_is_retired_not_unreadable(tmp_path):
    """A step whose read fails with an I/O error because its writer deleted it meanwhile is reported
    retired (CheckpointNotFoundError), as a damaged one is, not unreadable."""
    import errno

    import verify

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, keep_last=2, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"w": torch.full((64,), float(step))})
        cps = ckpt.inspect.open(str(root))

        def retire_then_fail(step, manifest):  # as an object store answers for a gone key
            writer.save(3, {"w": torch.full((64,), 3.0)})  # retires step 1
            raise OSError(errno.EIO, "read failed", str(root / "step-00000001"))

        cps.files = retire_then_fail
        with pytest.raises(ckpt.CheckpointNotFoundError, match="was retired"):
            verify.verify_step(cps, 1, "digest")
