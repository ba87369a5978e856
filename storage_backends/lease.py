"""Conditional writes on object stores: the create-only commit and the writer lease.

Object stores have no rename and no flock. What they do have is the conditional write: create
an object only if its key is absent (S3 ``If-None-Match: *``, a tensorstore ``if_equal`` of
"no value"), replace or delete it only if it still holds the version that was read (S3
``If-Match: <etag>``, a tensorstore generation). The commit of a step and the writer lock are
built on those four primitives, here, once, for every object-store backend.

Commit: there is no staging location. Data objects go straight under ``step-N/``; their names
carry the save's token, so attempts never overwrite each other. The manifest is written last
with a create-only write: that write is the commit point. A prefix without a manifest is
invisible to readers and is removed by the collector (``ckpt._retention.collect``).

Lease: ``ROOT/.lock`` holds JSON ``{host, pid, since, expires, ...}``, created create-only. A
thread renews it every ttl/3 with a replace conditional on the version it last wrote, so a
writer that lost its lease finds out instead of overwriting the new holder's. A lease whose
``expires`` has passed (its writer died) is taken over with a replace conditional on the
version read: when two writers race for it, the store lets exactly one of them win. (Deleting
the stale lease and then creating a new one would not do: the slower contender could delete
the lease the faster one had just created, and both would think they held it.)

A lease that lapsed while its writer lived (the store stopped answering long enough for it to
expire) is taken again at the writer's next commit if the object still holds this writer's
own record: then nobody else held the root meanwhile. If another writer's record is there (or
none), the commit is refused with :class:`LeaseLostError`: that writer may have changed the
root under this one.
"""

from __future__ import annotations

import abc
import atexit
import errno
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref

from .base import Entry, LockHeldError, Storage

log = logging.getLogger("ckpt.storage")

LEASE_NAME = ".lock"
DEFAULT_LEASE_TTL = 60.0
_HELD: weakref.WeakSet[LeaseLock] = weakref.WeakSet()


@atexit.register
def _release_at_exit() -> None:
    # A process that ends no longer writes; and a renewal thread still inside a storage
    # client (tensorstore's C++) while the interpreter finalizes would abort the process.
    for lease in list(_HELD):
        lease.release()


def _this_machine() -> dict:
    """What tells two processes apart on one host: its boot and the pid namespace."""
    ident = {"host": socket.gethostname()}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            ident["boot"] = f.read().strip()
        ident["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pass
    return ident


def _dead_here(holder: dict) -> bool:
    """Whether the holder ran on this very machine (same boot, same pid namespace) and its
    process is gone: then its lease is stale now, not only once it expires. This is what lets
    a job restarted on the same node (torchrun restarts, a crashed run resubmitted) go on at
    once instead of waiting out the ttl."""
    here = _this_machine()
    if "boot" not in here or any(holder.get(k) != here[k] for k in ("host", "boot", "pidns")):
        return False
    pid = holder.get("pid")
    if not (type(pid) is int and 0 < pid < 1 << 31) or pid == os.getpid():
        return False  # (os.kill raised OverflowError for a hand-edited pid of 2**64)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by another user
        return False
    return False


def _parse(raw: bytes | None) -> dict:
    try:
        holder = json.loads(raw or b"")
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


def _stale(holder: dict) -> bool:
    expires = holder.get("expires")
    if not isinstance(expires, (int, float)) or not math.isfinite(expires):
        # not a lease we wrote (object writes are atomic: never a torn one); a NaN or an
        # infinite expiry would otherwise hold the root forever
        return True
    return expires < time.time() or _dead_here(holder)


class LeaseLostError(LockHeldError):
    """This writer's lease lapsed and another writer took the root meanwhile (``holder``)."""

    def __init__(self, path: str, holder: dict) -> None:
        super().__init__(path, holder)
        self.args = (f"{path}: this writer's lease on the root was lost (it lapsed or was "
                     f"taken over) and the root's lease record now names {self.who}",)

    def __str__(self) -> str:
        return str(self.args[0])


class LeaseLock:
    """A held lease on ``ROOT/.lock`` of a :class:`ConditionalStorage`, renewed in the
    background until :meth:`release`. Raises :class:`LockHeldError` when a live writer holds it.

    Clocks: a contender compares the holder's ``expires`` (the holder's clock) with its own,
    so clock skew between writers must stay well below ``ttl``.
    """

    def __init__(self, store: ConditionalStorage, owner: dict, *,
                 ttl: float = DEFAULT_LEASE_TTL, path: str = LEASE_NAME) -> None:
        if ttl <= 0:
            raise ValueError(f"the lease ttl must be positive, not {ttl}")
        self._store, self._path, self.ttl = store, path, float(ttl)
        self._owner = {**_this_machine(), **owner, "lease": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._renewing = threading.Lock()
        self._released = False
        self.lost = False
        self._version, self.expires = self._acquire()
        self._start_renewing()
        _HELD.add(self)

    def _start_renewing(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, args=(self._stop,),
                                        name="ckpt-lease", daemon=True)
        self._thread.start()

    def _body(self) -> tuple[bytes, float]:
        expires = time.time() + self.ttl
        return json.dumps({**self._owner, "expires": expires, "ttl": self.ttl}).encode(), expires

    def _acquire(self) -> tuple[str, float]:
        holder: dict = {}
        for _ in range(3):  # the lease may vanish or change hands between our requests
            body, expires = self._body()
            version = self._store.create_only(self._path, body)
            if version is not None:
                return version, expires
            current = self._store.read_versioned(self._path)
            if current is None:
                continue
            holder = _parse(current[0])
            if not _stale(holder):
                raise LockHeldError(self._store.url, holder)
            body, expires = self._body()
            version = self._store.replace_if(self._path, body, current[1])
            if version is not None:
                log.warning("ckpt.lease took over the stale lease of %s on %s", holder,
                            self._store.url)
                return version, expires
        raise LockHeldError(self._store.url, holder)

    @property
    def released(self) -> bool:
        return self._released

    def valid(self) -> bool:
        """Held, not lost to a takeover, and not past its expiry on this clock."""
        return not self._released and not self.lost and time.time() < self.expires

    def _renew_loop(self, stop: threading.Event) -> None:
        interval = self.ttl / 3
        wait = interval
        while not stop.wait(wait):
            body, expires = self._body()
            with self._renewing:
                if stop.is_set():
                    return
                try:
                    version = self._store.replace_if(self._path, body, self._version)
                except Exception as e:  # transient: try again soon, while the lease lasts
                    if time.time() < self.expires:
                        log.warning("ckpt.lease renewal of %s failed (%s); retrying",
                                    self._store.url, e)
                        wait = max(0.05, interval / 5)
                        continue
                    version = None
                if version is None:
                    self.lost = True
                    log.error("ckpt.lease on %s was lost (expired or taken over): the next "
                              "commit takes it again only if no other writer took the root",
                              self._store.url)
                    return
                self._version, self.expires, wait = version, expires, interval

    def _stop_renewing(self) -> None:
        self._stop.set()
        with self._renewing:  # let a renewal in flight finish, so our version is current
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def regain(self) -> None:
        """Hold the lease again after it lapsed (not released), if the object still holds
        this writer's own record: nobody else took the root meanwhile.

        Raises:
            LeaseLostError: another writer's record is there, or none (the root may have
                changed under this writer).
            OSError: the store failed.
        """
        if self._released:
            raise ValueError("a released lease is not regained")
        self._stop_renewing()
        lapsed = time.time() - self.expires
        current = self._store.read_versioned(self._path)
        holder = _parse(current[0]) if current is not None else {}
        version = None
        if current is not None and holder.get("lease") == self._owner["lease"]:
            body, expires = self._body()
            version = self._store.replace_if(self._path, body, current[1])
        if version is None:
            self.lost = True
            raise LeaseLostError(self._store.url, holder)
        self._version, self.expires, self.lost = version, expires, False
        self._start_renewing()
        log.warning("ckpt.lease on %s had lapsed %.1f s ago; regained it (no other writer "
                    "took the root meanwhile)", self._store.url, lapsed)

    def release(self) -> None:
        """Stop renewing and delete the lease (if it is still ours). Idempotent."""
        if self._released:
            return
        self._released = True
        _HELD.discard(self)
        self._stop_renewing()
        if self.lost:
            return
        try:
            self._store.delete_if(self._path, self._version)
        except Exception as e:  # it expires on its own; the next writer takes it over then
            log.warning("ckpt.lease could not delete %s/%s (%s); it expires in %.0f s",
                        self._store.url, self._path, e, self.expires - time.time())


class ConditionalStorage(Storage):
    """A :class:`Storage` without rename whose commit and lock use conditional writes.

    Subclasses provide the byte methods of :class:`Storage` plus four conditional primitives
    (each returns None, or False, when its condition does not hold, and raises ``OSError`` on
    a storage failure).
    """

    # A committed step is never replaced (POSIX renames the old one aside): a writer must
    # retire it (delete its manifest) before saving that step again.
    replaces_committed_steps = False

    def __init__(self, *, lease_ttl: float = DEFAULT_LEASE_TTL) -> None:
        self.lease_ttl = lease_ttl
        self._mutex = threading.Lock()
        self._attempts: dict[str, set[str]] = {}   # step -> tokens begun in this process
        self._committing: dict[str, str] = {}      # step -> manifest name, once commit began
        self._lease: LeaseLock | None = None

    def _probe_create_only(self, hint: str) -> None:
        """Create one object twice: a store that accepts the second create ignores the
        condition, and ckpt's commit and lock would not be safe on it."""
        probe = f".ckpt-probe-{uuid.uuid4().hex}"
        try:
            first = self.create_only(probe, b"1")
            second = self.create_only(probe, b"2")
        finally:
            self.delete(probe)
        if first is None or second is not None:
            raise OSError(errno.EOPNOTSUPP, f"{self.url}: the store ignored a create-only "
                          f"write{hint}; ckpt's commit and lock need conditional writes")

    # -- the conditional primitives -------------------------------------------------------
    @abc.abstractmethod
    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        """The object's bytes and version, or None when it does not exist."""

    @abc.abstractmethod
    def create_only(self, path: str, data: bytes) -> str | None:
        """Create the object if absent; its new version, or None when it already exists."""

    @abc.abstractmethod
    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        """Overwrite the object if it still has ``version``; the new version, or None."""

    @abc.abstractmethod
    def delete_if(self, path: str, version: str) -> bool:
        """Delete the object if it still has ``version``; whether it was deleted."""

    def check_conditional_writes(self) -> None:
        """Raise OSError unless this store really honours the conditions (writers only)."""

    # -- the save protocol -------------------------------------------------------------------
    def begin(self, name: str, token: str) -> str:
        # No staging location: data objects are written in place, named by the token.
        with self._mutex:
            self._attempts.setdefault(name, set()).add(token)
        return name

    def commit(self, staging: str, name: str, manifest: bytes, manifest_name: str) -> None:
        if staging != name:
            raise ValueError(f"{self.url}: {staging!r} is not the staging location of {name!r}")
        self.check_conditional_writes()
        lease = self._lease
        if lease is not None and not lease.released and not lease.valid():
            lease.regain()  # raises LeaseLostError when another writer took the root
        with self._mutex:
            self._committing[name] = manifest_name
        # The commit point: the manifest appears whole, and only if no manifest is there yet,
        # so a second writer (or a retried request) can never replace a committed step.
        if self.create_only(f"{name}/{manifest_name}", manifest) is None:
            raise FileExistsError(
                errno.EEXIST, f"{self.url}/{name} is already committed (it has a "
                f"{manifest_name}); object stores never replace a committed step: retire it "
                "first (delete its manifest)")
        with self._mutex:
            self._attempts.pop(name, None)
            self._committing.pop(name, None)

    def abort(self, staging: str) -> None:
        """Delete the objects of this process's attempts at ``staging`` (by their tokens)."""
        with self._mutex:
            tokens = self._attempts.pop(staging, set())
            manifest_name = self._committing.pop(staging, None)
        if not tokens:
            return
        if manifest_name is not None:
            # A commit that reported a failure may still have landed (a lost response): then
            # the step is committed and its objects must stay.
            current = self.read_versioned(f"{staging}/{manifest_name}")
            if current is not None and any(t.encode() in current[0] for t in tokens):
                log.warning("ckpt.abort %s/%s is committed after all; keeping it", self.url,
                            staging)
                return
        for entry in self.list(staging):
            if not entry.is_dir and any(t in entry.name for t in tokens):
                self.delete(f"{staging}/{entry.name}")

    def uncommitted(self) -> list[str]:
        # Nothing is staged apart from the steps: the collector removes manifest-less steps.
        return []

    def lock(self, owner: dict) -> LeaseLock:
        self.check_conditional_writes()
        self._lease = LeaseLock(self, owner, ttl=self.lease_ttl)
        return self._lease


def children(root: str, keys: list[str]) -> list[Entry]:
    """The entries directly under ``root`` among full ``keys`` (for stores that list keys)."""
    prefix = f"{root}/" if root else ""
    found: dict[str, bool] = {}
    for key in keys:
        if not key.startswith(prefix) or key == prefix:
            continue
        head, sep, _ = key[len(prefix):].partition("/")
        if head:
            found[head] = found.get(head, False) or bool(sep)
    return [Entry(name, is_dir) for name, is_dir in sorted(found.items())]
