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
