"""ckpt.PerRank holds plain values (tensors, tuples of them, numbers, strings) per rank."""

from __future__ import annotations

import pytest
import torch

import ckpt
from tests.support import per_rank_workers as W
from tests.support.ranks import run_ranks


@pytest.mark.multiproc
@pytest.mark.parametrize("tables", [False, True], ids=["format1", "rank_tables"])
def test_each_rank_gets_its_own_plain_value_back_bit_exact(tmp_path, tables):
    results = run_ranks(2, W.save_and_restore_plain_values, str(tmp_path), tables)
    for rank, r in enumerate(results):
        assert r["step"] == 3, rank
        assert r["tuple"] and r["h"] and r["c"], (rank, r)
        assert r["dtypes"] == (torch.float32, torch.float64), (rank, r)
        assert r["lr"] == 10 * rank + 0.5 and r["text"] == f"rank {rank}", (rank, r)
        assert r["w"] == [1.0] * 4, rank


def test_a_plain_value_restored_on_one_rank_keeps_the_live_tensors_device(tmp_path):
    (h, c), _, _ = W.carried_state(0)
    with ckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(1, {"hidden": ckpt.PerRank([h, {"c": c}])}, force=True)
        live = ckpt.PerRank([torch.zeros(1, device="meta"), {"c": torch.zeros(2)}])
        mgr.restore({"hidden": live})
    got_h, got = live.value
    assert got_h.device.type == "meta"  # moved where the live tensor lived
    assert W.bits(got["c"]) == W.bits(c) and got["c"].dtype == torch.float64


class Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_a_stateful_object_in_per_rank_is_still_restored_through_load_state_dict(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(1, {"counter": ckpt.PerRank(Counter(41))}, force=True)
        live = Counter(0)
        mgr.restore({"counter": ckpt.PerRank(live)})
    assert live.n == 41
