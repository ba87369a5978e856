"""The live job's supervisor (trainer/live/supervisor.py) when a group cannot run: a
failure that replacing does not cure ends the job instead of replacing the group forever,
and a group that cannot start leaves no lighthouse behind. Real processes (the lighthouse
loads torchft's native extension only; the groups are one-line Python commands)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.live_job import read
from trainer.live.config import LiveConfig
from trainer.live.supervisor import LiveJob

pytest.importorskip("torchft")


def _config(groups: int = 2) -> LiveConfig:
    return LiveConfig(lighthouse="127.0.0.1:0", replica_groups=groups, heartbeat_timeout=1.0)


def test_group_failing_the_same_way_ends_the_job(tmp_path: Path) -> None:
    """A group whose processes exit with the same error each time (a bug in the step, a
    bad input) is replaced max_restarts times, then the job gives up with status 1 and
    names the group and its status; the other group is stopped."""
    command = [sys.executable, "-c",
               "import os, sys, time\n"
               "sys.exit(3) if os.environ['CKPT_LIVE_GROUP'] == '1' else time.sleep(60)"]
    job = LiveJob(command, _config(), tmp_path, max_restarts=2)
    assert job.run(timeout=60) == 1
    events = read(tmp_path / "supervisor.jsonl")
    lost = [e for e in events if e["event"] == "group_lost"]
    assert [e["group"] for e in lost] == [1, 1, 1] and {e["rc"] for e in lost} == {3}
    gave_up = [e for e in events if e["event"] == "gave_up"]
    assert gave_up and gave_up[0]["group"] == 1 and gave_up[0]["rc"] == 3
    assert "repeats" in gave_up[0]["reason"]
    assert all(p.poll() is not None for procs in job.groups.values() for p in procs)


def test_group_that_cannot_start_leaves_no_lighthouse(tmp_path: Path) -> None:
    """A group command that cannot be started fails the job with that error, and the
    lighthouse started before it is stopped (not left listening on the job's port)."""
    job = LiveJob(["/nonexistent/ckpt-live-group"], _config(), tmp_path)
    with pytest.raises(FileNotFoundError):
        job.run(timeout=30)
    assert job.lighthouse is not None and job.lighthouse.poll() is not None


def test_port_held_by_another_process_is_not_taken_for_the_lighthouse(tmp_path: Path) -> None:
    """Someone already listens on the lighthouse's port: the supervisor does not take
    that socket for its lighthouse (the groups would talk to it); it stops with an error
    that names the port, and no group is started."""
    import socket

    from trainer.live.supervisor import LighthouseError

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(8)
    port = squatter.getsockname()[1]
    config = LiveConfig(lighthouse=f"127.0.0.1:{port}", replica_groups=1)
    job = LiveJob([sys.executable, "-c", "import time; time.sleep(30)"], config, tmp_path)
    try:
        with pytest.raises(LighthouseError, match=str(port)):
            job.run(timeout=60)
    finally:
        squatter.close()
    events = read(tmp_path / "supervisor.jsonl")
    assert [e["listening"] for e in events if e["event"] == "lighthouse"] == [False] * 3
    assert not [e for e in events if e["event"] == "group"]
