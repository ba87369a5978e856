"""The scripts a device machine runs, checked on the CPU: benchmarks/bench_cuda.py,
tests/gpu/test_cuda.py without a GPU, and benchmarks/device_check.sh. A device machine comes rarely
and for minutes, and its image lacks zstandard, moto and s3fs.

Every check runs those scripts in processes of their own, each importing torch: the runs of the
selected tests start the first time one of them asks (``runs``), two at a time, and each test
asserts on the output of its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


REPO = Path(__file__).resolve().parents[2]


WITHOUT_OPTIONAL = "import sys; sys.modules.update(zstandard=None, moto=None, s3fs=None)\n"


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL + textwrap.dedent(code), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def without_zstandard(tmp_path: Path) -> subprocess.CompletedProcess:
    return run_python(f"""
        import torch, ckpt
        state = {{"t": torch.arange(10.0)}}
        ckpt.save(state, {str(tmp_path / 'plain')!r})
        back = {{"t": torch.zeros(10)}}
        ckpt.load(back, {str(tmp_path / 'plain')!r})
        assert torch.equal(back["t"], state["t"])
        try:
            ckpt.save(state, {str(tmp_path / 'zstd')!r},
                      options=ckpt.SaveOptions(compression="zstd"))
        except ckpt.CheckpointError as e:
            print("refused:", e)
        """)


def run_bench_cuda(*args: str) -> subprocess.CompletedProcess:
    return run_python(f"""
        import runpy
        sys.argv = ["bench_cuda.py", *{list(args)!r}]
        runpy.run_path("benchmarks/bench_cuda.py", run_name="__main__")
        """, timeout=300)


def bench_cuda_dry_run(tmp_path: Path) -> subprocess.CompletedProcess:
    return run_bench_cuda("--device", "cpu", "--sizes", "4M", "--reps", "1",
                          "--quiet-wait", "0", "--dir", str(tmp_path))


def bench_cuda_without_a_gpu(tmp_path: Path) -> subprocess.CompletedProcess:
    return run_bench_cuda("--sizes", "4M")


def cuda_tests_on_the_cpu(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu/test_cuda.py"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "CKPT_TEST_DEVICE": "cpu"})


def run_device_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/device_check.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out),
                               "PYTHON": sys.executable, **env})


def device_check_with_failures(tmp_path: Path) -> subprocess.CompletedProcess:
    """One run with a test step that times out and a benchmark that refuses its sizes."""
    return run_device_check(tmp_path, CKPT_COMMIT="abc1234", TEST_TIMEOUT="1",
                            BENCH_SIZES="bogus")


# The run each test needs, the longest first.
NEEDS = {
    "test_device_check_runs_every_step_keeps_their_logs_and_exits_with_the_first_failure":
        device_check_with_failures,
    "test_test_cuda_runs_on_the_cpu_where_it_is_not_about_cuda_itself": cuda_tests_on_the_cpu,
    "test_bench_cuda_dry_run_on_the_cpu_prints_every_row": bench_cuda_dry_run,
    "test_ckpt_saves_and_loads_without_zstandard_and_names_it_when_asked_to_compress":
        without_zstandard,
    "test_bench_cuda_without_a_gpu_says_so_and_exits_0": bench_cuda_without_a_gpu,
}


class Runs:
    """``runs[test name]``: (the CompletedProcess of its run, the run's own directory)."""

    def __init__(self, futures: dict[str, tuple[cf.Future, Path]]) -> None:
        self.futures = futures

    def __getitem__(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        future, tmp = self.futures[name]
        return future.result(), tmp


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    selected = {item.originalname for item in request.session.items
                if item.module is request.module}
    if torch.cuda.is_available():  # that test is skipped
        selected.discard("test_bench_cuda_without_a_gpu_says_so_and_exits_0")
    wanted = [name for name in NEEDS if name in selected]
    # Two at a time (one per core of the CI machine: a torch import is one core's work),
    # the longest first: device_check.sh's steps are five processes one after the other.
    with cf.ThreadPoolExecutor(2) as pool:
        futures = {}
        for name in wanted:
            tmp = tmp_path_factory.mktemp(name[5:30])
            futures[name] = (pool.submit(NEEDS[name], tmp), tmp)
        yield Runs(futures)


def test_ckpt_saves_and_loads_without_zstandard_and_names_it_when_asked_to_compress(runs):
    """Without zstandard ckpt saves and loads, and a save asked to compress is refused naming the
    package to install."""
    result, _ = runs["test_ckpt_saves_and_loads_without_zstandard_and_names_it_when_asked_to_"
                     "compress"]
    assert result.returncode == 0, result.stderr
    assert "refused: compression='zstd' needs the zstandard package" in result.stdout
    assert "pip install zstandard" in result.stdout


def test_bench_cuda_dry_run_on_the_cpu_prints_every_row(runs):
    """benchmarks/bench_cuda.py on the CPU (a dry run) prints every row of its table and removes its
    data."""
    result, tmp_path = runs["test_bench_cuda_dry_run_on_the_cpu_prints_every_row"]
    assert result.returncode == 0, result.stderr
    for row in ("training step, no save", "device-to-host copy floor (pinned)",
                "ckpt save() blocks (overlapped)", "ckpt next step (overlap off)",
                "ckpt step during the write (overlapped)", "DCP async_save blocks (default)",
                "DCP async_save blocks (DefaultStager, pinned)", "ckpt restore (warm)",
                "dcp.load (warm)"):
        assert f"| {row} " in result.stdout, (row, result.stdout)
    assert "Restore " in result.stdout and "failed after" not in result.stdout
    assert "WARNING" not in result.stdout  # the copy floor moved what ckpt saved
    assert "a dry run" in result.stdout
    assert not (tmp_path / "cuda").exists()  # its data removed


def test_bench_cuda_without_a_gpu_says_so_and_exits_0(runs):
    """benchmarks/bench_cuda.py without a GPU says it measured nothing and exits 0."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    result, _ = runs["test_bench_cuda_without_a_gpu_says_so_and_exits_0"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("No CUDA device: bench_cuda.py measured nothing")


def test_test_cuda_runs_on_the_cpu_where_it_is_not_about_cuda_itself(runs):
    """tests/gpu/test_cuda.py with CKPT_TEST_DEVICE=cpu: the tests of saves and restores run."""
    result, _ = runs["test_test_cuda_runs_on_the_cpu_where_it_is_not_about_cuda_itself"]
    assert result.returncode == 0, result.stdout[-3000:]
    assert "6 passed" in result.stdout, result.stdout[-3000:]


def test_device_check_runs_every_step_keeps_their_logs_and_exits_with_the_first_failure(runs):
    """One run with a test step that times out and a benchmark that refuses its sizes: every
    step still runs, each keeps its log under $OUT, the status is the first failure's."""
    result, tmp_path = runs["test_device_check_runs_every_step_keeps_their_logs_and_exits_with_"
                            "the_first_failure"]
    log = (tmp_path / "device_check.log").read_text()
    assert "commit abc1234" in log
    for line in ("import: exit 0", "test_cuda: TIMED OUT after 1s", "bench_cuda: exit 1"):
        assert line in log, log
    assert "invalid literal" in (tmp_path / "bench_cuda.log").read_text()
    assert {"versions.log", "import.log", "test_cuda.log", "bench_cuda.log"} <= {
        p.name for p in tmp_path.iterdir()}
    if torch.cuda.is_available():
        assert result.returncode == 124, log
    else:  # the versions step failed first
        assert "NO CUDA DEVICE" in log and "versions: exit 3" in log, log
        assert result.returncode == 3, log
