"""Object storage through fsspec: S3 (s3fs), ``memory://`` and other fsspec file systems.

The commit and the lock are the conditional-write protocol of :mod:`.lease`. On S3 the
conditions are the store's own (``If-None-Match: *``, ``If-Match: <etag>``), and a writer first
checks once that the store really enforces them: an S3-compatible store that ignores them
would silently break both the commit and the lock. ``memory://`` lives inside this process,
so there the conditions are emulated exactly under a process lock. Any other fsspec protocol
has no conditional write ckpt can rely on: writing to it needs ``allow_unsafe_commit=True``
(the same emulation, which does not exclude other processes); reading never does.

Errors: throttling (SlowDown, 503), other 5xx, timeouts and dropped connections are retried
with exponential backoff and jitter, a bounded number of times; the last failure is raised as
an ``OSError`` with the store's error chained. ckpt turns it into a ``StorageError``.

Deadlines (async file systems: S3): every request has botocore's connect and read timeouts,
and every operation (a listing, a read, one part of an upload, with all its retries) ends
within ``deadline`` seconds: the request in flight is cancelled then. So a store that stops
answering fails each operation within ``deadline``, and a save within about that (its
cleanup is skipped while the store does not answer; see docs/storage.md).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import random
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

from . import s3_upload
from .base import Buffer, Entry
from .lease import DEFAULT_LEASE_TTL, ConditionalStorage
from .transient import NOT_TRANSIENT, http_status, is_transient, precondition_failed

__all__ = ["FsspecStorage", "http_status", "is_transient"]

log = logging.getLogger("ckpt.storage")

NATIVE_CONDITIONS = ("s3", "s3a")
IN_PROCESS = ("memory",)

_EMULATION = threading.Lock()  # serializes emulated conditional writes in this process
# Deadlines (seconds); see the class docstring.
DEFAULT_DEADLINE = 60.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_READ_TIMEOUT = 20.0
# Reads smaller than a block go through a small cache of whole blocks: a restore reads every
# chunk of a file, and small tensors make small chunks, so this turns hundreds of ranged GETs
# (tens of ms each on S3) into a few. Data objects are immutable (their names carry the save's
# token); this instance forgets what it writes or deletes itself.
READ_BLOCK = 8 << 20
READ_CACHE_BYTES = 64 << 20


class _BlockCache:
    """Recently read blocks of objects, least recently used out first; a block that several
    threads want at once is fetched once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._size = 0
        self._inflight: dict[tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int], fetch: Callable[[], bytes]) -> bytes:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return self._blocks[key]
            event = self._inflight.get(key)
            mine = event is None
            if mine:
                event = self._inflight[key] = threading.Event()
        if not mine:
            event.wait()
            with self._lock:
                data = self._blocks.get(key)
            return data if data is not None else fetch()  # the fetching thread failed
        try:
            data = fetch()
            with self._lock:
                self._blocks[key] = data
                self._size += len(data)
                while self._size > self.capacity and len(self._blocks) > 1:
                    self._size -= len(self._blocks.popitem(last=False)[1])
            return data
        finally:
            with self._lock:
                del self._inflight[key]
            event.set()

    def forget(self, path: str) -> None:
        """Drop the blocks of ``path`` and of everything under it."""
        with self._lock:
            for key in [k for k in self._blocks if k[0] == path or k[0].startswith(path + "/")]:
                self._size -= len(self._blocks.pop(key))


class FsspecStorage(ConditionalStorage):
    """A checkpoint root on an fsspec file system (``s3://bucket/prefix``, ``memory://x``...).

    Args:
        url: the root, with its protocol.
        create: for ``memory://``, create the root; for S3, check that the bucket exists.
        storage_options: passed to fsspec (for S3: ``client_kwargs={"endpoint_url": ...}``,
            ``key``/``secret``...). ckpt sets S3 defaults that the options may override:
            listings are not cached, and botocore does not retry (this class does).
        lease_ttl: seconds a writer's lease lasts without renewal (see :mod:`.lease`).
        allow_unsafe_commit: write to a protocol without conditional writes (not safe
            against two writers on one root, nor against a retried request).
        retries: attempts per operation on transient errors (throttling, 5xx, connection).
        retry_delay: the first backoff in seconds; it doubles per attempt (capped at 10 s),
            with random jitter.
        block_size: bytes per part of a multipart upload (at least 5 MiB); larger objects
            are uploaded in parts as they are written.
        deadline: seconds one operation may take, all its requests and retries included
            (one part of an upload is one operation: ``block_size`` bytes must cross within
            it); then the request in flight is cancelled and an OSError raised. S3 (and other
            async file systems) only: ``memory://`` runs in this process.
        connect_timeout, read_timeout: botocore's timeouts for one request (S3), unless
            ``storage_options["config_kwargs"]`` sets them: a silent request fails after
            ``read_timeout`` and is retried while its operation's deadline lasts.
    """

    def __init__(self, url: str, *, create: bool = True, storage_options: dict | None = None,
                 lease_ttl: float = DEFAULT_LEASE_TTL, allow_unsafe_commit: bool = False,
                 retries: int = 5, retry_delay: float = 0.2, block_size: int = 32 << 20,
                 deadline: float = DEFAULT_DEADLINE,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 read_timeout: float = DEFAULT_READ_TIMEOUT) -> None:
        from fsspec.core import url_to_fs  # lazily: only object-store users pay for it

        super().__init__(lease_ttl=lease_ttl)
        if retries < 1:
            raise ValueError(f"retries must be at least 1, not {retries}")
        for name, value in (("deadline", deadline), ("connect_timeout", connect_timeout),
                            ("read_timeout", read_timeout)):
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        self.protocol = url.split("://", 1)[0] if "://" in url else "file"
        options = dict(storage_options or {})
        if self.protocol in NATIVE_CONDITIONS:
            options.setdefault("use_listings_cache", False)
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
            config.setdefault("connect_timeout", connect_timeout)
            config.setdefault("read_timeout", read_timeout)
            options["config_kwargs"] = config
        self.fs, path = url_to_fs(url, **options)
        self.root = path.rstrip("/")
        self.url = url.rstrip("/")
        self.allow_unsafe_commit = allow_unsafe_commit
        self.retries, self.retry_delay = retries, retry_delay
        self.block_size = max(int(block_size), 5 << 20)
        self.deadline = float(deadline)
        # Whether the last operation ran out of its deadline (the store does not answer);
        # cleared by the next one that succeeds.
        self.unreachable = False
        self._left = threading.local()  # the time left to the operation on this thread
        self._checked = False
        self._cache = _BlockCache(READ_CACHE_BYTES)
        # The bytes the responses to ranged reads carried (whole blocks of the read cache
        # around small reads): what crossed the network, as a restore reports it.
        self.bytes_fetched = 0
        self._fetched_lock = threading.Lock()
        if create:
            self._call("opening", "", self._create_root)

    def _create_root(self) -> None:
        if self.protocol in NATIVE_CONDITIONS:
            bucket = self.root.split("/", 1)[0]
            try:  # not fs.exists: for a bucket it answers False when the server is down
                self.fs.call_s3("head_bucket", Bucket=bucket, **self.time_left())
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"bucket {bucket} does not exist (ckpt "
                                        "does not create buckets)", bucket) from None
        elif self.protocol in IN_PROCESS:
            self.fs.makedirs(self.root, exist_ok=True)

    # -- plumbing -------------------------------------------------------------------------------
    def _abs(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def time_left(self) -> dict:
        """``{"timeout": seconds}`` left to the operation running on this thread, for the
        calls of an async file system (fsspec's ``sync`` cancels the request then); ``{}``
        for a file system in this process."""
        left = getattr(self._left, "seconds", None)
        if left is None or not getattr(self.fs, "async_impl", False):
            return {}
        return {"timeout": max(left - time.monotonic(), 0.001)}

    def _call(self, what: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` with bounded retries on transient errors, all within the deadline;
        raise OSError at the end."""
        where = f"{self.url}/{path}" if path else self.url
        end = time.monotonic() + self.deadline
        outer, self._left.seconds = getattr(self._left, "seconds", None), end
        try:
            for attempt in range(1, self.retries + 1):
                try:
                    result = fn(*args)
                    self.unreachable = False
                    return result
                except NOT_TRANSIENT:
                    raise
                except Exception as e:
                    left = end - time.monotonic()
                    if attempt < self.retries and is_transient(e) and left > 0:
                        delay = min(10.0, self.retry_delay * 2 ** (attempt - 1))
                        delay = random.uniform(delay / 2, delay)  # jitter: writers do not sync
                        delay = min(delay, left / 2)
                        log.warning("ckpt.storage %s %s failed (%s: %s); retry %d/%d in %.2fs",
                                    what, where, type(e).__name__, e, attempt,
                                    self.retries - 1, delay)
                        time.sleep(delay)
                        continue
                    tries = f" after {attempt} attempts" if attempt > 1 else ""
                    if left <= 0 and is_transient(e):
                        self.unreachable = True
                        last = f"{type(e).__name__}: {e}" if str(e) else "cancelled"
                        raise OSError(errno.ETIMEDOUT, f"{what} {where} got no answer within "
                                      f"its deadline of {self.deadline:g} s{tries} (last: "
                                      f"{last}); the store is down or "
                                      "overloaded, or the storage option 'deadline' is too "
                                      "short for it") from e
                    raise OSError(errno.EIO, f"{what} {where} failed{tries}: "
                                             f"{type(e).__name__}: {e}") from e
            raise AssertionError("unreachable")
        finally:
            self._left.seconds = outer

    # -- bytes ----------------------------------------------------------------------------------
    def list(self, path: str = "") -> list[Entry]:
        full = self._abs(path)

        def ls() -> list[dict]:
            try:
                return self.fs.ls(full, detail=True, refresh=True, **self.time_left())
            except (FileNotFoundError, NotADirectoryError):
                return []

        entries = []
        for info in self._call("listing", path, ls):
            name = info["name"].rstrip("/")
            if name.lstrip("/") == full.lstrip("/"):
                continue  # ls of a file lists the file itself
            entries.append(Entry(name.rsplit("/", 1)[-1], info["type"] == "directory"))
        return entries

    def exists(self, path: str) -> bool:
        return self._call("checking", path, lambda: self.fs.exists(self._abs(path),
                                                                **self.time_left()))

    def size(self, path: str) -> int:
        info = self._call("sizing", path, lambda: self.fs.info(self._abs(path),
                                                               **self.time_left()))
        if info["type"] == "directory":
            raise IsADirectoryError(errno.EISDIR, "a directory has no size", self._abs(path))
        return int(info["size"])

    def write(self, path: str, buffers: Sequence[Buffer]) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        self._cache.forget(self._abs(path))
        if self.protocol in NATIVE_CONDITIONS:  # request by request, each within its deadline
            s3_upload.put(self, path, self._abs(path), views, total)
        else:
            self._call("writing", path, self._put, self._abs(path), views, total)
        return total

    def _put(self, full: str, views: list[memoryview], total: int) -> None:
        # Written in slices of one part: s3fs buffers a part, uploads it, and completes the
        # multipart upload at close (one plain PUT when the object fits in one part).
        block = s3_upload.part_size(self.block_size, total)
        f = self.fs.open(full, "wb", block_size=block)
        try:
            for view in views:
                for i in range(0, view.nbytes, block):
                    f.write(view[i:i + block])
            f.close()
        except BaseException:
            try:
                f.discard()  # abort the multipart upload instead of completing a partial one
            except Exception:  # no discard (memory://), or the store is unreachable
                pass
            try:
                f.closed = True  # and never let close() (or __del__) publish a partial object
            except AttributeError:  # a read-only attribute (memory://: a BytesIO)
                pass
            raise

    def _range(self, full: str, start: int, end: int | None) -> bytes:
        try:
            data = self.fs.cat_file(full, start=start or None, end=end, **self.time_left())
        except OSError as e:
            if http_status(e.__cause__ or e) == 416:  # starts past the end: like a file
                return b""
            raise
        self._fetched(len(data))
        return data

    def _fetched(self, n: int) -> None:
        with self._fetched_lock:
            self.bytes_fetched += n

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        end = None if length is None else start + length
        return self._call("reading", path, self._range, self._abs(path), start, end)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        n = view.nbytes
        if n == 0:
            return
        full = self._abs(path)
        if n >= READ_BLOCK:
            self.read_range_into(path, start, view)
            return
        got = self._read_cached(path, full, start, view)
        if got < n:
            raise self._short(path, start, n)

    def read_range_into(self, path: str, start: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        n = view.nbytes
        if n == 0:
            return
        # Ranged GETs of one block each, concurrent on an async file system (S3).
        starts = list(range(start, start + n, READ_BLOCK))
        ends = [min(s + READ_BLOCK, start + n) for s in starts]
        got = 0
        for piece in self._call("reading", path, self._cat_ranges, self._abs(path), starts,
                                ends):
            view[got:got + len(piece)] = piece
            got += len(piece)
            if got < n and len(piece) < READ_BLOCK:
                break
        if got < n:
            raise self._short(path, start, n)

    def _short(self, path: str, start: int, n: int) -> EOFError:
        return EOFError(f"{self.url}/{path} ends before byte {start + n} (wanted bytes "
                        f"{start}..{start + n})")

    def _read_cached(self, path: str, full: str, start: int, view: memoryview) -> int:
        got, n = 0, view.nbytes
        for block in range(start // READ_BLOCK, (start + n - 1) // READ_BLOCK + 1):
            base = block * READ_BLOCK
            data = self._cache.get((full, block), lambda: self._call(
                "reading", path, self._range, full, base, base + READ_BLOCK))
            piece = data[max(start, base) - base:min(start + n, base + READ_BLOCK) - base]
            view[got:got + len(piece)] = piece
            got += len(piece)
            if len(data) < READ_BLOCK:
                break  # the object ends in this block
        return got

    def _cat_ranges(self, full: str, starts: list[int], ends: list[int]) -> list[bytes]:
        out = self.fs.cat_ranges([full] * len(starts), starts, ends, on_error="return",
                                 **self.time_left())
        self._fetched(sum(len(p) for p in out if isinstance(p, bytes)))
        for item in out:
            if isinstance(item, BaseException):
                if http_status(item.__cause__ or item) == 416:
                    return [p if isinstance(p, bytes) else b"" for p in out]
                raise item
        return out

    def delete(self, path: str) -> None:
        self._cache.forget(self._abs(path))

        def rm() -> None:
            try:
                self.fs.rm(self._abs(path), recursive=True, **self.time_left())
            except FileNotFoundError:
                pass

        self._call("deleting", path, rm)

    def abort(self, staging: str) -> None:
        if self.unreachable:
            # Cleaning up would wait out one more deadline per request against a store that
            # does not answer. What the attempt wrote has no manifest: readers never see it,
            # and the next writer's cleanup (or ckpt gc) collects it.
            with self._mutex:
                self._attempts.pop(staging, None)
                self._committing.pop(staging, None)
            log.warning("ckpt.abort %s/%s skipped: the store did not answer in time; the "
                        "attempt's objects are collected later", self.url, staging)
            return
        super().abort(staging)

    # -- conditional writes ---------------------------------------------------------------------
    def check_conditional_writes(self) -> None:
        if self._checked:
            return
        if self.protocol in NATIVE_CONDITIONS:
            self._probe_create_only(" (If-None-Match: use AWS S3, recent MinIO...)")
        elif self.protocol not in IN_PROCESS and not self.allow_unsafe_commit:
            raise OSError(errno.EOPNOTSUPP, f"{self.url}: ckpt knows no atomic create-only "
                          f"write for {self.protocol}://, so two writers (or a retried request) "
                          "could both commit or both hold the lock; pass "
                          "allow_unsafe_commit=True to write anyway, or use a tensorstore+ URL")
        self._checked = True

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        full = self._abs(path)
        if self.protocol in NATIVE_CONDITIONS:
            from fsspec.asyn import sync

            bucket, key, _ = self.fs.split_path(full)

            async def get() -> tuple[bytes, str]:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                try:
                    return await resp["Body"].read(), resp["ETag"]
                finally:
                    resp["Body"].close()

            fetch = lambda: sync(self.fs.loop, get, **self.time_left())  # noqa: E731
        else:
            def fetch() -> tuple[bytes, str]:
                data = self.fs.cat_file(full)
                return data, hashlib.md5(data).hexdigest()
        try:
            return self._call("reading", path, fetch)
        except FileNotFoundError:
            return None

    def create_only(self, path: str, data: bytes) -> str | None:
        return self._conditional(path, data, None)

    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        return self._conditional(path, data, version)

    def _conditional(self, path: str, data: bytes, version: str | None) -> str | None:
        full = self._abs(path)

        def put() -> str | None:
            if self.protocol in NATIVE_CONDITIONS:
                cond = {"mode": "create"} if version is None else {"IfMatch": version}
                try:
                    return self.fs.pipe_file(full, data, **cond, **self.time_left())["ETag"]
                except Exception as e:
                    if precondition_failed(e) or isinstance(e, FileNotFoundError):
                        return None
                    raise
            with _EMULATION:
                try:
                    current = self.fs.cat_file(full)
                except FileNotFoundError:
                    current = None
                if (current is not None) if version is None else (
                        current is None or hashlib.md5(current).hexdigest() != version):
                    return None
                self.fs.pipe_file(full, data)
                return hashlib.md5(data).hexdigest()

        result = self._call("writing", path, put)
        if result is None:
            # Refused: but a retried request may have been refused by our own first attempt,
            # whose answer was lost. The bytes tell (leases and manifests are unique).
            current = self.read_versioned(path)
            if current is not None and current[0] == data:
                return current[1]
        return result

    def delete_if(self, path: str, version: str) -> bool:
        full = self._abs(path)

        def rm() -> bool:
            if self.protocol in NATIVE_CONDITIONS:
                bucket, key, _ = self.fs.split_path(full)
                try:
                    self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version,
                                    **self.time_left())
                    return True
                except Exception as e:
                    if precondition_failed(e) or isinstance(e, FileNotFoundError):
                        return False
                    raise
            with _EMULATION:
                try:
                    current = self.fs.cat_file(full)
                except FileNotFoundError:
                    return False
                if hashlib.md5(current).hexdigest() != version:
                    return False
                self.fs.rm_file(full)
                return True

        return self._call("deleting", path, rm)
