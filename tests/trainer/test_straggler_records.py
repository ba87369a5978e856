"""The run summary reads the straggler windows of the run records as a hand-edited file may
leave them: a rank key that is no rank ('²', which ``str.isdigit`` accepts and ``int``
refuses; thousands of digits) or a streak that is no count is skipped, and the rest of the
window still counts."""

from __future__ import annotations

from trainer.progress import build_summary
from trainer.records import RunRecords
from trainer.stragglers import Scorer


def test_a_hand_edited_window_with_odd_rank_keys_is_read_without_them(tmp_path):
    scorer = Scorer(("data", "forward", "optimizer"))
    window = scorer.score([[0.01, 0.02, 0.01], [0.05, 0.02, 0.01]], 1, 10)
    records = RunRecords(tmp_path, None, attempt=0, rank=0, world_size=2)
    record = window.to_record()
    # the hand edits: ranks that are not ranks, in every table the summary reads
    for odd in ("²", "7" * 5000):
        record["overall"][odd] = 9.0
        record["seconds"][odd] = {"data": 1.0}
        record["section"][odd] = "data"
    records.record("stragglers", **record, flagged=[1, "²"], dropped="²",
                   streaks={"1": 1, "²": 1, "0": "many"}, window_steps=10, threshold=2.0)
    records.close()

    summary = build_summary(tmp_path, total_steps=10, final_step=10).stragglers

    assert summary is not None
    assert set(summary["last"]["overall"]) == {"0", "1"}
    assert summary["worst"]["rank"] == 1 and summary["worst"]["section"] == "data"
    assert [f["rank"] for f in summary["flagged"]] == [1]
    assert summary["dropped"] == []
