"""Training-health guards, trainer metrics and structured logs (single process, CPU, fast).

The trainer runs a small MLP classifier on a synthetic dataset (400 samples, global batch 8
in micro batches of 4, checkpoint every 5 steps, 40 steps: one epoch, so every sample is
drawn once). A sample index is "marked" in the global batch of step 13; the tests make it
poison its batch:

- NaN: the step's loss is multiplied by NaN when its micro batch holds the marked index;
- spike: the marked sample's inputs are scaled by 1e3 and its label changed (a corrupted
  sample: a huge but finite loss).

Expected: the guard sees step 13 go bad, every rank (here the one) rolls back to the newest
verified checkpoint (step 5: the window of step 10, steps 11-14, fails at 13), the batch of
step 13 is skipped, steps 6-12 are trained again on the same data, and the job reaches step 40 on the no-failure data order minus that one batch; the rollback is in
the logs, in the metrics (scraped over HTTP or read from the textfile) and in the audit log.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ckpt

from tests.support.elastic_job import torchrun_forked
from tests.support.prom import free_port, parse_metrics
from trainer import (CheckpointConfig, DataConfig, ElasticConfig, FailureConfig,
                     ObservabilityConfig, ResumableSampler, StepConfig)
from trainer.elastic import ElasticTrainer, read_audit, read_jsonl, read_skips
from trainer.health import (LOSS_SPIKE, NONFINITE_GRAD_NORM, NONFINITE_LOSS, OK, HealthGuard,
                            TrainingHealthError)
from trainer.metrics import format_event, metric_names, parse_event
from trainer.rollback import BAD_BATCHES_KEY, carried_bad_batches

N, GLOBAL, MICRO, EVERY, STEPS, SEED = 400, 8, 4, 5, 40, 0
BAD_STEP = 13
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


# ------------------------------------------------------------------------------- helpers


def no_failure_order(steps: int) -> list[list[int]]:
    sampler = ResumableSampler(N, seed=SEED)
    return [sampler.next_indices(GLOBAL) for _ in range(steps)]


BAD_BATCH = no_failure_order(BAD_STEP)[-1]
MARKED = BAD_BATCH[5]


class Blobs(torch.utils.data.Dataset):
    """(x, label, index): 8 features, 4 classes given by a fixed random linear map."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(N, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 4, generator=g)).argmax(1)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def make_step_fn(mode: str | None, marked: int = MARKED):
    def step_fn(model: torch.nn.Module, batch) -> torch.Tensor:
        x, y, idx = batch
        hit = idx == marked
        if mode == "spike" and hit.any():  # a corrupted sample: scaled input, wrong label
            x, y = x.clone(), y.clone()
            x[hit] *= 1e3
            y[hit] = (y[hit] + 1) % 4
        loss = F.cross_entropy(model(x), y)
        if mode == "nan" and hit.any():
            loss = loss * float("nan")
        return loss
    return step_fn


def observed(tmp_path: Path, **fields) -> ObservabilityConfig:
    """The tests' observability: audits in ``tmp_path/audit``, a step line every 5 steps."""
    return ObservabilityConfig(audit_dir=tmp_path / "audit", log_every=5, **fields)


def trainer(tmp_path: Path, step_fn, **config) -> ElasticTrainer:
    """The test's trainer; ``config`` takes ElasticConfig's keywords (``checkpoint=``,
    ``health=``, ...). Default: a health guard of a short window, :func:`observed`."""
    config.setdefault("health", HealthGuard(window=20, min_history=5))
    config.setdefault("observability", observed(tmp_path))
    return ElasticTrainer(model_fn, lambda p: torch.optim.SGD(p, lr=0.1), Blobs(), step_fn,
                          checkpoint_root=tmp_path / "ckpt", checkpoint_every=EVERY,
                          global_batch_size=GLOBAL, micro_batch_size=MICRO,
                          config=ElasticConfig(**config))


@pytest.fixture(autouse=True)
def plain_process(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "CKPT_ELASTIC_AUDIT_DIR",
              "CKPT_ELASTIC_RUN_DIR"):
        monkeypatch.delenv(k, raising=False)




def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def event_lines(caplog, event: str) -> list[dict[str, str]]:
    out = []
    for r in caplog.records:
        if r.name == "ckpt.trainer" and r.getMessage().startswith(event + " "):
            out.append(parse_event(r.getMessage())[1])
    return out


def check_trained_order(tmp_path: Path, skipped_steps: list[int]) -> None:
    """Steps 1..STEPS trained the no-failure batches in order, minus the skipped ones."""
    records = read_audit(tmp_path / "audit")
    assert sorted(records) == list(range(1, STEPS + 1))
    order = no_failure_order(STEPS + len(skipped_steps))
    expected = [b for k, b in enumerate(order, 1) if k not in skipped_steps]
    assert [[i for r in sorted(rec["ranks"]) for i in rec["ranks"][r]]
            for rec in records.values()] == expected


# ------------------------------------------------------------------------------- the guard


def test_guard_flags_nonfinite_loss_and_gradient():
    g = HealthGuard(min_history=1)
    assert g.observe(1, 2.0, 1.0).ok
    assert g.observe(2, float("nan"), 1.0).reason == NONFINITE_LOSS
    assert g.observe(3, float("inf"), None).reason == NONFINITE_LOSS
    assert g.observe(4, 2.0, float("inf")).reason == NONFINITE_GRAD_NORM
    assert g.observe(5, 2.0, None).reason == OK                  # no norm: not judged
    assert HealthGuard(check_grad_norm=False).observe(1, 2.0, float("nan")).ok
    assert g.median() == 2.0                                     # bad steps never join


def test_guard_spike_is_a_multiple_of_the_recent_median():
    g = HealthGuard(spike_factor=3.0, window=4, min_history=3)
    for step, loss in enumerate([10.0, 1.0, 1.2], 1):
        assert g.observe(step, loss).ok                          # too few to judge a spike
    v = g.observe(4, 3.7)                                        # median(10, 1, 1.2) = 1.2
    assert not v.ok and v.reason == LOSS_SPIKE
    assert (v.median, v.threshold) == (1.2, pytest.approx(3.6))
    assert "loss_spike" in v.describe() and "3.7" in v.describe()
    assert g.observe(4, 3.5).ok                                  # below 3 x 1.2
    for step in (5, 6, 7):                                       # the window (4) slides
        assert g.observe(step, 1.0).ok
    assert g.median() == 1.0 and g.observe(8, 3.2).reason == LOSS_SPIKE
    assert HealthGuard(spike_factor=None, min_history=1).observe(9, 1e9).ok


def test_guard_rewinds_history_and_counts_rollbacks():
    g = HealthGuard(window=10, min_history=2, max_rollbacks=2)
    for step, loss in enumerate([1.0, 1.0, 3.0, 3.0, 3.0], 1):
        assert g.observe(step, loss).ok
    assert g.median() == 3.0
    g.rewind(2)                                                  # back to step 2
    assert g.median() == 1.0
    bad = g.observe(3, float("nan"))
    assert g.rollback(bad) == 1 and g.rollback(bad) == 2
    with pytest.raises(TrainingHealthError, match="max_rollbacks=2") as err:
        g.rollback(bad)
    assert len(err.value.verdicts) == 3 and not isinstance(err.value, RuntimeError)
    g.reset()
    assert g.rollbacks == [] and g.median() is None


@pytest.mark.parametrize("kw", [{"spike_factor": 1.0}, {"window": 0},
                                {"window": 5, "min_history": 6}, {"max_rollbacks": -1}])
def test_guard_refuses_bad_settings(kw):
    with pytest.raises(ValueError):
        HealthGuard(**kw)


def test_event_lines_round_trip():
    line = format_event("train.rollback", step=13, loss=float("nan"), median=1.234567891,
                        skip_indices=[3, 17], note="two words", none=None, ok=True)
    assert line == ('train.rollback step=13 loss=nan median=1.23457 skip_indices=3,17 '
                    'note="two words" none=- ok=true')
    assert parse_event(line) == ("train.rollback", {
        "step": "13", "loss": "nan", "median": "1.23457", "skip_indices": "3,17",
        "note": "two words", "none": "-", "ok": "true"})


# ------------------------------------------------------------------------------- the trainer


def test_nan_batch_rolls_back_skips_it_and_finishes(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    port = free_port()
    t = trainer(tmp_path, make_step_fn("nan"), observability=observed(tmp_path, metrics_port=port))
    try:
        summary = t.fit(STEPS)
        scraped = scrape(port)
    finally:
        t.close()
    assert summary.final_step == STEPS and math.isfinite(summary.final_loss)
    assert (summary.rollbacks, summary.skipped_batches) == (1, 1)

    [anomaly] = event_lines(caplog, "train.anomaly")
    assert (anomaly["step"], anomaly["reason"], anomaly["loss"]) == ("13", NONFINITE_LOSS, "nan")
    [rollback] = event_lines(caplog, "train.rollback")
    # Step 10's verified window (11-14) failed at 13: the rollback goes to verified step 5.
    assert (rollback["step"], rollback["restored_step"], rollback["rollbacks"]) == ("13", "5", "1")
    assert rollback["skip_indices"] == ",".join(map(str, BAD_BATCH))
    [skip] = event_lines(caplog, "train.skip")
    assert skip["step"] == "13" and str(MARKED) in skip["indices"].split(",")
    steps = event_lines(caplog, "train.step")
    assert [s["step"] for s in steps][-1] == str(STEPS) and steps[-1]["rollbacks"] == "1"

    assert scraped["ckpt_train_rollbacks_total"] == 1
    assert scraped["ckpt_train_skipped_batches_total"] == 1
    assert scraped["ckpt_train_step"] == STEPS
    assert scraped["ckpt_train_steps_total"] == STEPS + 7            # 6 to 12 twice
    assert math.isfinite(scraped["ckpt_train_loss"])
    assert scraped["ckpt_train_step_seconds_count"] == STEPS + 7
    assert scraped["ckpt_restores_total"] == 1                       # the rollback's
    assert scraped["ckpt_last_committed_step"] == STEPS              # same port, ckpt_*

    check_trained_order(tmp_path, skipped_steps=[BAD_STEP])
    [audit_skip] = read_skips(tmp_path / "audit")
    assert audit_skip["step"] == BAD_STEP and audit_skip["indices"] == BAD_BATCH
    assert all(MARKED not in r["ranks"][0] for r in read_audit(tmp_path / "audit").values())
    [record] = [r for r in read_jsonl(tmp_path / "ckpt" / ".elastic" / "attempt-0000" /
                                      "rank-00000.jsonl") if r["event"] == "rollback"]
    assert record["restored_step"] == 5 and record["loss"] == "nan"


def test_loss_spike_from_a_corrupted_batch_takes_the_same_path(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    textfile = tmp_path / "train.prom"
    t = trainer(tmp_path, make_step_fn("spike"),
                observability=observed(tmp_path, metrics_textfile=textfile))
    summary = t.fit(STEPS)
    [anomaly] = event_lines(caplog, "train.anomaly")
    assert (anomaly["step"], anomaly["reason"]) == ("13", LOSS_SPIKE)
    assert float(anomaly["threshold"]) == pytest.approx(5 * float(anomaly["median"]), rel=1e-5)
    assert float(anomaly["loss"]) > float(anomaly["threshold"])
    assert math.isfinite(float(anomaly["grad_norm"]))
    [rollback] = event_lines(caplog, "train.rollback")
    assert rollback["restored_step"] == "5" and rollback["reason"] == LOSS_SPIKE
    assert summary.final_step == STEPS and summary.final_loss < 5 * float(anomaly["median"])
    written = parse_metrics(textfile.read_text())
    assert written["ckpt_train_rollbacks_total"] == 1
    assert written["ckpt_train_skipped_batches_total"] == 1
    assert written["ckpt_train_step"] == STEPS
    assert written["ckpt_saves_total"] >= 1
    check_trained_order(tmp_path, skipped_steps=[BAD_STEP])


def test_a_healthy_run_triggers_nothing(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    port = free_port()
    t = trainer(tmp_path, make_step_fn(None), observability=observed(tmp_path, metrics_port=port))
    try:
        summary = t.fit(STEPS)
        scraped = scrape(port)
    finally:
        t.close()
    assert summary.final_step == STEPS and (summary.rollbacks, summary.skipped_batches) == (0, 0)
    for event in ("train.anomaly", "train.rollback", "train.skip", "train.give_up"):
        assert not event_lines(caplog, event), event
    assert [s["step"] for s in event_lines(caplog, "train.step")] == [
        str(s) for s in range(5, STEPS + 1, 5)]
    assert scraped["ckpt_train_rollbacks_total"] == 0
    assert scraped["ckpt_train_skipped_batches_total"] == 0
    assert scraped["ckpt_train_steps_total"] == STEPS
    assert scraped["ckpt_train_world_size"] == 1
    assert scraped["ckpt_train_restarts_total"] == 0
    assert scraped["ckpt_train_heartbeat_age_seconds"] == 0         # no peers
    assert scraped["ckpt_train_learning_rate"] == pytest.approx(0.1)
    assert scraped["ckpt_train_grad_norm"] == pytest.approx(t.metrics.snapshot()["grad_norm"])
    assert scraped["ckpt_saves_total"] == STEPS // EVERY + 1        # with step 0
    check_trained_order(tmp_path, skipped_steps=[])
    assert read_skips(tmp_path / "audit") == []

    # Every series the example dashboard queries is one this run exported.
    exprs = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"]
             for target in panel.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bckpt_[a-z_]+\b", e)}
    exported = {n.split("{", 1)[0] for n in scraped}
    assert len(used) >= 15 and used <= exported, used - exported
    assert set(metric_names()) <= exported


def test_persistent_failure_gives_up_after_max_rollbacks(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    holder: list[ElasticTrainer] = []

    def diverged(model, batch):  # from step 7 on every batch fails: not a bad batch
        loss = make_step_fn(None)(model, batch)
        return loss * float("nan") if holder[0].step >= 6 else loss

    t = trainer(tmp_path, diverged, health=HealthGuard(max_rollbacks=2))
    holder.append(t)
    with pytest.raises(TrainingHealthError, match=r"more than max_rollbacks=2") as err:
        t.fit(STEPS)
    assert "step 7: nonfinite_loss" in str(err.value)
    assert len(event_lines(caplog, "train.rollback")) == 2
    # Two different batches were marked bad; the second rollback passes over both again.
    offsets = [int(e["offset"]) for e in event_lines(caplog, "train.skip")]
    assert offsets == [48, 48, 56] == [6 * GLOBAL, 6 * GLOBAL, 7 * GLOBAL]
    assert t.metrics.snapshot()["skipped_batches_total"] == 2
    [give_up] = event_lines(caplog, "train.give_up")
    assert give_up["rollbacks"] == "2" and give_up["max_rollbacks"] == "2"
    assert t.metrics.snapshot()["rollbacks_total"] == 2
    failures = [r for r in read_jsonl(tmp_path / "ckpt" / ".elastic" / "attempt-0000" /
                                      "rank-00000.jsonl") if r["event"] == "failure"]
    assert [f["reason"] for f in failures] == ["unhealthy"]


def crash_once_at(step: int, step_fn, holder: list):
    """``step_fn`` that fails the first trainer in ``holder`` during ``step`` (after the
    rollback of ``BAD_STEP``: the trainer reaches ``step`` only on the new timeline)."""
    def fn(model, batch):
        if len(holder) == 1 and holder[0].step == step - 1:
            raise ValueError("the node went away")
        return step_fn(model, batch)
    return fn


def test_a_restart_skips_the_batches_earlier_rollbacks_skipped(tmp_path, caplog):
    """A crash after the rollback, before the next checkpoint: the next run resumes from the
    checkpoint before the bad batch and passes over it without a new rollback. The crash
    (step 14) is inside the window of the new step 10 (11-14), so the resume goes to the
    verified step 5."""
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    holder: list[ElasticTrainer] = []
    nan_step = make_step_fn("nan")

    first = trainer(tmp_path, crash_once_at(BAD_STEP + 1, nan_step, holder))
    holder.append(first)
    with pytest.raises(ValueError, match="went away"):
        first.fit(STEPS)
    assert first.metrics.snapshot()["rollbacks_total"] == 1
    caplog.clear()
    second = trainer(tmp_path, nan_step)
    summary = second.fit(STEPS)
    assert summary.restores == [0, 5] and summary.final_step == STEPS
    [resume] = event_lines(caplog, "train.resume")
    assert (resume["step"], resume["known_bad_batches"]) == ("5", "1")
    assert not event_lines(caplog, "train.rollback")
    assert [s["step"] for s in event_lines(caplog, "train.skip")] == [str(BAD_STEP)]
    assert second.metrics.snapshot()["skipped_batches_total"] == 1
    check_trained_order(tmp_path, skipped_steps=[BAD_STEP])


def test_a_restart_without_the_run_directory_passes_over_the_batches_its_checkpoint_marks(
        tmp_path, caplog):
    """The restart runs on a run directory of its own (one not shared between the nodes),
    so ``skips.jsonl`` cannot tell it of the rollback. The crash at step 18 comes after
    the new timeline's step 10 was verified (window 11-14) and before step 15's window
    ended: the restart resumes from step 10, saved after the rollback, whose metadata
    marks the batch of step 13 bad; it passes over it without a second rollback."""
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    holder: list[ElasticTrainer] = []
    nan_step = make_step_fn("nan")
    first = trainer(tmp_path, crash_once_at(18, nan_step, holder),
                    observability=observed(tmp_path, run_dir=tmp_path / "node-a"))
    holder.append(first)
    with pytest.raises(ValueError, match="went away"):
        first.fit(STEPS)
    assert first.metrics.snapshot()["rollbacks_total"] == 1
    first.close()
    caplog.clear()
    second = trainer(tmp_path, nan_step,
                     observability=observed(tmp_path, run_dir=tmp_path / "node-b"))
    holder.append(second)
    try:
        summary = second.fit(STEPS)
    finally:
        second.close()
    assert summary.final_step == STEPS
    [resume] = event_lines(caplog, "train.resume")
    assert (resume["step"], resume["known_bad_batches"]) == ("10", "1")
    assert not event_lines(caplog, "train.rollback")
    assert [s["step"] for s in event_lines(caplog, "train.skip")] == [str(BAD_STEP)]
    check_trained_order(tmp_path, skipped_steps=[BAD_STEP])


@pytest.mark.parametrize("item", [
    [104], {"global_batch": 8}, {"global_batch": "8", "offsets": [104]},
    {"global_batch": 8, "offsets": [-8]}, {"global_batch": 8, "offsets": [104.0]},
    {"global_batch": 0, "offsets": [104]}])
def test_a_malformed_bad_batches_item_is_ignored_with_a_warning(item, caplog):
    caplog.set_level(logging.INFO, logger="trainer.elastic")
    assert carried_bad_batches({BAD_BATCHES_KEY: item}, 8) == []
    assert "not well formed" in caplog.text


def test_bad_batches_carried_at_another_global_batch_size_are_not_passed_over(caplog):
    """Offset 104 starts a batch at 8 samples per step and at 4 alike, but not the same
    batch: a checkpoint's marks hold only for the size they were made at."""
    caplog.set_level(logging.INFO, logger="trainer.elastic")
    meta = {BAD_BATCHES_KEY: {"global_batch": 8, "offsets": [104, 96, 104]}}
    assert carried_bad_batches(meta, 8) == [96, 104]
    assert carried_bad_batches(meta, 4) == []
    assert "not passed over" in caplog.text
    assert carried_bad_batches({}, 8) == []


def test_grad_scaler_gradients_are_unscaled_before_clipping(tmp_path):
    """With a GradScaler the measured (and clipped) norm is the true one: the same run with
    and without a scaler (a power-of-two scale: exact) takes the same steps."""
    norms = {}
    for name, scaler in (("plain", None), ("scaled", torch.amp.GradScaler(
            "cpu", init_scale=2.0 ** 12))):
        t = trainer(tmp_path / name, make_step_fn(None),
                    step=StepConfig(grad_scaler=scaler, max_grad_norm=0.5),
                    observability=observed(tmp_path / name, run_dir=tmp_path / name / "run"))
        summary = t.fit(10)
        norms[name] = [r["grad_norm"] for r in read_jsonl(
            tmp_path / name / "run" / "attempt-0000" / "rank-00000.jsonl")
            if r["event"] == "step"]
        norms[name + " loss"] = summary.final_loss
    assert len(norms["plain"]) == 10 and max(norms["plain"]) > 0.5  # clipping was active
    assert norms["scaled"] == pytest.approx(norms["plain"], rel=1e-5)
    assert norms["scaled loss"] == pytest.approx(norms["plain loss"], rel=1e-5)
    manifest = json.loads((tmp_path / "scaled" / "ckpt" / "step-00000010" /
                           "manifest.json").read_text())
    assert "scaler" in manifest["items"]


def test_heartbeat_age_is_the_slowest_live_peers_silence():
    """ckpt_train_heartbeat_age_seconds: small while peers beat (a peer that finished
    cleanly does not count), growing once one goes silent (hung)."""
    import time

    import torch.distributed as dist

    from trainer.heartbeat import Heartbeat
    from trainer.metrics import TrainerMetrics, slowest_peer_age

    assert slowest_peer_age(None) == 0.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    beats = [Heartbeat(dist.PrefixStore("hb", store), r, 3, timeout=5.0, interval=0.05).start()
             for r in range(3)]
    metrics = TrainerMetrics()
    metrics.heartbeat = beats[0]
    try:
        time.sleep(0.4)
        assert metrics.snapshot()["heartbeat_age_seconds"] < 0.6
        beats[2].stop(final_state="done")     # rank 2 finished: not a lost peer
        time.sleep(0.6)
        assert metrics.snapshot()["heartbeat_age_seconds"] < 0.6
        beats[1]._stopping.set()              # rank 1 hangs: its beat stops changing
        time.sleep(1.5)                       # (it may still send the beat in progress)
        assert 1.0 <= metrics.snapshot()["heartbeat_age_seconds"] < 5.0
    finally:
        for b in beats:
            b.stop()


def test_rollback_with_a_grad_scaler(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    t = trainer(tmp_path, make_step_fn("nan"), step=StepConfig(grad_scaler=scaler))
    summary = t.fit(20)
    assert (summary.final_step, summary.rollbacks, summary.skipped_batches) == (20, 1, 1)
    assert math.isfinite(summary.final_loss) and scaler.get_scale() == 2.0 ** 10


def test_overflowing_scaled_gradients_are_left_to_the_scaler(tmp_path, caplog):
    """In the first 3 steps a term adds 1e35 to every gradient (the loss is unchanged):
    scaled by 2**16 it overflows. The scaler skips those updates and backs off to 2**13;
    that is the scaler's business, not a reason to roll back."""
    caplog.set_level(logging.INFO, logger="ckpt.trainer")
    holder: list[ElasticTrainer] = []
    plain = make_step_fn(None)

    def overflowing(model, batch):
        loss = plain(model, batch)
        if holder[0].step < 3:
            w = model[0].weight
            loss = loss + 1e35 * (w.sum() - w.sum().detach())
        return loss

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    t = trainer(tmp_path, overflowing, step=StepConfig(grad_scaler=scaler),
                observability=observed(tmp_path, run_dir=tmp_path / "run"))
    holder.append(t)
    summary = t.fit(10)
    norms = [r["grad_norm"] for r in read_jsonl(tmp_path / "run" / "attempt-0000" /
                                                "rank-00000.jsonl") if r["event"] == "step"]
    assert all(n in ("inf", "nan") for n in norms[:3]), norms
    assert all(isinstance(n, float) and n < 100 for n in norms[3:]), norms
    assert summary.rollbacks == 0 and not event_lines(caplog, "train.anomaly")
    assert summary.final_step == 10 and scaler.get_scale() == 2.0 ** 13


# ------------------------------------------- a user's DataLoader, hooks, extra state, seeds


def collate_with_ids(samples):
    """A user's own collate_fn: (x, label, index) samples into three tensors."""
    xs, ys, ids = zip(*samples)
    return torch.stack(xs), torch.stack(ys), torch.tensor(ids)


def loader_factory(batch_sampler):
    return torch.utils.data.DataLoader(Blobs(), batch_sampler=batch_sampler, num_workers=2,
                                       collate_fn=collate_with_ids, pin_memory=False)


class Seen:
    """The sample indices each step trained, as ``step_fn`` received them; a step trained
    again (after a rollback or a restart) replaces the earlier try."""

    def __init__(self) -> None:
        self.steps: dict[int, list[list[int]]] = {}
        self.trainer: ElasticTrainer | None = None

    def wrap(self, step_fn):
        def wrapped(model, batch):
            loss = step_fn(model, batch)  # raises before anything is noted, if it does
            step = self.trainer.step + 1
            for later in [s for s in self.steps if s > step]:  # rewound: later steps undone
                del self.steps[later]
            micro = self.steps.setdefault(step, [])
            if len(micro) == GLOBAL // MICRO:  # a new try of this step
                micro.clear()
            micro.append(batch[2].tolist())
            return loss
        return wrapped

    def order(self) -> list[list[int]]:
        return [[i for m in self.steps[s] for i in m] for s in sorted(self.steps)]


def test_a_users_data_loader_trains_exactly_the_trainers_batches(tmp_path):
    """data_loader=factory (2 workers, the user's collate_fn): the same samples in the same
    order as the trainer's own reading, with bit-identical results, across the NaN
    rollback (the loader restarts at the restored position) and across a crash after
    the workers fetched ahead of the checkpoint: the saved position is the loop's. (The
    crash, step 17, is inside step 15's verified window, so the resume goes to step 10.)"""
    nan = make_step_fn("nan")
    own = Seen()
    own.trainer = trainer(tmp_path / "own", own.wrap(nan))
    own_summary = own.trainer.fit(20)

    seen, crash = Seen(), [True]

    def crash_at_17(model, batch):
        if crash[0] and seen.trainer.step == 16:
            raise ValueError("the node went away")
        return nan(model, batch)

    seen.trainer = trainer(tmp_path / "loader", seen.wrap(crash_at_17),
                           data=DataConfig(data_loader=loader_factory))
    with pytest.raises(ValueError, match="went away"):
        seen.trainer.fit(20)
    crash[0] = False
    seen.trainer = trainer(tmp_path / "loader", seen.wrap(crash_at_17),
                           data=DataConfig(data_loader=loader_factory))
    summary = seen.trainer.fit(20)
    assert summary.restores == [0, 10] and own_summary.rollbacks == 1
    assert seen.order() == own.order() == [
        b for k, b in enumerate(no_failure_order(21), 1) if k != BAD_STEP]
    assert ({s: (r["ranks"], r["micro"]) for s, r in read_audit(tmp_path / "loader" /
                                                               "audit").items()}
            == {s: (r["ranks"], r["micro"]) for s, r in read_audit(tmp_path / "own" /
                                                                  "audit").items()})
    assert summary.final_loss == own_summary.final_loss
    for k, v in seen.trainer.module.state_dict().items():
        assert torch.equal(v, own.trainer.module.state_dict()[k]), k


class Counter:
    """A user's counter saved with the checkpoints (a stateful object)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def test_hooks_and_extra_state_survive_a_restart(tmp_path):
    """after_step keeps an EMA of the weights and a counter, both saved with each checkpoint
    (extra_state); evaluate runs every 4 steps without touching training's RNG; after a
    crash the resumed run continues the EMA and the counter from the checkpoint and ends
    bit-identical to an uninterrupted run."""
    calls: list[tuple] = []

    def run(name: str, crash_at: int | None = None):
        ema, counter = {}, Counter()

        def extra(model):
            ema["model"] = torch.optim.swa_utils.AveragedModel(
                model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
            return {"ema": ema["model"], "counter": counter}

        def after_step(t, step):
            if step == crash_at:
                raise ValueError("the node went away")
            calls.append(("step", step, counter.n, int(ema["model"].n_averaged)))
            ema["model"].update_parameters(t.module)
            counter.n += 1

        def evaluate(t, step):
            assert not t.module.training and not torch.is_grad_enabled()
            torch.rand(100)  # an evaluation that draws random numbers
            calls.append(("eval", step))

        hooks = trainer_hooks(after_step=after_step, evaluate=evaluate, eval_every=4,
                              after_checkpoint=lambda t, step: calls.append(("ckpt", step)))
        t = trainer(tmp_path / name, make_step_fn(None), hooks=hooks, health=None,
                    checkpoint=CheckpointConfig(extra_state=extra,
                                                manager_options={"keep_last": 5}))
        return t, ema, counter

    def kind(k: str, after: int = 0) -> list[tuple]:
        return [c for c in calls if c[0] == k and c[1] > after]

    reference, ref_ema, ref_counter = run("reference")
    reference.fit(12)
    assert [c[1] for c in kind("ckpt")] == [5, 10, 12]
    assert [c[1] for c in kind("eval")] == [4, 8, 12]
    reference_calls, calls[:] = calls[:], []
    first, _, _ = run("resumed", crash_at=8)
    with pytest.raises(ValueError, match="went away"):
        first.fit(12)
    # after_checkpoint is reported when the trainer sees the commit (before a later step):
    # step 5's may not have been seen before the crash at step 8, but none other may appear.
    assert kind("ckpt") in ([], [("ckpt", 5)])
    calls.clear()
    second, ema, counter = run("resumed")
    assert second.fit(12).restores == [0, 5]
    # From step 5's EMA and counter on, the same calls as the uninterrupted run.
    assert kind("step")[0] == ("step", 6, 5, 5) and counter.n == ref_counter.n == 12
    for k in ("step", "eval", "ckpt"):
        assert kind(k) == [c for c in reference_calls if c[0] == k and c[1] > 5], k
    for k, v in ema["model"].state_dict().items():
        assert torch.equal(v, ref_ema["model"].state_dict()[k]), k
    for k, v in second.module.state_dict().items():
        assert torch.equal(v, reference.module.state_dict()[k]), k


def trainer_hooks(**kw):
    from trainer import Hooks
    return Hooks(**kw)


def test_extra_state_may_not_take_the_trainers_item_names(tmp_path):
    t = trainer(tmp_path, make_step_fn(None),
                checkpoint=CheckpointConfig(extra_state=lambda m: {"model": m}))
    with pytest.raises(ValueError, match=r"may not use the item names \['model'\]"):
        t.fit(1)


def test_seed_seeds_numpy_and_a_resume_continues_its_stream(tmp_path):
    import numpy as np

    draws: dict[str, dict[int, list[float]]] = {"reference": {}, "resumed": {}}
    holder: list = []

    def step_fn(run: str, crash_at: int | None = None):
        def fn(model, batch):
            step = holder[-1].step + 1
            if step == crash_at:
                raise ValueError("the node went away")
            if len(draws[run].get(step, [])) == GLOBAL // MICRO:
                draws[run][step] = []  # trained again
            draws[run].setdefault(step, []).append(float(np.random.random()))
            return make_step_fn(None)(model, batch)
        return fn

    holder.append(trainer(tmp_path / "reference", step_fn("reference"), health=None))
    holder[-1].fit(8)
    np.random.seed(SEED + 1)  # rank 0's streams after the model is built
    assert draws["reference"][1] == [np.random.random(), np.random.random()]
    holder.append(trainer(tmp_path / "resumed", step_fn("resumed", crash_at=7), health=None))
    with pytest.raises(ValueError):
        holder[-1].fit(8)
    np.random.seed(12345)  # whatever the process did meanwhile
    holder.append(trainer(tmp_path / "resumed", step_fn("resumed"), health=None))
    holder[-1].fit(8)
    assert draws["resumed"] == draws["reference"]


# ------------------------------------------------- the forward check gates every restore


def poison_at(step: int, *, exit_after_save: bool = False):
    """Hooks: after the update of ``step`` (once per process, in the first attempt) the
    weights go NaN, as after an overflowing update, before the step's checkpoint; with
    ``exit_after_save`` the process dies once that checkpoint is committed."""
    from trainer import Hooks

    done: list[int] = []

    def after_step(t, s):
        if s == step and not done and t.attempt == 0:
            done.append(s)
            with torch.no_grad():
                t.module[0].weight[0, 0] = float("nan")

    def after_checkpoint(t, s):
        if s == step and done and exit_after_save:
            logging.getLogger("test").warning("exiting after the checkpoint of step %d", s)
            os._exit(1)

    return Hooks(after_step=after_step, after_checkpoint=after_checkpoint)


def test_a_rollback_never_lands_on_a_step_whose_weights_went_nan(tmp_path, caplog):
    """Step 10's update made a weight NaN; the loss and gradient of step 10 were fine, so
    the guard let it pass and step 10 was saved. Step 11's loss is NaN: the rollback's
    restore runs the probe through step 10's weights, refuses them and lands on step 5.
    With digests only it lands on step 10's NaN weights and gives up. No verified window:
    it would pass over step 10 (its window failed at 11) before the forward check runs."""
    caplog.set_level(logging.INFO)
    t = trainer(tmp_path / "forward", make_step_fn(None), hooks=poison_at(10),
                checkpoint=CheckpointConfig(verified_window=None))
    summary = t.fit(20)
    assert (summary.final_step, summary.rollbacks) == (20, 1) and math.isfinite(
        summary.final_loss)
    [rollback] = event_lines(caplog, "train.rollback")
    assert (rollback["step"], rollback["restored_step"]) == ("11", "5")
    assert any("skipping step=10" in r.getMessage() and "forward check failed" in
               r.getMessage() for r in caplog.records if r.name == "ckpt"), "not refused"
    assert all(bool(torch.isfinite(p).all()) for p in t.module.parameters())

    digest_only = trainer(tmp_path / "digest", make_step_fn(None), hooks=poison_at(10),
                          checkpoint=CheckpointConfig(verify="digest", verified_window=None),
                          health=HealthGuard(max_rollbacks=2))
    with pytest.raises(TrainingHealthError, match="more than max_rollbacks=2"):
        digest_only.fit(20)


def test_the_default_probe_is_a_micro_batch_of_the_dataset(tmp_path):
    t = trainer(tmp_path, make_step_fn(None), health=None)
    t.fit(5)
    probe = ckpt.load(tmp_path / "ckpt" / "step-00000005")["__probe__"]
    assert torch.equal(probe["inputs"], Blobs().x[:MICRO]) and probe["finite"]
    assert probe["output"].shape == (MICRO, 4)
    # an explicit probe the model cannot run is refused at start
    bare = trainer(tmp_path / "bare", make_step_fn(None), health=None,
                   checkpoint=CheckpointConfig(probe=lambda batch: "not a tensor"))
    with pytest.raises(ValueError, match="probe cannot run"):
        bare.fit(1)
    with pytest.raises(ValueError, match="verify must be one of"):
        trainer(tmp_path, make_step_fn(None), checkpoint=CheckpointConfig(verify="forwards"))


# ------------------------------------------------------------------------------- two ranks
#
# Each test runs its own torchrun job (an agent and two workers, each importing torch); the
# jobs of the selected tests start the first time one of them asks (``torchrun_jobs``), two
# at a time, the longest first, and each test asserts on the output of its own.


def run_torchrun(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=2 test_health.py TMP MODE`` (see _worker)."""
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo)
    restarts = []
    if mode == "nan-weights":
        # Restarted workers sharing the agent's store may fail to form their group
        # (FINDINGS.md)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        restarts = ["--max-restarts=1"]
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    args = ["--standalone",
            f"--log-dir={tmp_path / 'torchelastic'}",  # not a /tmp/torchelastic_* left behind
            "--nproc-per-node=2", *restarts, __file__, str(tmp_path), mode]
    # the agent forked from the suite's fork server: no second import of torch for it
    return torchrun_forked(args, env, tmp_path, timeout=240)


class Jobs:
    """``jobs[mode]``: the finished job (its CompletedProcess) and its directory."""

    def __init__(self, futures: dict) -> None:
        self.futures = futures

    def __getitem__(self, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
        future, tmp = self.futures[mode]
        return future.result(), tmp


@pytest.fixture(scope="module")
def torchrun_jobs(request, tmp_path_factory):
    modes = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        if item.originalname == "test_torchrun_job_resumes_past_a_step_saved_with_nan_weights":
            modes.append("nan-weights")
        elif item.originalname == "test_two_ranks_agree_to_roll_back_when_one_rank_sees_nan":
            modes.append(item.callspec.params["wrap"])
    order = ["nan-weights", "fsdp", "ddp"]  # the longest first
    with cf.ThreadPoolExecutor(2) as pool:
        futures = {}
        for mode in sorted(set(modes), key=order.index):
            tmp = tmp_path_factory.mktemp(mode)
            futures[mode] = (pool.submit(run_torchrun, tmp, mode), tmp)
        yield Jobs(futures)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_two_ranks_agree_to_roll_back_when_one_rank_sees_nan(torchrun_jobs, wrap):
    """torchrun, 2 ranks: the marked sample is in rank 1's half of the batch, so only rank 1
    computes a NaN loss at step 13. Both ranks judge the agreed loss: step 10's verified
    window (11-14, the default 4 steps) fails, so neither marks it and both roll back to the
    verified step 5 (not the newest, step 10) and skip the same batch. Only rank 0 writes
    verified markers: step 10's is the new timeline's (confirmed at 14)."""
    assert BAD_BATCH.index(MARKED) >= GLOBAL // 2  # rank 1's share
    proc, tmp_path = torchrun_jobs[wrap]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads(next(line for line in proc.stdout.splitlines()
                              if line.startswith("SUMMARY "))[len("SUMMARY "):])
    assert (summary["final_step"], summary["rollbacks"], summary["skipped_batches"]) == (
        STEPS, 1, 1)
    assert summary["world_sizes"] == [2] and math.isfinite(summary["final_loss"])
    for rank in (0, 1):
        [rb] = [r for r in read_jsonl(tmp_path / "ckpt" / ".elastic" / "attempt-0000" /
                                      f"rank-{rank:05d}.jsonl") if r["event"] == "rollback"]
        assert (rb["step"], rb["restored_step"], rb["skip_indices"]) == (13, 5, BAD_BATCH)
        assert (f"[rank {rank}] ckpt.trainer train.unverified step=10 at_step=13 "
                f"reason=nonfinite_loss") in proc.stderr, proc.stderr[-6000:]
    marked = re.findall(r"\[rank (\d)\] ckpt.trainer train.verified step=(\d+) "
                        r"confirmed_at=(\d+)", proc.stderr)
    assert {rank for rank, _, _ in marked} == {"0"}, marked
    assert [(s, c) for _, s, c in marked if s in ("5", "10")] == [("5", "9"), ("10", "14")]
    cps = ckpt.inspect.open(str(tmp_path / "ckpt"))
    kept = {s: cps.marker(s) for s in cps.steps()}
    assert sorted(kept) == [30, 35, 40] and kept[40].status == "unverified"
    assert kept[35].verification.evidence["confirmed_at"] == 39
    assert {r["rank"] for r in read_skips(tmp_path / "audit")} == {0, 1}
    check_trained_order(tmp_path, skipped_steps=[BAD_STEP])


@pytest.mark.slow
@pytest.mark.multiproc
def test_torchrun_job_resumes_past_a_step_saved_with_nan_weights(torchrun_jobs):
    """torchrun, 2 ranks, at most one restart: step 10's update makes a weight NaN (loss and
    gradient were fine, so step 10 is saved, synchronously), then both workers die. The
    restarted workers' restore refuses step 10 by its forward check and resumes from step
    5; the job finishes on its own, with finite weights and no rollback. The workers run
    without a verified window: with it the restore would pass over step 10 (unverified)
    for the verified step 5 before the forward check, this test's subject, runs."""
    proc, _ = torchrun_jobs["nan-weights"]
    out = proc.stdout[-3000:] + proc.stderr[-8000:]
    assert proc.returncode == 0, out
    assert "exiting after the checkpoint of step 10" in proc.stderr, out
    assert "skipping step=10" in proc.stderr and "forward check failed" in proc.stderr, out
    summary = json.loads(next(line for line in proc.stdout.splitlines()
                              if line.startswith("SUMMARY "))[len("SUMMARY "):])
    assert (summary["final_step"], summary["restores"], summary["rollbacks"]) == (
        NAN_STEPS, [0, 5], 0)
    assert summary["world_sizes"] == [2, 2] and math.isfinite(summary["final_loss"])


NAN_STEPS = 15


def _worker(argv: list[str]) -> None:
    """The torchrun worker of the two-rank tests: ``test_health.py TMP ddp|fsdp|nan-weights``."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[rank {os.environ.get('RANK')}] %(name)s %(message)s")
    if argv[1] == "nan-weights":
        t = trainer(Path(argv[0]), make_step_fn(None), hooks=poison_at(10, exit_after_save=True),
                    checkpoint=CheckpointConfig(manager_options={"async_save": False},
                                                verified_window=None),
                    failure=FailureConfig(heartbeat_timeout=10.0, collective_timeout=30.0))
        summary = t.fit(NAN_STEPS)
        assert all(bool(torch.isfinite(p).all()) for p in t.module.parameters())
        if t.rank == 0:
            print("SUMMARY " + json.dumps(summary.to_dict()), flush=True)
        return
    t = trainer(Path(argv[0]), make_step_fn("nan"), step=StepConfig(fsdp=argv[1] == "fsdp"),
                failure=FailureConfig(heartbeat_timeout=10.0, collective_timeout=30.0))
    summary = t.fit(STEPS)
    if t.rank == 0:
        print("SUMMARY " + json.dumps(summary.to_dict()), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1:])
