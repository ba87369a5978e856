"""Straggler scores and the drop policy (trainer/stragglers.py).

The scores compare each rank's mean time per step in each section over a window with the
median of the ranks and with the rank's own best window; the overall score sums the
sections where a rank works on its own. The policy drops a rank flagged in N consecutive
windows. The last tests run the trainer: one rank made 3x slower than the others is scored
as such (gloo ranks, policy off), and dropped after N windows (torchrun, policy on).
"""

from __future__ import annotations

import pytest

from trainer.config import ElasticConfig, StragglerConfig
from trainer.stragglers import DropPolicy, Scorer, detect_windows, median_low

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
