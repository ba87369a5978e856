"""Where this user's memory segments live, the checks every one of them passes before it is
used, and the removal of segments whose owner died.

``/dev/shm`` is writable by every local user. The memory tier therefore keeps its segments in
a directory of its own per user, ``<shm>/ckpt-uid<euid>/`` (mode 0700): created exclusively
with ``mkdir(0o700)`` and then checked with ``lstat`` (a real directory, not a link, owned by
this user, no group or other permission bits); one that already exists must pass the same
checks. Nobody else can list, read, create, rename or lock anything inside it (root aside).
Inside it, segment directories are 0700 and their files 0600; every segment is checked again
(a real directory of this user, no access for others) and every file the tier reads is
opened without following a link and checked for its owner and mode (no write bit for others).
Only exact segment names are used (:data:`SEGMENT_NAME`), never a prefix that another name
could extend.

What fails a check is skipped with a warning that names it: never read, never deleted. A
private directory that fails them (another user made it first, or put a link there) turns the
memory tier off for the manager that found it (see ``ckpt/_manager/publisher.py``).

A process forked from an owner (a DataLoader worker, a multiprocessing child) lets go at once
of every file descriptor it inherited that points into the private directory
(:func:`_drop_inherited`): it would otherwise hold the segment's owner lock (a flock belongs
to the open file, which the child shares) after its parent was killed, so that the restarted
worker could not own its segment, and keep the pages of deleted slabs allocated in ``/dev/shm``
(the slabs' mappings themselves are not inherited: ``ckpt/_memory/slabs.py``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import time
from typing import Any

from ckpt.errors import CheckpointError

log = logging.getLogger("ckpt")

SHM_DIR = "/dev/shm"
OWNER_FILE = "owner.lock"
DEAD_FILE = "dead-since"  # its mtime: when a collection first found the owner dead
STAGING = ".tmp-"
#: ``ckpt-<job>-<node>-r<rank>`` or ``ckpt-<job>-<node>-replica-r<origin>`` (job and node
#: names hold no ``-``: see ``ckpt/_memory/tier.py``).
SEGMENT_NAME = re.compile(r"ckpt-([A-Za-z0-9_.]+)-([A-Za-z0-9_.]+)-(?:replica-)?"
                          r"r(?:0|[1-9][0-9]*)\Z")
_SAFE = re.compile(r"[^A-Za-z0-9_.]+")
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeSegmentError(CheckpointError, PermissionError):
    """A directory or file of the memory tier that is not this user's alone (another user
    made it, it is a link, or others may write it): never read, never deleted."""


def private_path(shm_dir: str) -> str:
    """This user's directory of segments under ``shm_dir`` (not created, not checked)."""
    return os.path.join(shm_dir, f"ckpt-uid{os.geteuid()}")


def problem(st: os.stat_result, *, private: bool) -> str | None:
    """Why an entry of the memory tier must not be used, or None. Directories must be real
    directories, files regular files, both owned by this user; ``private``: no permission
    bit at all for others (the private directory, segments), else no write bit for them."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "is neither a directory nor a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & (0o077 if private else 0o022):
        return f"has mode {stat.filemode(st.st_mode)}, open to other users"
    return None


_DROPPED_IN_CHILDREN: set[str] = set()  # private directories (with a final "/")


def _drop_in_children(private: str) -> None:
    """Have every process forked from this one let go of its inherited descriptors into
    ``private`` (registered once per process)."""
    if not _DROPPED_IN_CHILDREN and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_drop_inherited)
    _DROPPED_IN_CHILDREN.add(os.path.join(private, ""))


def _drop_inherited() -> None:
    """In a forked child: each descriptor that points into a private directory now points to
    /dev/null instead (``dup2``: the child's objects that hold the number stay valid)."""
    prefixes = tuple(_DROPPED_IN_CHILDREN)
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    null = -1
    try:
        for name in fds:
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if target.startswith(prefixes):
                if null < 0:
                    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                os.dup2(null, int(name), inheritable=False)
    finally:
        if null >= 0:
            os.close(null)


def private_dir(shm_dir: str, *, create: bool = True) -> str:
    """This user's directory of segments, created (0700) when missing and ``create``.

    Raises:
        FileNotFoundError: it does not exist and ``create`` is False.
        UnsafeSegmentError: it is not this user's private directory, or ``shm_dir`` lets
            others rename it (:func:`_guarded`).
    """
    path = private_path(shm_dir)
    if os.path.isdir(shm_dir) and not _guarded(shm_dir):
        raise UnsafeSegmentError(
            f"{shm_dir} lets other users rename what is in it (it is writable by others and "
            "not sticky, or another user owns it): the memory tier keeps this user's "
            "segments there only in a directory like /dev/shm (mode 1777, root's) or one "
            "only you can write; pass MemoryTierOptions(shm_dir=) such a directory",
            path=shm_dir)
    created = False
    if create:
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass
    st = os.lstat(path)
    why = problem(st, private=True) or (None if stat.S_ISDIR(st.st_mode) else
                                        "is not a directory")
    if why:
        raise UnsafeSegmentError(
            f"{path} {why}: the memory tier keeps this user's segments there and uses it only "
            "when it is a directory that this user alone owns and can open; remove it (as its "
            "owner, or root), or pass MemoryTierOptions(shm_dir=) a directory only you can "
            "write", path=path)
    if created and stat.S_IMODE(st.st_mode) != 0o700:  # a umask took bits off: put them back
        os.chmod(path, 0o700, follow_symlinks=False)
    _drop_in_children(os.path.realpath(path))  # /proc names a descriptor's file by real path
    return path


def check_dir(path: str, *, private: bool = False) -> None:
    """Raise UnsafeSegmentError unless ``path`` is a directory this user owns (see
    :func:`problem`); FileNotFoundError when it is missing."""
    st = os.lstat(path)
    why = problem(st, private=private) or (None if stat.S_ISDIR(st.st_mode) else
                                           "is not a directory")
    if why:
        raise UnsafeSegmentError(f"{path} {why}: not used", path=path)


def open_checked(path: str) -> int:
    """A read descriptor of the regular file ``path``, opened without following a link (or
    blocking on a FIFO); UnsafeSegmentError unless this user owns it and others cannot write
    it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        why = problem(st, private=False) or (None if stat.S_ISREG(st.st_mode) else
                                             "is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    if why:
        os.close(fd)
        raise UnsafeSegmentError(f"{path} {why}: not read", path=path)
    return fd


def read_checked(path: str) -> bytes:
    """The whole file ``path``, opened by :func:`open_checked`."""
    fd = open_checked(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def segment_names(private: str, prefix: str | None = None) -> list[str]:
    """The exact segment names in ``private`` (those starting with ``prefix``), sorted."""
    try:
        names = os.listdir(private)
    except OSError as e:
        log.warning("ckpt._memory cannot list %s: %s", private, e)
        return []
    return sorted(n for n in names if SEGMENT_NAME.match(n)
                  and (prefix is None or n.startswith(prefix)))


def own_segment(path: str, wait: float = 1.0) -> Any:
    """Create (0700, if missing) and flock the segment at ``path`` (inside this user's private
    directory); returns the held owner file. Removes what a crashed publish left, and the
    mark of a collection that found the segment's owner dead.

    Raises:
        UnsafeSegmentError: ``path`` is not this user's private directory.
        CheckpointError: another live process owns the segment.
    """
    _drop_in_children(os.path.realpath(os.path.dirname(path)))
    deadline = time.monotonic() + wait
    while True:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        check_dir(path, private=True)
        dfd = os.open(path, _OPEN_DIR)
        try:
            owner = open(os.path.join(path, OWNER_FILE), "a+", opener=lambda name, flags: os.open(
                OWNER_FILE, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd))
            why = problem(os.fstat(owner.fileno()), private=True)
            if why:
                owner.close()
                raise UnsafeSegmentError(f"{owner.name} {why}: not used", path=owner.name)
            try:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner.close()
                if time.monotonic() < deadline:  # a collection may hold it for a moment
                    time.sleep(0.05)
                    continue
                raise CheckpointError(
                    f"the memory segment {path} is in use by another live process; give "
                    "this run another job id (MemoryTierOptions(job=...))", path=path) from None
            if os.fstat(owner.fileno()).st_nlink == 0:  # a collection removed it meanwhile
                owner.close()
                continue
            try:
                os.unlink(DEAD_FILE, dir_fd=dfd)
            except FileNotFoundError:
                pass
            for name in os.listdir(dfd):  # a publish cut short by a crash
                if name.startswith(STAGING):
                    _remove(dfd, name)
            return owner
        finally:
            os.close(dfd)


def _remove(dfd: int, name: str) -> None:
    """Remove the file or directory ``name`` in ``dfd`` (never through a link), if it is
    still there."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


def gc_segments(shm_dir: str = SHM_DIR, *, keep_job: str | None = None,
                job: str | None = None, min_age: float = 0.0,
                dry_run: bool = False) -> list[str]:
    """Remove this user's memory segments that no live process owns (their ``owner.lock``
    flock is free).

    ``keep_job``: never touch that job's segments (the caller's own, which a restarted worker
    of this job may be about to read; not those of the older layout, which nothing reads). ``job``: only that job's segments. ``min_age``: only
    segments whose owner has been dead that long: the first collection that finds a
    segment's lock free records the time in it (``dead-since``), and its owner removes that
    mark when it takes the segment again (a restarted worker), so the grace runs from the
    owner's death as observed, never from its start. Only this user's private directory is
    looked at, and this user's own segments left directly in ``shm_dir`` by the layout
    before it (world-readable; nothing reads them now); only exact segment names, only
    directories and lock files that pass the checks of :func:`problem`; a link is never
    followed (the removal walks descriptors).

    Returns:
        The removed (or, with ``dry_run``, removable) segment paths.
    """
    wheres = []
    try:
        wheres.append((private_dir(shm_dir, create=False), True))
    except FileNotFoundError:
        pass
    except UnsafeSegmentError as e:
        log.warning("ckpt.memory_gc skipped: %s", e)
    if _guarded(shm_dir):
        wheres.append((shm_dir, False))
    wanted = None if job is None else _SAFE.sub("_", job)
    removed = []
    # This user's segments, then those this user left directly in ``shm_dir`` (the layout
    # before the private directory: 0755/0644, readable by every local user, and read by
    # nothing now); the latter are taken only when this user owns them and others cannot
    # write them (shm_dir is sticky: no one else can rename or replace them).
    for where, private_only in wheres:
        dfd = os.open(where, _OPEN_DIR)
        try:
            for name in segment_names(where):
                owner_job = SEGMENT_NAME.match(name).group(1)  # type: ignore[union-attr]
                # (keep_job spares what a restarted worker may read: nothing of the old layout)
                if (private_only and owner_job == keep_job) or wanted not in (None, owner_job):
                    continue
                path = os.path.join(where, name)
                if not private_only and not _ours(dfd, name):
                    continue  # another user's: none of our business, not even a warning
                if _collect(dfd, name, path, min_age, dry_run, private=private_only):
                    removed.append(path)
        finally:
            os.close(dfd)
    return removed


def _guarded(shm_dir: str) -> bool:
    """Whether no one else can rename or replace what this user has in ``shm_dir``: it
    belongs to this user or root, and is sticky (as /dev/shm is) or closed to others'
    writes. Elsewhere another user could swap this user's private directory, between its
    checks and a later use of its path, for a link to another of this user's directories."""
    try:
        st = os.stat(shm_dir)
    except OSError:
        return False
    return st.st_uid in (0, os.geteuid()) and (bool(st.st_mode & stat.S_ISVTX)
                                               or not st.st_mode & 0o022)


def _ours(dfd: int, name: str) -> bool:
    """Whether ``name`` in ``dfd`` is a real directory of this user (not followed)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _collect(pfd: int, name: str, path: str, min_age: float, dry_run: bool, *,
             private: bool = True) -> bool:
    """Remove one segment if its owner is dead (for ``min_age`` seconds); whether it was.
    ``private``: the segment and its lock file must be closed to others (else: not writable
    by them, as segments of the older layout are)."""
    try:
        sfd = os.open(name, _OPEN_DIR, dir_fd=pfd)
    except FileNotFoundError:
        return False
    except OSError as e:  # a link (ELOOP), not a directory, no permission
        log.warning("ckpt.memory_gc skipping %s: %s", path, e.strerror)
        return False
    try:
        why = problem(os.fstat(sfd), private=private)
        if why:
            log.warning("ckpt.memory_gc skipping %s: it %s", path, why)
            return False
        try:
            lfd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                          dir_fd=sfd)
        except FileNotFoundError:
            return False  # not a segment yet (being created), or not one at all
        except OSError as e:
            log.warning("ckpt.memory_gc skipping %s: its %s: %s", path, OWNER_FILE, e.strerror)
            return False
        try:
            why = problem(os.fstat(lfd), private=private)
            if why:
                log.warning("ckpt.memory_gc skipping %s: its %s %s", path, OWNER_FILE, why)
                return False
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return False  # a live process owns it
                raise
            dead_for = _dead_for(sfd, dry_run)
            if dead_for < min_age:
                log.info("ckpt.memory_gc kept=%s: its owner died %.0f s ago (removed after "
                         "%.0f s)", path, dead_for, min_age)
                return False
            if not dry_run:
                shutil.rmtree(name, dir_fd=pfd)  # walks descriptors: never through a link
                log.info("ckpt.memory_gc removed=%s", path)
            return True
        finally:
            os.close(lfd)
    finally:
        os.close(sfd)


def _dead_for(sfd: int, dry_run: bool) -> float:
    """Seconds since a collection first found this segment's owner dead (0: now, and the
    time is recorded unless ``dry_run``)."""
    try:
        return time.time() - os.stat(DEAD_FILE, dir_fd=sfd, follow_symlinks=False).st_mtime
    except FileNotFoundError:
        if not dry_run:
            os.close(os.open(DEAD_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=sfd))
        return 0.0
