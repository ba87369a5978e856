"""CkptCheckpointIO keeps Lightning's checkpoint contract: its folders list what Lightning's own
IO leaves there, a save leaves no thread or lock behind (a second Trainer of the same process
uses the folder), ``save_last="link"`` keeps one live link, and a URL is refused clearly.
Each test runs the real Trainer, with Lightning's own IO as the reference where one applies."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

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


def trainer(ckpt_io: bool, steps: int = 4, **callback: object) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     plugins=[CkptCheckpointIO()] if ckpt_io else None,
                     enable_checkpointing=bool(callback),
                     callbacks=[ModelCheckpoint(**callback)] if callback else None)


def listing(folder: Path) -> dict[str, str]:
    """Every entry, dotfiles included: name -> kind (a link with the name it holds)."""
    return {p.name: f"link:{os.readlink(p)}" if p.is_symlink() else
            "dir" if p.is_dir() else "file" for p in folder.iterdir()}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_dirpath_lists_what_lightnings_own_io_leaves_there(tmp_path, save_last, capsys):
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
    from verify.cli import main  # the ckpt command follows the pointer to the sibling root

    assert main(["verify", str(tmp_path / "ckpt/epoch=0-step=4.ckpt")]) == 0
    assert capsys.readouterr().out.startswith("step 4: OK")
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
    assert set(os.listdir(tmp_path)) == {"manual.ckpt", "epoch=1-step=6.ckpt"}


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
