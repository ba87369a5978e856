"""The GPU checks, made to work the first time a GPU machine is lent (on the CPU, here).

A device machine comes rarely and for minutes, and its image lacks zstandard, moto and
s3fs: what tests/test_cuda.py, benchmarks/bench_cuda.py and benchmarks/device_check.sh
need is checked here, without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Python that behaves as if zstandard, moto and s3fs were not installed (a None entry in
# sys.modules makes their import raise ModuleNotFoundError; find_spec says "not found").
WITHOUT_OPTIONAL = "import sys; sys.modules.update(zstandard=None, moto=None, s3fs=None)\n"


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL + textwrap.dedent(code), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_ckpt_saves_and_loads_without_zstandard_and_names_it_when_asked_to_compress(tmp_path):
    result = run_python(f"""
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
    assert result.returncode == 0, result.stderr
    assert "refused: compression='zstd' needs the zstandard package" in result.stdout
    assert "pip install zstandard" in result.stdout
