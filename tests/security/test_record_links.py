"""The trainer's run and audit records (JSON lines appended by every rank) are never written
through a symbolic link: a run directory other users can write to could hold one planted at
a record's name, pointing at a file of the job's user."""

from __future__ import annotations

import pytest

from trainer.progress import JsonLines, append_jsonl


def plant(tmp_path, name: str):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "run" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    return link, victim


def test_a_link_planted_at_a_ranks_record_is_refused_and_its_target_untouched(tmp_path):
    link, victim = plant(tmp_path, "rank-00000.jsonl")
    with pytest.raises(OSError, match="is a symbolic link: records are never appended"):
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
