"""benchmarks/report.py: re-running some benchmarks keeps the other sections of
docs/benchmarks.md, and every section names the commit (and the kind of run) it came from."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

report = pytest.importorskip("report")

DOC = """# Benchmarks

Preamble.

## Asynchronous save: blocking time, memory, step slowdown (commit aaa1111, quick run)

## a heading the script printed (commit aaa1111)

### Blocking time: 256 MiB (commit aaa1111)

| method | ms |
|---|---|
| ckpt | 19 |

## Asynchronous save against the peers: torch_checkpointing, DCP, torch.save (commit bbb2222)

peers table
"""


def test_the_sections_of_a_document_are_kept_whole_by_their_titles():
    kept = report.kept_sections(DOC)
    assert list(kept) == ["async", "peers"]
    # a "##" heading inside a script's output does not end the section it belongs to
    assert "## a heading the script printed" in kept["async"]
    assert "| ckpt | 19 |" in kept["async"]
    assert kept["async"].startswith("## Asynchronous save: blocking time")
    assert kept["peers"].strip().endswith("peers table")


def test_a_result_names_its_commit_and_says_when_it_was_a_quick_run():
    body = "### Save: 256 MiB\n\n| a |\n|---|\n| 1 |\n"
    quick = report.section("peers", report.COMMIT_TAG.format("ccc3333") + "\n"
                           + report.QUICK_TAG + "\n" + body)
    full = report.section("peers", report.COMMIT_TAG.format("ddd4444") + "\n" + body)
    title = report.TITLES["peers"]
    assert quick.startswith(f"## {title} (commit ccc3333, quick run)\n")
    assert "### Save: 256 MiB (commit ccc3333)" in quick
    assert report.QUICK_TAG not in quick
    assert full.startswith(f"## {title} (commit ddd4444)\n")
    # a section read back from the document it was written into is found whole
    assert report.kept_sections("# B\n\n" + quick) == {"peers": quick}


def test_an_unknown_benchmark_name_is_refused_with_the_names_there_are(tmp_path):
    # a copy of the scripts, so that nothing could write the repository's document
    (tmp_path / "benchmarks").mkdir()
    for name in ("report.py", "common.py"):
        shutil.copy(os.path.join(REPO, "benchmarks", name), tmp_path / "benchmarks" / name)
    out = subprocess.run([sys.executable, str(tmp_path / "benchmarks" / "report.py"),
                          "--only", "bench_peers"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode != 0
    assert "no benchmark named bench_peers" in out.stderr
    assert "peers" in out.stderr.split("among", 1)[1]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "docs").exists()
