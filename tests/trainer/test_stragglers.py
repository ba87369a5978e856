"""Straggler scores and the drop policy (trainer/stragglers.py).

The scores compare each rank's mean time per step in each section over a window with the
median of the ranks and with the rank's own best window; the overall score sums the
sections where a rank works on its own. The policy drops a rank flagged in N consecutive
windows. The last tests run the trainer: one rank made 3x slower than the others is scored
as such (gloo ranks, policy off), and dropped after N windows (torchrun, policy on).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support import elastic_job as job
from tests.support.prom import parse_metrics
from tests.support.ranks import run_ranks
from tests.trainer import test_elastic as elastic
from trainer.config import (CheckpointConfig, ElasticConfig, FailureConfig,
                            ObservabilityConfig, StragglerConfig)
from trainer.metrics import parse_event
from trainer.progress import ElasticSummary
from trainer.stragglers import (DropPolicy, Scorer, StragglerWatch, detect_windows,
                                median_low, summarize)

SECTIONS = ("data", "forward", "backward", "collective", "optimizer")


def window(slow: dict[int, float] | None = None, world: int = 3, *, forward: float = 0.05,
           wait_in_backward: bool = True) -> list[list[float]]:
    """A window's table: every rank's forward takes ``forward`` s, times ``slow[rank]``;
    under DDP the others wait for the slowest inside backward."""
    slow = slow or {}
    fwd = [forward * slow.get(r, 1.0) for r in range(world)]
    rows = []
    for r in range(world):
        backward = 0.05 + ((max(fwd) - fwd[r]) if wait_in_backward else 0.0)
        rows.append([0.004, fwd[r], backward, 0.002, 0.01])
    return rows


# ------------------------------------------------------------------------------- the scores


def test_a_rank_three_times_slower_scores_about_three_and_the_waiting_ranks_one():
    scorer = Scorer(SECTIONS)
    s = scorer.score(window({2: 3.0}), 1, 10)
    assert s.slowest() == 2 and s.worst_section(2) == "forward"
    assert s.relative[2]["forward"] == pytest.approx(3.0)
    assert s.overall[2] == pytest.approx((0.004 + 0.15 + 0.01) / (0.004 + 0.05 + 0.01))
    assert s.overall[2] > 2.0
    assert s.overall[0] == s.overall[1] == pytest.approx(1.0)
    # the fast ranks waited in backward (the gradient all-reduce) longer than the slow one
    # worked there: waiting on peers is not in the overall score
    assert s.seconds[0]["backward"] > 2 * s.seconds[2]["backward"]
    assert s.relative[2]["backward"] < 1.0


def test_with_two_ranks_the_slower_is_measured_against_the_faster():
    assert median_low([1.0, 3.0]) == 1.0 and median_low([3.0, 1.0, 2.0]) == 2.0
    s = Scorer(SECTIONS).score(window({1: 3.0}, world=2), 1, 10)
    assert s.relative[1]["forward"] == pytest.approx(3.0)
    assert s.relative[0]["forward"] == pytest.approx(1.0)


def test_sections_shorter_than_the_floor_are_not_ratios_of_noise():
    table = [[1e-5, 0.05, 0.05, 0.002, 0.01], [9e-5, 0.05, 0.05, 0.002, 0.01]]
    s = Scorer(SECTIONS, floor=1e-3).score(table, 1, 10)
    assert s.relative[1]["data"] == pytest.approx(1.0)  # 9x, of microseconds
    assert Scorer(SECTIONS, floor=1e-6).score(table, 1, 10).relative[1]["data"] == \
        pytest.approx(9.0)


def test_a_slowdown_of_every_rank_shows_against_each_ranks_own_best():
    scorer = Scorer(SECTIONS)
    first = scorer.score(window(), 1, 10)
    assert first.overall_vs_best == {0: 1.0, 1: 1.0, 2: 1.0}
    later = scorer.score(window(forward=0.15), 11, 20)  # all three slowed down alike
    assert later.overall == {0: 1.0, 1: 1.0, 2: 1.0}
    assert all(v > 2.0 for v in later.overall_vs_best.values())
    assert later.vs_best[0]["forward"] == pytest.approx(3.0)
    back = scorer.score(window(), 21, 30)
    assert back.overall_vs_best == {0: 1.0, 1: 1.0, 2: 1.0} and back.index == 2


def test_a_window_record_is_json_with_rank_keys_as_strings():
    rec = Scorer(SECTIONS).score(window({1: 3.0}), 11, 20).to_record()
    assert (rec["window"], rec["first_step"], rec["last_step"]) == (0, 11, 20)
    assert set(rec["overall"]) == {"0", "1", "2"} and rec["overall"]["1"] > 2.0
    assert rec["relative"]["1"]["forward"] == 3.0
    with pytest.raises(ValueError, match="one row of 5 section times per rank"):
        Scorer(SECTIONS).score([[0.1, 0.2]], 1, 10)


def test_a_report_that_is_not_a_finite_time_counts_as_zero():
    table = window({2: 3.0})
    table[0] = [float("nan"), float("inf"), -5.0, 0.002, 0.01]
    s = Scorer(SECTIONS).score(table, 1, 10)
    assert s.seconds[0]["data"] == s.seconds[0]["forward"] == s.seconds[0]["backward"] == 0.0
    assert all(v == v and v < float("inf") for row in s.relative.values()
               for v in row.values())
    assert s.slowest() == 2


def test_a_large_jobs_window_record_details_only_the_flagged_and_the_slowest_ranks():
    """A record per window stays small at scale: every rank's overall scores, the section
    tables of the flagged ranks and the slowest one only; the summary still names the
    section."""
    s = Scorer(SECTIONS).score(window({7: 3.0, 12: 2.5}, world=40), 1, 10)
    rec = s.to_record({7, 12})
    assert len(rec["overall"]) == 40 and set(rec["seconds"]) == set(rec["section"]) == {
        "7", "12"}
    assert rec["section"]["7"] == "forward"
    st = summarize([(0, rec | {"flagged": [7, 12], "streaks": {}})])
    assert st["worst"] == {"attempt": 0, "rank": 7, "score": rec["overall"]["7"],
                           "section": "forward", "step": 10}


def test_the_summary_skips_records_that_are_not_well_formed():
    """The run directory's records are read back: a torn or forged stragglers record is
    left out of the summary, and the summary is still built from the others."""
    good = Scorer(SECTIONS).score(window({1: 3.0}), 1, 10).to_record()
    good.update(flagged=[1], dropped=None, streaks={"0": 0, "1": 1, "2": 0},
                window_steps=10, threshold=2.0)
    forged = [
        {"overall": [1, 2, 3]},                                # not a mapping
        {"overall": {"0": "fast", "1": float("nan"), "x": 9}, "flagged": "1"},
        {"overall": {"0": 1.0}, "seconds": {"0": {"data": "slow"}}, "dropped": "0; rm"},
        "not a record",
    ]
    st = summarize([(0, rec) for rec in forged] + [(0, good)])
    assert st["windows"] == 2 and st["dropped"] == []  # the good one, and the forged
    [flag] = st["flagged"]                             # record whose fields were dropped
    assert (flag["rank"], flag["windows"]) == (1, 1) and st["worst"]["rank"] == 1
    assert summarize([(0, rec) for rec in forged[:1] + forged[3:]]) is None


# ------------------------------------------------------------------------------- the policy


def test_a_rank_slow_for_n_consecutive_windows_is_dropped_at_the_nth():
    scorer, policy = Scorer(SECTIONS), DropPolicy(threshold=2.0, windows=3)
    decisions = [policy.observe(scorer.score(window({1: 3.0}), 10 * i + 1, 10 * i + 10))
                 for i in range(3)]
    assert decisions == [None, None, 1]
    assert detect_windows(3) == 3 and detect_windows() == StragglerConfig().windows


def test_a_window_at_normal_speed_resets_the_count():
    scorer, policy = Scorer(SECTIONS), DropPolicy(threshold=2.0, windows=2)
    seq = [{1: 3.0}, {}, {1: 3.0}, {1: 3.0}]
    assert [policy.observe(scorer.score(window(s), 1, 10)) for s in seq] == [
        None, None, None, 1]


def test_below_the_threshold_is_never_dropped_and_only_the_slowest_goes():
    scorer, policy = Scorer(SECTIONS), DropPolicy(threshold=2.0, windows=1)
    assert policy.observe(scorer.score(window({2: 1.5}), 1, 10)) is None
    assert policy.flagged(scorer.score(window({2: 1.5}), 1, 10)) == []
    five = scorer.score(window({1: 4.0, 3: 3.0}, world=5), 1, 10)
    assert policy.flagged(five) == [1, 3] and policy.observe(five) == 1


def test_policy_and_config_refuse_meaningless_settings():
    with pytest.raises(ValueError, match="above 1.0"):
        DropPolicy(threshold=0.5, windows=3)
    with pytest.raises(ValueError, match="at least 1"):
        DropPolicy(threshold=2.0, windows=0)
    with pytest.raises(ValueError, match="StragglerConfig.window must be a positive int"):
        StragglerConfig(window=0)
    with pytest.raises(ValueError, match="StragglerConfig.threshold must be above 1.0"):
        StragglerConfig(threshold=1.0)
    with pytest.raises(TypeError, match="ElasticConfig.stragglers must be a StragglerConfig"):
        ElasticConfig(stragglers={"drop": True})
    assert ElasticConfig().stragglers.drop is False  # off by default


# ------------------------------------------------------------------------------- in the trainer


class FakeStats:
    def __init__(self, total: float) -> None:
        self.total = total


class ReportedTimes:
    """Progress markers whose sections have taken ``per_step[s]`` seconds per step."""

    def __init__(self, per_step: dict[str, float]) -> None:
        self.per_step, self.steps, self.entered = per_step, 0, []

    def stats(self) -> dict[str, FakeStats]:
        return {s: FakeStats(t * self.steps) for s, t in self.per_step.items()}

    def enter(self, name: str) -> None:
        self.entered.append(name)


class GlooAttempt:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size, self.collective = rank, world, True


def exchange_job(rank: int, world: int) -> tuple[dict, list[str]]:
    """Every rank reports its own times through the watch's all-gather; rank 1 is hostile
    (NaN, infinite and negative times), rank 2 three times slower in forward."""
    hostile = {"data": float("nan"), "forward": float("inf"), "backward": -1.0}
    times = dict.fromkeys(SECTIONS, 0.01) | {"forward": 0.05 * (3 if rank == 2 else 1)}
    sections = ReportedTimes(times | (hostile if rank == 1 else {}))
    watch = StragglerWatch(StragglerConfig(window=2), attempt=GlooAttempt(rank, world),
                           sections=sections, names=SECTIONS)
    for step in (1, 2):
        sections.steps = step
        scores = watch.step_done(step)
    return scores.to_record(), sections.entered


SLOW_RANK, FACTOR = 2, 3.0
FORWARD_S = 0.04     # the others' forward per micro batch: a sleep, not the 2 cores' work
WINDOW, WINDOWS = 2, 2


def slow_rank_job(rank: int, world: int, tmp: str, steps: int) -> tuple[dict, list[str]]:
    """The trainer on gloo ranks (no torchrun), rank SLOW_RANK's forward FACTOR times
    slower; returns rank 0's summary and its ``train.straggler`` lines."""
    from trainer.elastic import ElasticTrainer

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("ckpt.trainer").addHandler(Keep())
    logging.getLogger("ckpt.trainer").setLevel(logging.INFO)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 4, generator=g),
                                          torch.randn(96, 1, generator=g))

    def step_fn(model: torch.nn.Module, batch) -> torch.Tensor:
        time.sleep(FORWARD_S * (FACTOR if rank == SLOW_RANK else 1.0))
        x, y = batch
        return F.mse_loss(model(x), y)

    root = Path(tmp)
    config = ElasticConfig(
        health=None, failure=FailureConfig(heartbeat_timeout=None),
        checkpoint=CheckpointConfig(memory_tier=False, probe=False),
        observability=ObservabilityConfig(run_dir=root / "run", audit_dir=root / "audit",
                                          metrics_textfile=root / "metrics.prom",
                                          log_every=None),
        stragglers=StragglerConfig(window=WINDOW, windows=WINDOWS))
    t = ElasticTrainer(lambda: torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.01),
                       data, step_fn, checkpoint_root=root / "ckpt", checkpoint_every=100,
                       global_batch_size=6, micro_batch_size=1, config=config)
    t0 = time.perf_counter()
    summary = t.fit(steps)
    lines.append(f"fit took {time.perf_counter() - t0:.2f}s")
    return summary.to_dict(), [m for m in lines if m.startswith(("train.straggler ", "fit "))]


def gloo_job(rank: int, world: int, tmp: str, steps: int) -> tuple[tuple, tuple]:
    """The exchange of hostile reports, then the trainer with a slow rank, on the same
    three ranks (one start of the ranks for both tests)."""
    return exchange_job(rank, world), slow_rank_job(rank, world, tmp, steps)


@pytest.fixture(scope="module")
def three_gloo_ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gloo")
    steps = 4 * WINDOW
    t0 = time.perf_counter()
    results = run_ranks(3, gloo_job, str(tmp), steps, timeout=120)
    return {"results": results, "tmp": tmp, "steps": steps,
            "took": time.perf_counter() - t0}


@pytest.mark.multiproc
def test_every_rank_scores_the_same_table_of_each_ranks_own_report(three_gloo_ranks):
    """Three gloo ranks exchange their times: every rank scores the same table, whose row r
    is rank r's own report; rank 1's NaN, infinite and negative times count as 0, so the
    hostile report neither breaks the scores nor gets an honest rank flagged."""
    results = [exchanged for exchanged, _ in three_gloo_ranks["results"]]
    records = [r for r, _ in results]
    assert records[0] == records[1] == records[2]
    rec, entered = records[0], results[0][1]
    assert rec["seconds"]["1"]["data"] == rec["seconds"]["1"]["forward"] == 0.0
    assert rec["seconds"]["0"]["forward"] == 0.05 and rec["seconds"]["2"]["forward"] == 0.15
    assert rec["overall"]["2"] > 2.0 and rec["overall"]["0"] == 1.0
    assert entered == ["collective"]  # the exchange is a collective of the step's sequence


@pytest.mark.multiproc
def test_a_rank_three_times_slower_is_scored_and_reported_while_training_goes_on(
        three_gloo_ranks):
    """Three gloo ranks, policy off: rank 2's forward sleeps 3x as long. Its overall score
    is over the threshold in the summary, the metrics and a train.straggler line per
    window; nobody is dropped and the job trains to its last step."""
    tmp_path, steps, took = (three_gloo_ranks[k] for k in ("tmp", "steps", "took"))
    summary, lines = three_gloo_ranks["results"][0][1]
    lines = list(lines)
    fit_s = lines.pop()
    assert summary["final_step"] == steps and summary["world_sizes"] == [3]
    text = ElasticSummary.from_dict(summary).format()
    assert f"stragglers (windows of {WINDOW} steps): rank {SLOW_RANK} (attempt 0)" in text
    st = summary["stragglers"]
    assert (st["window_steps"], st["windows"], st["dropped"]) == (WINDOW, 4, [])
    last = st["last"]["overall"]
    assert last[str(SLOW_RANK)] >= 2.0, st
    assert max(last["0"], last["1"]) < 1.5, st
    [flag] = st["flagged"]
    assert (flag["rank"], flag["attempt"]) == (SLOW_RANK, 0) and flag["windows"] >= 2, st
    assert st["worst"]["rank"] == SLOW_RANK and st["worst"]["section"] == "forward", st
    # one line per flagged window, with no action taken
    events = [parse_event(m)[1] for m in lines]
    seen = [(e["straggler"], e["action"], e["section"]) for e in events]
    assert seen == [(str(SLOW_RANK), "none", "forward")] * flag["windows"], seen
    # the textfile rank 0 exported at the end
    scraped = parse_metrics((tmp_path / "metrics.prom").read_text())
    score = {k: v for k, v in scraped.items() if k.startswith("ckpt_train_straggler_score{")}
    assert score[f'ckpt_train_straggler_score{{scored_rank="{SLOW_RANK}"}}'] >= 2.0, score
    assert scraped["ckpt_train_straggler_flags_total"] == flag["windows"]
    assert scraped["ckpt_train_stragglers_dropped_total"] == 0
    assert scraped["ckpt_train_straggler_score_max"] == pytest.approx(last[str(SLOW_RANK)],
                                                                      abs=1e-3)
    print(f"3 gloo ranks, {steps} steps ({fit_s}, {took:.1f}s with the ranks' start and "
          "the exchange of hostile reports); "
          f"scores of the last window {last}; flagged in {flag['windows']} of 4 windows")


# The drop comes after WINDOWS flagged windows in a row: at step 4, or later when a busy
# machine slows a fast rank in one window; then two steps or more at world size 2.
TORCHRUN_STEPS = WINDOW * (WINDOWS + 2) + 2
# Each sample's forward sleeps this long: the rank's own work is mostly time that does not
# depend on how busy the CPUs are, so the 3x shows in every window
TORCHRUN_SAMPLE_SLEEP = 0.05
TORCHRUN_TIMEOUT = 240.0  # only a guard against a hang: a loaded machine starts agents slowly


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_rank_three_times_slower_is_dropped_after_n_windows_and_the_job_goes_on(tmp_path):
    """torchrun, two nodes (an agent with two workers, one with one), policy on: the rank
    alone on its node computes 3x as long at world size 3. After WINDOWS flagged windows of
    WINDOW steps every rank checkpoints the step and leaves; the straggler stops its own
    agent, so its node leaves the job, and the other two finish at world size 2 from the
    step of the drop, with no sample skipped or repeated (audit log)."""
    args = elastic.job_args(tmp_path, sleep=TORCHRUN_SAMPLE_SLEEP,
                            hold=("--hold-until-world", "3"))
    args[args.index("--steps") + 1] = str(TORCHRUN_STEPS)
    args += [
        "--slow-lone-rank", "--slow-factor", str(FACTOR), "--slow-at-world", "3",
        "--straggler-window", str(WINDOW), "--straggler-windows", str(WINDOWS),
        "--straggler-drop"]
    # restart_grace: a worker that ignores its agent's SIGTERM is SIGKILLed after 2 s, not 30;
    # warm: each restart forks the workers from their node's zygote (trainer.warm) instead
    # of importing torch again, so the dropped worker's agent is its launcher's parent.
    # Two agents and two zygotes, not three: the start of the job costs a third less.
    cluster = job.LocalCluster(tmp_path, args, nnodes="1:2", restart_grace=2.0, warm=True)
    t0 = time.time()
    try:
        nodes = [cluster.add_node(nproc=2), cluster.add_node(nproc=1)]
        codes = cluster.wait(TORCHRUN_TIMEOUT)
    finally:
        cluster.close()
    took = time.time() - t0
    logs = {n.name: n.log() for n in nodes}
    dropped = [n.name for n in nodes if "train.dropped" in logs[n.name]]
    assert dropped == [nodes[1].name], (codes, cluster.logs()[-20000:])
    survivors = {name: code for name, code in codes.items() if name not in dropped}
    assert set(survivors.values()) == {0}, (codes, cluster.logs()[-20000:])
    assert codes[dropped[0]] is not None, codes  # its agent left
    [(slow_rank, agent)] = re.findall(r"train\.dropped rank=(\d+) .*agent=(\d+)",
                                      logs[dropped[0]])
    assert int(agent) == nodes[1].proc.pid, agent
    slow_rank = int(slow_rank)  # 0 or 2: torchrun numbers the nodes in the order they met

    s = elastic.summary_of(tmp_path)
    print("\n" + s.format())
    assert s.final_step == TORCHRUN_STEPS and s.world_sizes[-1] == 2, s.world_sizes
    [rec] = [r for r in s.recoveries if r.reason == "straggler"]
    assert (rec.lost_ranks, rec.world_before, rec.world_after) == ([slow_rank], 3, 2), rec
    [drop] = s.stragglers["dropped"]
    assert (drop["rank"], drop["attempt"], drop["windows"]) == (slow_rank, rec.attempt,
                                                                WINDOWS), s.stragglers
    assert drop["step"] == rec.last_step and drop["score"] >= 2.0, (drop, rec)
    # every rank checkpointed the step of the drop: nothing to train again
    assert rec.restored_step == rec.last_step and rec.steps_lost == 0, rec
    [flag] = [f for f in s.stragglers["flagged"] if f["attempt"] == rec.attempt]
    assert flag["rank"] == slow_rank and flag["windows"] >= WINDOWS, s.stragglers
    elastic.check_audit(tmp_path / "audit", steps=TORCHRUN_STEPS)
    print(f"rank {slow_rank} dropped at step {drop['step']} after {drop['windows']} windows "
          f"of {WINDOW} steps (score {drop['score']:.2f}); job finished at world 2; "
          f"{took:.1f}s in all")


def test_a_drop_signals_only_a_parent_that_is_a_torchrun_agent(monkeypatch):
    """The dropped worker stops its agent with SIGTERM; a parent that is not torchrun (this
    pytest, a shell, a scheduler's wrapper) is never signalled, nor any parent outside
    torchrun's environment."""
    from trainer.straggler_drop import torchrun_agent

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert torchrun_agent() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "forged")
    assert torchrun_agent() is None  # our parent runs pytest, not torchrun
    # a warm worker's agent is its launcher's parent: a launcher named in the environment
    # is checked alike (here: this process, whose parent is no torchrun agent either)
    from trainer.warm import LAUNCHER_ENV, ZYGOTE_ENV

    monkeypatch.setenv(ZYGOTE_ENV, str(os.getppid()))
    monkeypatch.setenv(LAUNCHER_ENV, str(os.getpid()))
    assert torchrun_agent() is None
