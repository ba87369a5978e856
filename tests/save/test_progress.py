"""A progress line for the saves and restores a user waits for: on stderr when it is a
terminal (a real pseudo-terminal here), never when stderr is a pipe or CKPT_PROGRESS=0."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

from ckpt._shared.progress import ByteCounter, TerminalProgress

SCRIPT = """
import sys, torch, ckpt
state = {"w": torch.randn(2 << 20)}  # 8 MiB
with ckpt.CheckpointManager(sys.argv[1], async_save=False) as mgr:
    mgr.save(1, state, force=True)
    mgr.restore(state)
print("done", flush=True)
"""


def run(tmp_path: Path, *, terminal: bool, **env: str) -> str:
    """The script's stderr (read through a pseudo-terminal, or a pipe)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    environ = {**os.environ, "CKPT_PROGRESS_DELAY": "0", **env}
    args = [sys.executable, str(script), str(tmp_path / f"root-{terminal}-{len(env)}")]
    if not terminal:
        done = subprocess.run(args, capture_output=True, text=True, env=environ, timeout=120)
        assert "done" in done.stdout, done.stderr
        return done.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=environ)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=120)
    os.close(master)
    assert b"done" in out
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_shows_the_save_and_the_restore(tmp_path):
    err = run(tmp_path, terminal=True)
    # The save's line is drawn at once (delay 0); whether a redraw after the writer learned
    # the total comes before the save ends depends on the machine's speed, so the bar's
    # format is checked on a counter below, not here.
    assert "ckpt: saving step 1 " in err, err
    assert "ckpt: restoring from " in err, err
    assert "\x1b[2K" in err  # the line is erased when the wait ends


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_a_pipe_or_ckpt_progress_0_shows_none(monkeypatch):
    counter = ByteCounter(total=100)
    for tty, env in ((False, None), (True, "0")):
        if env is not None:
            monkeypatch.setenv("CKPT_PROGRESS", env)
        stream = Stream(tty)
        with TerminalProgress("ckpt: saving step 1", counter, stream=stream, delay=0):
            counter.add(50)
        assert stream.getvalue() == "", (tty, env)
    monkeypatch.delenv("CKPT_PROGRESS")
    stream = Stream(True)
    with TerminalProgress("ckpt: saving step 1", counter, stream=stream, delay=0):
        pass
    assert "ckpt: saving step 1 [" in stream.getvalue() and "100 B of 100 B" in stream.getvalue()
