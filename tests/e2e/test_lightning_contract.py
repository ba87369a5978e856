"""CkptCheckpointIO keeps Lightning's checkpoint contract: its folders list what Lightning's own
IO leaves there, a save leaves no thread or lock behind (a second Trainer of the same process
uses the folder), ``save_last="link"`` keeps one live link, and a URL is refused clearly.
A ``.ckpt`` is Lightning's own file (``torch.load``/``pl_load`` return what Lightning's IO
wrote) whose bytes ckpt's step checks by digest. Each test runs the real Trainer, with
Lightning's own IO as the reference where one applies."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.fabric.utilities.cloud_io import _load as pl_load  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import ckpt  # noqa: E402
from tests.support.other_user import planted_sibling_roots  # noqa: E402
from trainer.integrations.lightning import CkptCheckpointIO, root_for  # noqa: E402


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> torch.utils.data.DataLoader:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def trainer(ckpt_io: bool | CkptCheckpointIO, steps: int = 4, extra: list | None = None,
            **callback: object) -> L.Trainer:
    io = ckpt_io if isinstance(ckpt_io, CkptCheckpointIO) else CkptCheckpointIO()
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     plugins=[io] if ckpt_io else None,
                     enable_checkpointing=bool(callback),
                     callbacks=[ModelCheckpoint(**callback)] * bool(callback) + (extra or []))


def listing(folder: Path) -> dict[str, str]:
    """Every entry, dotfiles included: name -> kind (a link with the name it holds)."""
    return {p.name: f"link:{os.readlink(p)}" if p.is_symlink() else
            "dir" if p.is_dir() else "file" for p in folder.iterdir()}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_dirpath_lists_what_lightnings_own_io_leaves_there(tmp_path, save_last):
    """Top-k rotation and last.ckpt (a copy, or a link to the top-k file): the folder holds
    the same names, kinds and link targets as with Lightning's own IO, no ckpt file among
    them (steps, lock and staging live in the hidden sibling), and no link dangles."""
    for name, ckpt_io in (("own", False), ("ckpt", True)):
        trainer(ckpt_io, dirpath=tmp_path / name, every_n_train_steps=1, save_top_k=2,
                monitor="step", mode="max", save_last=save_last).fit(Net(), data())
    own, ours = listing(tmp_path / "own"), listing(tmp_path / "ckpt")
    assert ours == own
    assert all((tmp_path / "ckpt" / n).exists() for n in ours)  # no dangling link
    assert sorted(p.name for p in (tmp_path / ".ckpt.ckpt").glob("step-*")) == [
        "step-00000003", "step-00000004"]
    resumed = trainer(True, steps=5)
    resumed.fit(Net(), data(), ckpt_path=str(tmp_path / "ckpt/last.ckpt"))
    assert resumed.global_step == 5


def test_a_second_run_into_the_folder_lists_as_lightnings_own_io(tmp_path):
    """A second fit into the same dirpath starts again at step 1 and makes Lightning version
    its last link (last-v1.ckpt): its saves write over the earlier run's steps as Lightning
    writes over its files (ckpt's manager refuses a lower step unless told), and both links
    are live."""
    for name, ckpt_io in (("own", False), ("ckpt", True)):
        for run in (1, 2):
            trainer(ckpt_io, steps=4 * run, dirpath=tmp_path / name, every_n_train_steps=1,
                    save_top_k=1, monitor="step", mode="max",
                    save_last="link").fit(Net(), data())
    own, ours = listing(tmp_path / "own"), listing(tmp_path / "ckpt")
    assert ours == own and "last-v1.ckpt" in ours
    assert all((tmp_path / "ckpt" / n).exists() for n in ours)


def same(a: object, b: object) -> bool:
    """Equal checkpoints: the same keys, values, and tensors (dtype and bits)."""
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.parametrize("async_save", [False, True])
def test_torch_load_and_pl_load_return_what_lightnings_own_io_wrote(tmp_path, async_save):
    """Every .ckpt CkptCheckpointIO leaves (top-k files and last.ckpt) is read by torch.load
    (weights_only=True, torch's default, and False) and Lightning's pl_load into the dict
    Lightning's own IO wrote at that path; last.ckpt and the top-k file of the same state
    are one file on disk (a second name), where Lightning's own IO writes the bytes twice."""
    run = tmp_path / "ckpts"  # the same dirpath for both: ModelCheckpoint's state names it
    options = dict(dirpath=run, every_n_train_steps=1, save_top_k=2, monitor="step",
                   mode="max", save_last=True)
    torch.manual_seed(0)
    trainer(False, **options).fit(Net(), data())
    shutil.move(run, tmp_path / "own")
    torch.manual_seed(0)
    trainer(CkptCheckpointIO(async_save=async_save), **options).fit(Net(), data())
    names = sorted(os.listdir(run))
    assert names == sorted(os.listdir(tmp_path / "own")) == [
        "epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    for name in names:
        own = torch.load(tmp_path / "own" / name, weights_only=False)
        assert same(torch.load(run / name, weights_only=True), own), name
        assert same(torch.load(run / name, weights_only=False), own), name
        assert same(pl_load(run / name), own), name
    assert os.path.samefile(run / "last.ckpt", run / "epoch=0-step=4.ckpt")
    assert not os.path.samefile(tmp_path / "own/last.ckpt", tmp_path / "own/epoch=0-step=4.ckpt")


class StartStep(Callback):
    def on_train_start(self, trainer, *args) -> None:
        self.step = trainer.global_step


def test_a_flipped_bit_in_a_ckpt_is_caught_and_the_resume_falls_back(tmp_path, caplog):
    """One bit flipped in a tensor's bytes inside last.ckpt: torch.load still reads the file
    (a weight silently changed), but a resume through the plugin checks it against its
    step's digests, names the tensor record that differs, and resumes from the step before,
    whose weights are those Lightning's own IO saved there."""
    options = dict(dirpath=tmp_path / "run", every_n_train_steps=1, save_top_k=2,
                   monitor="step", mode="max", save_last=True)
    torch.manual_seed(0)
    trainer(True, **options).fit(Net(), data())
    last = tmp_path / "run/last.ckpt"
    good = torch.load(last, weights_only=True)
    step3 = torch.load(tmp_path / "run/epoch=0-step=3.ckpt", weights_only=True)
    records = json.loads((tmp_path / ".run.ckpt/step-00000004/manifest.json").read_text())[
        "metadata"]["lightning_files"][0]["records"]
    weight = good["state_dict"]["layer.weight"]
    name, (offset, _, _) = next((k, v) for k, v in records.items() if "/data/" in k and v[1]
                                == weight.numel() * weight.element_size())
    raw = bytearray(last.read_bytes())
    raw[offset + 2] ^= 0x10
    last.write_bytes(bytes(raw))  # one inode: epoch=0-step=4.ckpt holds the flip as well
    assert not torch.equal(torch.load(last, weights_only=True)["state_dict"]["layer.weight"],
                           weight)  # torch alone reads the changed weight

    start = StartStep()
    model = Net()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        trainer(True, steps=5, extra=[start]).fit(model, data(), ckpt_path=str(last))
    assert start.step == 3
    assert f"skipping step 4" in caplog.text and f"record {name}" in caplog.text
    loaded = CkptCheckpointIO().load_checkpoint(last)
    assert same(loaded, step3)


def test_a_ckpt_replaced_by_another_file_naming_its_step_is_not_loaded(tmp_path, caplog):
    """Threat: someone who may write the checkpoint folder (not ckpt's sibling root, which is
    refused when not ours) replaces last.ckpt with a torch file of hers whose zip comment
    names the same step, so that a resume loads her weights (or her pickle). The load checks
    the file against the digests its step recorded, skips it, and resumes from the step
    before; her file is never unpickled."""
    io = CkptCheckpointIO()
    io.save_checkpoint({"global_step": 3, "w": torch.zeros(4)}, tmp_path / "step3.ckpt")
    io.save_checkpoint({"global_step": 4, "w": torch.ones(4)}, tmp_path / "last.ckpt")
    from trainer.integrations import _pl_file

    class Boom:  # unpickling it would run her code
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    tmp, _ = _pl_file.write({"global_step": 4, "w": torch.full((4,), 7.0), "x": Boom()},
                            str(tmp_path / "last.ckpt"), 4)
    os.replace(tmp, tmp_path / "last.ckpt")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        loaded = io.load_checkpoint(tmp_path / "last.ckpt", weights_only=False)
    assert loaded["global_step"] == 3 and torch.equal(loaded["w"], torch.zeros(4))
    assert "skipping step 4" in caplog.text and "fails its digest" in caplog.text
    assert not (tmp_path / "pwned").exists()


def test_a_ckpt_whose_step_was_removed_falls_back_saying_what_is_known(tmp_path, caplog):
    """A file's step removed from the root after the file was written (its step folder
    deleted): the load falls back to the step before with a warning that says the step is
    not committed and how that comes about, not that the job stopped while writing it (a
    file is renamed into place only once its step committed). A folder moved without its
    sibling root is named as such."""
    io = CkptCheckpointIO()
    io.save_checkpoint({"global_step": 3, "w": torch.zeros(4)}, tmp_path / "run/a.ckpt")
    io.save_checkpoint({"global_step": 4, "w": torch.ones(4)}, tmp_path / "run/b.ckpt")
    shutil.rmtree(tmp_path / ".run.ckpt/step-00000004")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        loaded = io.load_checkpoint(tmp_path / "run/b.ckpt")
    assert loaded["global_step"] == 3
    assert "belongs to step 4, which is not committed under" in caplog.text
    assert "removed after the file was written" in caplog.text
    assert "stopped while writing" not in caplog.text

    shutil.move(tmp_path / "run", tmp_path / "moved")  # without its sibling root
    with pytest.raises(FileNotFoundError, match="moved or copied without its hidden sibling"):
        io.load_checkpoint(tmp_path / "moved/a.ckpt")


def test_save_checkpoint_outside_fit_leaves_no_thread_or_lock(tmp_path):
    """trainer.save_checkpoint() after fit() is not followed by a teardown: the save returns
    with its step committed, no writer thread alive and the folder unlocked, so a second
    Trainer of this process saves into the folder and resumes from that file."""
    before = set(threading.enumerate())
    first = trainer(True, dirpath=tmp_path)
    model = Net()
    first.fit(model, data())
    first.save_checkpoint(tmp_path / "manual.ckpt")
    assert set(threading.enumerate()) - before == set()
    with ckpt.CheckpointManager(root_for(str(tmp_path)), metrics=False) as writer:  # unlocked
        assert 4 in writer.steps()
    second = trainer(True, steps=6, dirpath=tmp_path)  # keeps first alive: same process
    second.fit(Net(), data(), ckpt_path=str(tmp_path / "manual.ckpt"))
    assert second.global_step == 6 and first.global_step == 4
    # manual.ckpt holds the state after fit (epoch 1 begun), as with Lightning's own IO
    assert set(os.listdir(tmp_path)) == {"manual.ckpt", "epoch=2-step=6.ckpt"}


def test_an_asynchronous_save_releases_the_folder_at_the_next_load(tmp_path):
    """async_save=True: the write may go on after save_checkpoint returns, holding the lock;
    a load finishes it and releases the folder, so a second Trainer's plugin can write there
    before the first one's teardown."""
    io = CkptCheckpointIO(async_save=True)
    io.save_checkpoint({"global_step": 3, "w": torch.ones(3)}, tmp_path / "a.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(3))
    other = CkptCheckpointIO()
    other.save_checkpoint({"global_step": 5, "w": torch.zeros(3)}, tmp_path / "b.ckpt")
    assert torch.equal(other.load_checkpoint(tmp_path / "b.ckpt")["w"], torch.zeros(3))
    io.teardown()


@pytest.mark.parametrize("url", ["memory://run/last.ckpt", "s3://bucket/run/last.ckpt"])
def test_an_fsspec_url_is_refused_with_what_to_do(tmp_path, monkeypatch, url):
    """An fsspec URL names no local folder: it was written as a folder named "memory:"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="local folders only.*Lightning's own IO"):
        CkptCheckpointIO().save_checkpoint({"global_step": 1}, url)
    assert os.listdir(tmp_path) == []


def test_a_sibling_root_planted_by_another_user_is_refused():
    """Threat: dirpath in a folder others may write (like /tmp); another local user makes
    the hidden sibling root there first, a folder of hers or a link, to read the states
    written into it or to plant steps for a resume. The plugin refuses it, naming it and what
    to do, and writes nothing there."""
    with planted_sibling_roots("ckpts") as shared:
        for name, what in (("ckpts", "owned by uid"), ("link", "a link")):
            with pytest.raises(ckpt.CheckpointError, match=f"is {what}.*dirpath"):
                CkptCheckpointIO().save_checkpoint({"global_step": 1, "w": torch.ones(2)},
                                                   shared / name / "last.ckpt")
        assert os.listdir(shared / ".ckpts.ckpt") == [] and not (shared / "hers").exists()
