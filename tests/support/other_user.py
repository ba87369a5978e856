"""A second local user for the memory tier's security tests: ``ckptother``, created when the
tests run as root (``useradd -m``); the tests that need it skip otherwise.

Her processes run this checkout's Python through ``runuser``. The interpreter may live under
a directory she cannot enter (``/root`` is 0700): then the command runs in a private mount
namespace (``unshare -m``) in which that directory is replaced by an empty tmpfs that holds
only a bind mount of the interpreter's prefix; nothing changes outside that namespace.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

NAME = "ckptother"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def other_user() -> pwd.struct_passwd:
    """The second user (created if missing); skips the test unless it runs as root."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root")
    for tool in ("runuser", "unshare", "useradd"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing")
    try:
        return pwd.getpwnam(NAME)
    except KeyError:
        subprocess.run(["useradd", "-m", NAME], check=True, capture_output=True)
        return pwd.getpwnam(NAME)


def shared_dir(tmp: str | None = None) -> str:
    """A fresh directory both users can reach (0755 root's, under /tmp)."""
    path = tempfile.mkdtemp(prefix="ckpt-users-", dir=tmp or "/tmp")
    os.chmod(path, 0o755)
    return path


def _blocked_ancestor(path: str) -> str | None:
    """The first directory on the way to ``path`` that others cannot enter, or None."""
    parts = os.path.abspath(path).split("/")[1:]
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return d
    return None


def command(args: list[str], scratch: str) -> list[str]:
    """``args`` run as the second user (see the module docstring); ``scratch``: a directory
    the caller removes later (an empty mount point is made in it)."""
    user = other_user()
    run = ["runuser", "-u", user.pw_name, "--", "env", f"HOME={user.pw_dir}",
           f"PYTHONPATH={REPO}", *args]
    prefix = os.path.realpath(sys.base_prefix)
    blocked = _blocked_ancestor(prefix)
    if blocked is None:
        return run
    view = os.path.join(scratch, ".pyview")  # where the prefix waits while /root is covered
    os.makedirs(view, exist_ok=True)
    script = ('mount --bind "$1" "$2" && mount -t tmpfs -o mode=755 tmpfs "$3" && '
              'mkdir -p "$1" && mount --bind "$2" "$1" && shift 3 && exec "$@"')
    return ["unshare", "-m", "sh", "-c", script, "sh", prefix, view, blocked, *run]


def python(code: str, *args: str, scratch: str) -> list[str]:
    """``python -c code args...`` as the second user (this checkout's interpreter)."""
    return command([sys.executable, "-c", code, *args], scratch)


@contextmanager
def planted_sibling_roots(folder: str) -> Iterator[Path]:
    """A sticky, world-writable directory (as /tmp) in which the second user has made
    ``.<folder>.ckpt`` (a folder of hers) and ``.link.ckpt`` (a link to ``hers``, which does
    not exist): the hidden sibling roots ckpt's integrations would use for ``<folder>`` and
    ``link``. Yields the directory; removes it afterwards."""
    other_user()
    shared, scratch = Path(shared_dir()), shared_dir()
    os.chmod(shared, 0o1777)
    try:
        subprocess.run(command(["mkdir", str(shared / f".{folder}.ckpt")], scratch), check=True)
        subprocess.run(command(["ln", "-s", str(shared / "hers"), str(shared / ".link.ckpt")],
                               scratch), check=True)
        yield shared
    finally:
        shutil.rmtree(shared)
        shutil.rmtree(scratch)
