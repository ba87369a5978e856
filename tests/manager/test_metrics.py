"""Checkpoint metrics: in memory, over HTTP (scraped like Prometheus does), in a textfile."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request

import pytest
import torch

import ckpt
from tests.support.prom import free_port, parse_metrics
from storage_backends import PosixStorage

pytest.importorskip("prometheus_client")




def test_metrics_scraped_over_http_match_the_saves(tmp_path):
    port = free_port()
    model = torch.nn.Linear(64, 64)
    state = {"model": model}
    with ckpt.CheckpointManager(tmp_path / "root", options=ckpt.SaveOptions(incremental=True),
                                metrics=ckpt.MetricsOptions(
                                    port=port, textfile=str(tmp_path / "ckpt.prom"))) as mgr:
        results = [mgr.save(s, state, force=True).wait() for s in (1, 2, 3)]
        with torch.no_grad():
            model.weight.add_(1)
        results.append(mgr.save(4, state, force=True).wait())
        scraped = parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                               timeout=10).read().decode())
    assert scraped["ckpt_saves_total"] == 4
    assert scraped["ckpt_save_failures_total"] == 0
    assert scraped["ckpt_bytes_written_total"] == sum(r.bytes_written for r in results)
    assert scraped["ckpt_bytes_reused_total"] == sum(r.bytes_reused for r in results) > 0
    assert scraped["ckpt_last_committed_step"] == 4
    assert scraped["ckpt_save_blocking_seconds_count"] == 4
    assert 0 <= scraped["ckpt_newest_commit_age_seconds"] < 60
    textfile = parse_metrics((tmp_path / "ckpt.prom").read_text())
    assert textfile["ckpt_saves_total"] == 4


class FailingStorage(PosixStorage):
    def write(self, path, buffers):
        raise OSError(5, "injected")


def test_failures_and_restores_are_counted_and_logged(tmp_path, caplog):
    model = torch.nn.Linear(4, 4)
    with ckpt.CheckpointManager(tmp_path / "ok") as mgr:
        mgr.save(1, {"model": model})
    with ckpt.CheckpointManager(tmp_path / "ok") as mgr:
        assert mgr.restore({"model": model}) == 1
        assert mgr.metrics.snapshot()["restores_total"] == 1
    caplog.set_level(logging.INFO, logger="ckpt")
    mgr = ckpt.CheckpointManager(FailingStorage(str(tmp_path / "bad")))
    handle = mgr.save(1, {"model": model})
    with pytest.raises(ckpt.StorageError):
        handle.wait()
    mgr.close()
    assert mgr.metrics.snapshot()["save_failures_total"] == 1
    assert any("ckpt.save_failed step=1" in r.getMessage() for r in caplog.records)


def test_saves_to_memory_alone_are_counted_apart_from_commits(tmp_path):
    """With a memory tier, a save that goes to memory alone is a save whose blocking time
    counts, but not a commit: the commit series (saves, newest committed step, its age) are
    the root's; a failed publish into memory is a failed save."""
    import os
    import shutil

    tier = ckpt.MemoryTierOptions(persist_every=3, job=f"metrics{os.getpid()}")
    textfile = tmp_path / "ckpt.prom"
    mgr = ckpt.CheckpointManager(tmp_path / "root", memory_tier=tier, async_save=True,
                                 metrics=ckpt.MetricsOptions(textfile=str(textfile)))
    segment = mgr._publisher.tier.path
    try:
        state = {"w": torch.zeros(64, 64)}
        for step in range(1, 6):  # the root gets step 3 (every third save), memory the rest
            mgr.save(step, state, force=False).wait()
        snap = mgr.metrics.snapshot()
        assert mgr.steps() == [3]
        assert snap["saves_total"] == 1 and snap["last_committed_step"] == 3
        assert snap["memory_saves_total"] == 4 and snap["last_memory_step"] == 5
        scraped = parse_metrics(textfile.read_text())
        assert scraped["ckpt_memory_saves_total"] == 4
        assert scraped["ckpt_save_blocking_seconds_count"] == 5
        assert scraped["ckpt_saves_total"] == 1

        def broken(*args, **kwargs):
            raise OSError(5, "injected")
        mgr._publisher.tier.publish_step = broken
        with pytest.raises(ckpt.CheckpointError):
            mgr.save(7, state).wait()
        assert mgr.metrics.snapshot()["save_failures_total"] == 1
        assert mgr.metrics.snapshot()["memory_saves_total"] == 4
    finally:
        mgr.close()
        shutil.rmtree(segment, ignore_errors=True)


def test_a_saves_metrics_are_recorded_when_its_wait_returns(tmp_path, monkeypatch):
    """The writer records a finished save's metrics after it wakes the save's waiters: wait()
    returns only once they are recorded, or a caller reads the count of the save before."""
    mgr = ckpt.CheckpointManager(tmp_path, async_save=True)
    saved = mgr.metrics.saved

    def slow_saved(**kwargs):
        time.sleep(0.5)
        saved(**kwargs)
    monkeypatch.setattr(mgr.metrics, "saved", slow_saved)
    try:
        mgr.save(1, {"w": torch.zeros(8)}).wait()
        assert mgr.metrics.snapshot()["saves_total"] == 1
        assert mgr.metrics.snapshot()["last_committed_step"] == 1
    finally:
        mgr.close()


def test_the_textfile_holds_the_newest_values_when_two_threads_record_at_once(tmp_path,
                                                                            monkeypatch):
    """Saves to memory alone record on the training thread while a commit records on the
    writer's: the file rendered first must not be renamed over the one rendered after."""
    import ckpt._manager.metrics as metrics_module

    textfile = tmp_path / "ckpt.prom"
    metrics = metrics_module.CheckpointMetrics(textfile=str(textfile))
    rendered_first, release_first = threading.Event(), threading.Event()
    write = metrics_module.atomic_write

    def held_first_write(*args, **kwargs):
        if not rendered_first.is_set():  # the first writer: rendered, now held
            rendered_first.set()
            release_first.wait(5)
        write(*args, **kwargs)
    monkeypatch.setattr(metrics_module, "atomic_write", held_first_write)

    first = threading.Thread(target=metrics.saved_to_memory,
                             kwargs={"step": 1, "blocking": 0.01})
    first.start()
    assert rendered_first.wait(5)
    second = threading.Thread(target=metrics.saved_to_memory,
                              kwargs={"step": 2, "blocking": 0.01})
    second.start()
    second.join(0.5)  # left time to render and write, if nothing stops it
    release_first.set()
    first.join(5)
    second.join(5)
    scraped = parse_metrics(textfile.read_text())
    assert scraped["ckpt_memory_saves_total"] == 2
    assert scraped["ckpt_save_blocking_seconds_count"] == 2
