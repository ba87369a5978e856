"""CheckpointManager's constructor: the option objects, the shorthands, the deprecated keywords
of earlier releases, and the restore tiers and verdicts it reports."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

import ckpt
from ckpt._manager.tiers import Tier
from ckpt._manager.verdict import Verdict


def _state(value: float = 1.0) -> dict:
    return {"x": torch.full((4,), value)}


def test_option_objects_are_importable_from_ckpt_and_frozen():
    for cls in (ckpt.SaveOptions, ckpt.Schedule, ckpt.RetentionPolicy, ckpt.KeepBest,
                ckpt.MemoryTierOptions, ckpt.MetricsOptions):
        assert cls.__name__ in ckpt.__all__
    with pytest.raises(AttributeError):
        ckpt.Schedule().every_steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("make, match", [
    (lambda: ckpt.Schedule(every_steps=0), "every_steps must be a positive integer"),
    (lambda: ckpt.Schedule(every_seconds=-1), "every_seconds must be a positive number"),
    (lambda: ckpt.Schedule(every_steps=True), "every_steps"),
    (lambda: ckpt.SaveOptions(full_every=0), "full_every"),
    (lambda: ckpt.SaveOptions(commit_timeout=0), "commit_timeout"),
    (lambda: ckpt.MemoryTierOptions(persist_every=0), "persist_every"),
    (lambda: ckpt.MemoryTierOptions(keep=0), "keep must be a positive integer"),
    (lambda: ckpt.MemoryTierOptions(replicas=-1), "replicas must be a non-negative"),
    (lambda: ckpt.MetricsOptions(port=0), "port"),
    (lambda: ckpt.RetentionPolicy(keep_every=0), "keep_every"),
    (lambda: ckpt.KeepBest(1, "loss", "lowest"), "best_mode"),
])
def test_option_objects_refuse_invalid_values_with_the_field_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_an_unknown_keyword_raises_type_error_as_python_would(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lats'"):
        ckpt.CheckpointManager(tmp_path, keep_lats=3)
    assert not any(tmp_path.iterdir())  # refused before the root was touched


@pytest.mark.parametrize("bad", [{"metrics": "yes"}, {"memory_tier": 1},
                                 {"options": {"allow_pickle": True}}, {"retention": 3}])
def test_an_option_of_the_wrong_type_raises_type_error(tmp_path, bad):
    with pytest.raises(TypeError):
        ckpt.CheckpointManager(tmp_path, **bad)


def test_a_shorthand_and_its_option_object_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="every_steps= is given twice"):
        ckpt.CheckpointManager(tmp_path, every_steps=2, schedule=ckpt.Schedule(every_steps=3))
    with pytest.raises(ValueError, match="keep_last= is given twice"):
        ckpt.CheckpointManager(tmp_path, keep_last=2,
                               retention=ckpt.RetentionPolicy(keep_last=3))
    with pytest.raises(ValueError, match="keep_last must be a positive integer"):
        ckpt.CheckpointManager(tmp_path, retention=ckpt.RetentionPolicy(keep_last=0))


@pytest.mark.parametrize("old, new, spelled", [
    ({"keep_every": 2}, {"retention": ckpt.RetentionPolicy(keep_every=2)},
     "retention=ckpt.RetentionPolicy(keep_every=...)"),
    ({"every_seconds": 3600}, {"schedule": ckpt.Schedule(every_seconds=3600)},
     "schedule=ckpt.Schedule(every_seconds=...)"),
    ({"compression": "zstd"}, {"options": ckpt.SaveOptions(compression="zstd")},
     "options=ckpt.SaveOptions(compression=...)"),
    ({"incremental": True, "full_every": 3},
     {"options": ckpt.SaveOptions(incremental=True, full_every=3)},
     "options=ckpt.SaveOptions(incremental=...)"),
])
def test_a_deprecated_keyword_warns_with_the_new_spelling_and_saves_the_same(tmp_path, old, new,
                                                                           spelled):
    kept = {}
    for name, kwargs in (("old", old), ("new", new)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ckpt.CheckpointManager(tmp_path / name, keep_last=2, async_save=False,
                                        **kwargs) as mgr:
                for step in range(1, 7):
                    mgr.save(step, _state(step))
                kept[name] = (mgr.steps(), mgr.options, mgr.retention)
        messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
        if name == "old":
            assert any(spelled in m for m in messages), messages
            assert all(w.filename == __file__ for w in caught
                       if w.category is DeprecationWarning)  # points at the caller
        else:
            assert messages == []
    assert kept["old"] == kept["new"]


def test_deprecated_keep_best_keywords_make_one_keep_best(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"keep_best=ckpt.KeepBest\(n, metric, mode\)"):
        mgr = ckpt.CheckpointManager(tmp_path, keep_best=2, best_metric="acc", best_mode="max")
    with mgr:
        assert mgr.retention.keep_best == ckpt.KeepBest(2, "acc", "max")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="keep_best"):
        ckpt.CheckpointManager(tmp_path / "bad", best_metric="acc")


def test_deprecated_memory_and_metrics_keywords_fill_their_option_objects(tmp_path):
    with pytest.warns(DeprecationWarning, match="memory_tier=ckpt.MemoryTierOptions"):
        with pytest.raises(ValueError, match="replicas"):
            ckpt.CheckpointManager(tmp_path, memory_tier=True, replicas=-1)
    with pytest.warns(DeprecationWarning, match="metrics=ckpt.MetricsOptions"):
        with pytest.raises(ValueError, match="port"):
            ckpt.CheckpointManager(tmp_path, metrics=False, metrics_port=-5)
    with pytest.raises(ValueError, match="cannot be combined with incremental"):
        ckpt.CheckpointManager(tmp_path, memory_tier=ckpt.MemoryTierOptions(),
                               options=ckpt.SaveOptions(incremental=True))


def test_metrics_false_keeps_none_and_an_options_object_keeps_them(tmp_path):
    with ckpt.CheckpointManager(tmp_path / "a", metrics=False) as mgr:
        assert mgr.metrics is None
    with ckpt.CheckpointManager(tmp_path / "b", metrics=ckpt.MetricsOptions()) as mgr:
        assert mgr.metrics.snapshot()["saves_total"] == 0


def test_the_every_seconds_schedule_is_decided_by_the_clock_it_is_given(tmp_path):
    now = [0.0]
    with ckpt.CheckpointManager(tmp_path, async_save=False,
                                schedule=ckpt.Schedule(every_seconds=10)) as mgr:
        mgr._schedule.clock = lambda: now[0]
        mgr._schedule.last_save_time = 0.0
        for step in range(1, 8):
            now[0] = 4.0 * step
            mgr.save(step, _state(step))
        assert mgr.steps() == [3, 6]  # at 12 s, then at 24 s (12 s after step 3)


def test_users_read_but_do_not_set_the_managers_state(tmp_path):
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        for name in ("root", "storage", "group", "metrics", "skipped", "last_restore",
                     "loaded_step", "options", "retention", "read_only"):
            getattr(mgr, name)
            with pytest.raises(AttributeError):
                setattr(mgr, name, None)


def test_last_restore_reports_the_tier_as_a_string_compatible_enum(tmp_path):
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state())
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.restore(_state(0.0)) == 1
        info = mgr.last_restore
    assert info.tier == "storage" and info.tier is Tier.STORAGE
    assert f"{info.tier}" == "storage" and info.ranks == (("storage", info.bytes_from_storage),)
    assert info.bytes_from_storage > 0
    assert pickle.loads(pickle.dumps(info)) == info


def test_verdicts_say_whether_another_step_can_help():
    assert Verdict.of(None) is None
    bad = Verdict.of(ckpt.CorruptCheckpointError("digest mismatch"))
    assert bad == Verdict(False, "digest mismatch")
    fatal = Verdict.of(RuntimeError("out of memory"))
    assert fatal.fatal and fatal.why == "RuntimeError: out of memory"
    assert pickle.loads(pickle.dumps(fatal)) == fatal  # the ranks exchange them


def test_a_skipped_step_is_recorded_with_its_verdict(tmp_path):
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _state(1.0))
        mgr.save(2, _state(2.0))
    data = sorted((tmp_path / "step-00000002").glob("*.dat")) or sorted(
        p for p in (tmp_path / "step-00000002").iterdir() if p.name != "manifest.json")
    data[0].write_bytes(b"\0" * data[0].stat().st_size)
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        state = _state(0.0)
        assert mgr.restore(state) == 1
        assert [s for s, _ in mgr.skipped] == [2]
        assert torch.equal(state["x"], torch.full((4,), 1.0))


def test_the_framework_integrations_allow_pickle_in_either_spelling():
    from trainer.integrations._steps import pickle_allowed

    assert pickle_allowed({"options": ckpt.SaveOptions(allow_pickle=True)})
    assert pickle_allowed({"allow_pickle": True})
    assert not pickle_allowed({"options": ckpt.SaveOptions()})
    assert not pickle_allowed({})
