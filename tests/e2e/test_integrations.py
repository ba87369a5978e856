"""Lightning, the Hugging Face Trainer and Accelerate writing through ckpt, with the real
libraries on tiny models: a job SIGKILLed mid-run resumes through ckpt and ends with the
same weights as the framework's own resume from the same step; a corrupt newest checkpoint
(a flipped bit) is skipped with a logged warning; exported weights load in transformers.

One job script per framework (tests/support/pl_job.py, ...): these libraries import slowly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckpt

from tests.support.fork_kill import RESUMING, run_forked

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


JOB_TIMEOUT = 600
# Job scripts run from the fork server, which preloads them (tests/support/ranks.py).
FORKED = {"hf_job.py", "acc_job.py", "pl_job.py"}
JOB_ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}


def run_job(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / script), *args],
                          env={**os.environ, **JOB_ENV}, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


class KilledJob:
    """A job script in ``kill+resume`` mode (tests/support/fork_kill.py): a child forked after the
    framework's imports trains and SIGKILLs itself; the job waits until :meth:`resume`."""

    def __init__(self, script: str, work: Path) -> None:
        self.stderr_path = work / f"{script}.stderr"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "support" / script), "kill+resume",
                 str(work)],
                env={**os.environ, **JOB_ENV}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, start_new_session=True)
        self.timer = threading.Timer(JOB_TIMEOUT, self.close)
        self.timer.start()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def killed(self) -> None:
        """Wait for the child's end: SIGKILLed."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("killed "):
                assert int(line.split()[1]) == signal.SIGKILL, f"{line}{self.stderr()[-3000:]}"
                return
        self.proc.wait()
        pytest.fail(f"the job ended ({self.proc.returncode}) before its child was killed\n"
                    f"{self.stderr()[-3000:]}")

    def resume(self) -> str:
        """Let the job resume and finish; returns the resumed run's stderr."""
        self.proc.communicate("go\n")
        self.timer.cancel()
        assert self.proc.returncode == 0, self.stderr()[-3000:]
        return self.stderr().split(RESUMING, 1)[1]

    def close(self) -> None:
        self.timer.cancel()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the job and a child still running
            self.proc.wait()


class ForkedKilledJob(KilledJob):
    """KilledJob for a job script the suite's fork server preloads (tests/support/ranks.py):
    run in a process forked from it, without a second import of the script's framework;
    the job's report and the test's ``go`` travel on a pipe (fork_kill.run_forked)."""

    def __init__(self, script: str, work: Path) -> None:
        from tests.support.ranks import forkserver

        self.stderr_path = work / f"{script}.stderr"
        ctx = forkserver()
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=run_forked,
                                args=(f"tests.support.{script[:-3]}", script, "kill+resume",
                                      str(work), theirs), daemon=True)
        self.proc.start()
        theirs.close()
        self.timer = threading.Timer(JOB_TIMEOUT, self.close)
        self.timer.start()

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def killed(self) -> None:
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                pytest.fail(f"the job ended ({self.proc.exitcode}) before its child was "
                            f"killed\n{self.stderr()[-3000:]}")
        line = self.conn.recv()
        assert int(line.split()[1]) == signal.SIGKILL, f"{line}{self.stderr()[-3000:]}"

    def resume(self) -> str:
        self.conn.send("go")
        self.proc.join(JOB_TIMEOUT)
        self.timer.cancel()
        assert self.proc.exitcode == 0, self.stderr()[-3000:]
        return self.stderr().split(RESUMING, 1)[1]

    def close(self) -> None:
        self.timer.cancel()
        if self.proc.is_alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the job and a child still running
            except ProcessLookupError:  # not its own session yet
                self.proc.kill()
            self.proc.join()


@pytest.fixture
def killed_job(tmp_path):
    """Start a job in ``kill+resume`` mode; returns it once its child was SIGKILLed."""
    jobs: list[KilledJob] = []

    def start(script: str) -> KilledJob:
        forked = script in FORKED
        jobs.append((ForkedKilledJob if forked else KilledJob)(script, tmp_path))
        jobs[-1].killed()
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()


def flip_a_bit(step_dir: Path, key_part: str) -> None:
    """Flip one bit in the first chunk of the first tensor whose key contains ``key_part``."""
    doc = json.loads((step_dir / "manifest.json").read_bytes())
    key = next(k for k in doc["tensors"] if key_part in k)
    chunk = doc["tensors"][key]["chunks"][0]
    path = step_dir / chunk["file"]
    raw = bytearray(path.read_bytes())
    raw[chunk["start"] + 1] ^= 0x08
    path.write_bytes(bytes(raw))


def flip_a_bit_in_ckpt_file(path: Path, key_part: str) -> None:
    """Flip one bit in the bytes of the first tensor of a Lightning .ckpt (a torch zip of
    stored records) whose state_dict key contains ``key_part``."""
    import zipfile

    sd = torch.load(path, weights_only=True)["state_dict"]
    key = next(k for k in sd if key_part in k)
    with zipfile.ZipFile(path) as archive:  # the storage record of exactly that many bytes
        size = sd[key].numel() * sd[key].element_size()
        info = next(i for i in archive.infolist() if "/data/" in i.filename
                    and i.file_size == size)
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + int.from_bytes(raw[info.header_offset + 26:
                                                         info.header_offset + 28], "little") \
        + int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    raw[start + 1] ^= 0x08
    path.write_bytes(bytes(raw))


def same_weights(a: Path, b: Path) -> bool:
    sa, sb = torch.load(a), torch.load(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)




def test_lightning_resumes_through_ckpt_as_its_own_io_does(tmp_path, killed_job):
    pytest.importorskip("lightning")
    job = killed_job("pl_job.py")
    root, steps = tmp_path / "pl", tmp_path / ".pl.ckpt"  # the steps live in the sibling
    # Killed after step 7: steps 4 and 6 are kept (save_top_k=2), last.ckpt is step 6's file.
    assert (steps / "step-00000006/manifest.json").exists()
    assert torch.load(root / "last.ckpt", weights_only=True)["global_step"] == 6
    shutil.copytree(root, tmp_path / "pl_bad")
    shutil.copytree(steps, tmp_path / ".pl_bad.ckpt")
    step6 = [tmp_path / "pl_bad/last.ckpt", *(tmp_path / "pl_bad").glob("*step=6.ckpt")]
    assert os.path.samefile(*(root / p.name for p in step6))  # one file, two names
    for copy in step6:  # copied apart by copytree: flip the same bit in both
        flip_a_bit_in_ckpt_file(copy, "net.0.weight")

    stderr = job.resume()

    out = tmp_path / "out"
    starts = json.loads((out / "starts.json").read_text())
    assert starts == {"ckpt": 6, "ckpt_bad": 4, "torch6": 6, "torch4": 4}
    assert same_weights(out / "ckpt.pt", out / "torch6.pt")
    assert same_weights(out / "ckpt_bad.pt", out / "torch4.pt")
    assert not same_weights(out / "torch6.pt", out / "torch4.pt")  # the comparison can fail
    assert "skipping step 6" in stderr and "fails its digest" in stderr
    # The resumed run kept Lightning's retention: two top-k steps (last.ckpt shares one).
    assert sorted(p.name for p in steps.glob("step-*")) == ["step-00000010", "step-00000012"]


def test_lightning_ddp_on_two_cpu_processes_saves_from_rank_0_and_resumes(tmp_path):
    pytest.importorskip("lightning")
    run_job("pl_job.py", "ddp", str(tmp_path))
    out = tmp_path / "out"
    assert json.loads((out / "ddp_starts.json").read_text()) == {"ckpt": 6, "torch": 6}
    assert same_weights(out / "ddp_ckpt.pt", out / "ddp_torch.pt")
    root = tmp_path / "ddp_ckpt"
    assert torch.load(root / "last.ckpt", weights_only=True)["global_step"] == 12
    assert (tmp_path / ".ddp_ckpt.ckpt/step-00000012/manifest.json").exists()


def test_hf_trainer_resumes_through_ckpt_as_its_own_checkpoints_do(tmp_path, killed_job):
    pytest.importorskip("transformers")
    job = killed_job("hf_job.py")
    root, steps = tmp_path / "hf", tmp_path / ".hf.ckpt"
    assert (steps / "step-00000006/manifest.json").exists()
    # checkpoint-N folders are HF's (save_total_limit=2); ckpt's steps live in the sibling.
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    shutil.copytree(root, tmp_path / "hf_bad")
    shutil.copytree(steps, tmp_path / ".hf_bad.ckpt")
    model_file = tmp_path / "hf_bad/checkpoint-6/model.safetensors"
    blob = bytearray(model_file.read_bytes())
    blob[-5] ^= 0x01  # inside the last tensor's bytes
    model_file.write_bytes(bytes(blob))

    stderr = job.resume()

    out = tmp_path / "out"
    starts = json.loads((out / "starts.json").read_text())
    assert starts == {"ckpt": 6, "ckpt_bad": 4, "hf6": 6, "hf4": 4}
    assert same_weights(out / "ckpt.pt", out / "hf6.pt")  # model, optimizer, RNG, data skip
    assert same_weights(out / "ckpt_bad.pt", out / "hf4.pt")
    assert "skipping" in stderr and "model.safetensors fails its digest" in stderr
    assert sorted(p.name for p in steps.glob("step-*")) == ["step-00000010", "step-00000012"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-10", "checkpoint-12"]
    # checkpoint-12 loads with from_pretrained: the same logits, tied weights tied again.
    logits = torch.load(out / "logits.pt")
    assert torch.equal(logits["trained"], logits["loaded"]) and logits["tied"]


def test_accelerate_save_state_and_load_state_go_through_ckpt(tmp_path, killed_job):
    pytest.importorskip("accelerate")
    job = killed_job("acc_job.py")
    root = tmp_path / "acc/checkpoints"
    # Saves at steps 2, 4, 6 are iterations 0, 1, 2; total_limit=2 keeps two folders.
    # Each folder is a ckpt root of its own, holding its step.
    assert (root / "checkpoint_2/step-00000002/manifest.json").exists()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    shutil.copytree(tmp_path / "acc", tmp_path / "acc_bad")
    flip_a_bit(tmp_path / "acc_bad/checkpoints/checkpoint_2/step-00000002", "c_attn.weight")

    stderr = job.resume()

    out = tmp_path / "out"
    starts = json.loads((out / "starts.json").read_text())
    # The registered counter came back with the step: the loop restarted where it saved.
    assert starts == {"ckpt": 6, "ckpt_bad": 4, "acc6": 6, "acc4": 4}
    assert same_weights(out / "ckpt.pt", out / "acc6.pt")
    assert same_weights(out / "ckpt_bad.pt", out / "acc4.pt")
    assert not same_weights(out / "acc6.pt", out / "acc4.pt")  # the comparison can fail
    assert "skipping step 2" in stderr and "digest mismatch" in stderr
    assert sorted(str(p.relative_to(root)) for p in root.glob("*/step-*")) == [
        "checkpoint_4/step-00000004", "checkpoint_5/step-00000005"]


def test_hf_trainer_records_the_best_checkpoint_as_hfs_own_trainer_does(tmp_path):
    """The step being saved can be the best one: HF names it best_model_checkpoint (what
    load_best_model_at_end loads and rotation keeps) as it saves it, and so must CkptTrainer."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from trainer.integrations.hf import CkptTrainer

    def train(cls: type, out: Path):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                           n_positions=16))
        ids = torch.randint(0, 50, (32, 16), generator=torch.Generator().manual_seed(0))
        data = [{"input_ids": row, "labels": row} for row in ids]
        args = TrainingArguments(
            output_dir=str(out), max_steps=4, save_steps=2, eval_strategy="steps", eval_steps=2,
            per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True, report_to=[],
            disable_tqdm=True, load_best_model_at_end=True, metric_for_best_model="eval_loss",
            greater_is_better=False)
        job = cls(model=model, args=args, train_dataset=data, eval_dataset=data[:8])
        job.train()
        return job.state

    theirs = train(Trainer, tmp_path / "hf")
    ours = train(CkptTrainer, tmp_path / "ckpt")
    assert theirs.best_global_step == ours.best_global_step == 4  # the last save is the best
    assert theirs.best_model_checkpoint == str(tmp_path / "hf" / "checkpoint-4")
    assert ours.best_model_checkpoint == str(tmp_path / "ckpt" / "checkpoint-4")


def test_hf_best_model_at_end_loads_that_step_or_keeps_the_model(tmp_path, caplog):
    """load_best_model_at_end loads the best step itself; when that step is corrupt the model
    stays as training left it (as HF's Trainer does without its best model), never an older
    step that was not the best."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from trainer.integrations.hf import CkptTrainer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)

    class Loss(torch.nn.Module):  # HF's Trainer wants a model that returns its loss
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            return {"loss": self.inner(x).pow(2).mean()}

    data = [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i))} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, save_steps=2,
                             per_device_train_batch_size=4, learning_rate=0.1, use_cpu=True,
                             report_to=[], disable_tqdm=True)
    job = CkptTrainer(model=Loss(), args=args, train_dataset=data)
    job.train()
    steps = {s: safetensors.torch.load_file(tmp_path / "out" / f"checkpoint-{s}" /
                                            "model.safetensors")["inner.weight"] for s in (2, 4)}
    assert not torch.equal(steps[2], steps[4])

    job.state.best_model_checkpoint = str(tmp_path / "out" / "checkpoint-4")
    job._load_best_model()
    assert torch.equal(model.weight, steps[4])

    with torch.no_grad():
        model.weight.fill_(7.0)
    model_file = tmp_path / "out" / "checkpoint-4" / "model.safetensors"
    blob = bytearray(model_file.read_bytes())
    blob[-5] ^= 0x01  # inside the last tensor's bytes
    model_file.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        job._load_best_model()
    assert torch.equal(model.weight, torch.full((4, 4), 7.0))  # not step 2's weights
    assert "best checkpoint" in caplog.text and "step 4" in caplog.text


def test_accelerate_resumes_a_seedable_stateful_loader_in_its_epochs_order(tmp_path):
    """torchdata's state holds the position in the epoch, not the epoch, which seeds a
    seedable sampler's order: CkptAccelerator saves the loader's epoch with it. A loader
    whose order cannot be restored (a plain shuffling sampler) is warned about."""
    pytest.importorskip("accelerate")
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

    from trainer.integrations.accelerate import CkptAccelerator

    def prepared(seedable: bool = True):
        set_seed(0)
        acc = CkptAccelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(tmp_path / f"run{seedable}"), automatic_checkpoint_naming=True),
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                      use_seedable_sampler=seedable))
        return acc, acc.prepare(torch.utils.data.DataLoader(list(range(10)), batch_size=4,
                                                            shuffle=True))

    _, ref = prepared()
    want = [b.tolist() for _ in range(3) for b in ref]
    acc, loader = prepared()
    seen = [b.tolist() for b in loader]  # epoch 0, then a batch of epoch 1
    seen.append(next(iter(loader)).tolist())
    acc.save_state()
    acc.wait_for_checkpoints()
    acc, resumed = prepared()
    acc.load_state()
    assert seen + [b.tolist() for _ in range(2) for b in resumed] == want

    acc, plain = prepared(seedable=False)
    with pytest.warns(RuntimeWarning, match="use_seedable_sampler=True"):
        acc.save_state()
    acc.wait_for_checkpoints()


def test_lightning_module_loads_from_a_ckpt_file_for_inference(tmp_path):
    """MyModule.load_from_checkpoint("last.ckpt") reads the file with torch.load; the
    integration's load_from_checkpoint checks it against its step's digests first, and gives
    the same module with its hyperparameters and trained weights."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from trainer.integrations.lightning import CkptCheckpointIO, load_from_checkpoint

    class Net(L.LightningModule):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(4, width)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    trained = Net(width=5)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                       batch_size=4)
    L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
              enable_model_summary=False, plugins=[CkptCheckpointIO()],
              callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(trained, data)
    last = tmp_path / "last.ckpt"
    assert torch.equal(Net.load_from_checkpoint(last).layer.weight, trained.layer.weight)
    loaded = load_from_checkpoint(Net, last, map_location="cpu")
    assert loaded.hparams.width == 5
    assert torch.equal(loaded.layer.weight, trained.layer.weight)
    os.symlink("last.ckpt", tmp_path / "link.ckpt")  # as save_last="link" makes last.ckpt
    linked = load_from_checkpoint(Net, tmp_path / "link.ckpt", map_location="cpu")
    assert torch.equal(linked.layer.weight, trained.layer.weight)


def test_lightning_last_link_to_a_ckpt_file_resumes_its_step(tmp_path, caplog):
    """ModelCheckpoint(save_last="link") makes last.ckpt a link to the top-k file beside it:
    it loads that file's step, checked. A link out of the folder is not followed to ckpt's
    steps: it is read with torch.load, as Lightning's own IO reads it."""
    pytest.importorskip("lightning")
    from trainer.integrations.lightning import CkptCheckpointIO

    io = CkptCheckpointIO(async_save=False)
    io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.ones(2)}},
                       tmp_path / "epoch=0-step=4.ckpt")
    io.teardown()
    os.symlink("epoch=0-step=4.ckpt", tmp_path / "last.ckpt")
    loaded = CkptCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], torch.ones(2))

    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    os.symlink(tmp_path / "epoch=0-step=4.ckpt", elsewhere / "last.ckpt")
    with caplog.at_level(logging.INFO, logger="ckpt"):  # read as Lightning would: torch.load
        assert CkptCheckpointIO().load_checkpoint(elsewhere / "last.ckpt")["global_step"] == 4
    assert "not written by CkptCheckpointIO" in caplog.text


def test_lightning_plugin_leaves_sigterm_to_lightning(tmp_path):
    """Lightning's SIGTERM handler sets trainer.received_sigterm and stops the loop through
    on_exception and teardown (which finishes the write in flight); the manager the plugin
    opens at its first save replaced it with ckpt's (exit 143 from inside the loop)."""
    pytest.importorskip("lightning")
    from trainer.integrations.lightning import CkptCheckpointIO

    def lightnings(signum, frame):  # stands for Lightning's handler
        pass

    previous = signal.signal(signal.SIGTERM, lightnings)
    try:
        io = CkptCheckpointIO()
        io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "last.ckpt")
        assert signal.getsignal(signal.SIGTERM) is lightnings
        io.teardown()
        io = CkptCheckpointIO(schedule=ckpt.Schedule(handle_sigterm=True),  # ckpt's own, asked
                              async_save=True)  # installed while the write is in flight
        io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, tmp_path / "last.ckpt")
        assert signal.getsignal(signal.SIGTERM) is not lightnings
        io.teardown()
    finally:
        signal.signal(signal.SIGTERM, previous)
