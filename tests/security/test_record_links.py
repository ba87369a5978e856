"""The trainer's run directory (JSON lines appended by every rank, the summary rank 0
writes) is never written through a planted entry: a run directory other users can write to
could hold a symbolic link at a record's or the summary's name, pointing at a file of the
job's user, or a FIFO, whose open would block the rank for ever."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from trainer.progress import JsonLines, append_jsonl, build_summary, write_summary


def plant(tmp_path, name: str):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "run" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link, victim


def test_a_link_planted_at_a_ranks_record_is_refused_and_its_target_untouched(tmp_path):
    link, victim = plant(tmp_path, "rank-00000.jsonl")
    with pytest.raises(OSError, match="is a symbolic link: records are appended only to a "
                                      "regular file"):
        JsonLines(link)
    assert victim.read_text() == "precious\n"


def test_a_link_planted_at_a_rare_event_file_is_refused(tmp_path):
    link, victim = plant(tmp_path, "skips.jsonl")
    with pytest.raises(OSError, match="symbolic link"):
        append_jsonl(link, {"step": 3})
    assert victim.read_text() == "precious\n"


def test_records_are_appended_to_a_plain_file(tmp_path):
    path = tmp_path / "run" / "rank-00000.jsonl"
    records = JsonLines(path)
    records.write({"step": 1})
    records.close()
    append_jsonl(path, {"step": 2})
    assert path.read_text() == '{"step":1}\n{"step":2}\n'


def test_a_fifo_planted_at_a_record_is_refused_not_waited_on(tmp_path):
    """A FIFO at a rank's record name is refused with an error naming it (no reader: the
    open would otherwise block until one came)."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "rank-00000.jsonl")
    outcome: list[object] = []

    def open_records() -> None:
        try:
            outcome.append(JsonLines(run / "rank-00000.jsonl"))
        except OSError as e:
            outcome.append(e)

    t = threading.Thread(target=open_records, daemon=True)
    t.start()
    t.join(30)  # a liveness bound, not a timing assert: a blocked open never returns
    assert outcome, "the open of a FIFO never returned"
    assert isinstance(outcome[0], OSError)
    assert "rank-00000.jsonl is a FIFO: records are appended only to a regular file" \
        in str(outcome[0])


def test_the_summary_is_never_written_through_a_link_in_the_run_directory(tmp_path):
    """Links planted at the summary's name and at a temporary name a writer might use are
    left alone (their targets untouched); the summary is a new regular file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("summary.json.tmp", "summary.json"):
        (run / name).symlink_to(victim)
    write_summary(run, build_summary(run, total_steps=1, final_step=1))
    assert victim.read_text() == "precious\n"
    summary = run / "summary.json"
    assert not summary.is_symlink() and '"final_step": 1' in summary.read_text()
    assert sorted(p.name for p in run.iterdir()) == ["summary.json", "summary.json.tmp"]


def test_the_live_supervisor_writes_records_without_importing_torch():
    """The supervisor of a live job (which writes supervisor.jsonl through these records)
    starts without importing torch; the safe-file helpers keep it so."""
    code = ("import sys, trainer.live.supervisor; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

