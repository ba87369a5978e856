"""A moto S3 server in a process of its own, so a test can freeze it (SIGSTOP) and thaw it
(SIGCONT) as a store that stops answering: connections are still accepted by the kernel, and
requests are sent into its buffers, but no answer ever comes back.

``frozen_moto`` (module-scoped) starts one; ``bucket`` gives each test a fresh bucket on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pytest

from tests.support.s3_fixture import AWS_ENV, LoopbackS3, _free_port


@dataclass
class MotoProcess(LoopbackS3):
    """A moto server process on a loopback port; ``bucket`` is the current test's bucket."""

    process: subprocess.Popen
    port: int
    bucket: str = ""

    def freeze(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def uploads(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` with a multipart upload in progress."""
        answer = self.client().list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return [u["Key"] for u in answer.get("Uploads", [])]


@pytest.fixture(scope="module")
def frozen_moto():
    """A moto server process for the module, with fake credentials in the environment."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        port = _free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = MotoProcess(process, port)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    server.client().list_buckets()
                    break
                except Exception:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            yield server
        finally:
            process.send_signal(signal.SIGCONT)  # a stopped process would not die on SIGTERM
            process.kill()
            process.wait()


@pytest.fixture
def moto_bucket(frozen_moto) -> MotoProcess:
    """A fresh bucket on the module's moto process (thawed again after the test)."""
    frozen_moto.bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    frozen_moto.client().create_bucket(Bucket=frozen_moto.bucket)
    yield frozen_moto
    frozen_moto.thaw()
