"""The byte-level Storage contract over tensorstore's key-value store (``tensorstore.KvStore``).

URLs: ``tensorstore+file:///path`` (driver ``file``), ``tensorstore+s3://bucket/prefix``
(driver ``s3``) and ``tensorstore+gs://bucket/prefix`` (driver ``gcs``, untested here).
``storage_options`` are merged into the kvstore spec (``endpoint``, ``aws_region``,
``aws_credentials``...); ``client_kwargs.endpoint_url`` is understood too, so one options dict
serves both object-store backends, and so is ``AWS_ENDPOINT_URL`` in the environment.

The commit and the lock are the conditional-write protocol of :mod:`.lease`, on tensorstore's
storage generations: create-only is ``write(key, value, if_equal=<no value>)``, a replace is
``if_equal=<generation read>``. The ``file`` driver enforces the conditions itself (under its
lock files); for S3 tensorstore sends real conditional PUTs only with ``use_conditional_write``
(set here; by default it does so for AWS endpoints only and otherwise checks with a HEAD
first, which is not atomic). A conditional delete is always HEAD-then-DELETE on S3: only the
release of a lease uses it, and a lease is only taken over once expired.

What the Python API lacks: a stat call. ``size`` uses ``os.stat`` on the ``file`` driver; on
other drivers it asks for a byte range past any object and reads the size from the store's
``InvalidRange`` answer (``ActualObjectSize``), and reads the whole object if that fails.
Listing is by key range (no delimiter), so listing the root lists every key under it.
The ``file`` driver follows symbolic links; ckpt does not: on that driver every path is
checked as the POSIX backend checks it, and a path through a link is absent (and logged).
Objects are written in one request (no multipart: at most 5 GiB each on S3).
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

from .base import Buffer, Entry
from .lease import DEFAULT_LEASE_TTL, ConditionalStorage, children
from .posix import PosixStorage, SymlinkRefusedError

_DRIVERS = {"file": "file", "s3": "s3", "gs": "gcs"}
_SIZE_IN_ERROR = re.compile(rb"ActualObjectSize>(\d+)<|value of size (\d+)")
_FAR = 1 << 62


def _range(prefix: str):
    """The key range of everything under ``prefix/`` (``0`` is the byte after ``/``)."""
    import tensorstore as ts

    return ts.KvStore.KeyRange(f"{prefix}/", f"{prefix}0") if prefix else ts.KvStore.KeyRange()


class TensorstoreStorage(ConditionalStorage):
    """A checkpoint root in a tensorstore kvstore (see the module docstring).

    Args:
        url: ``tensorstore+file:///path``, ``tensorstore+s3://bucket/prefix`` or
            ``tensorstore+gs://bucket/prefix``.
        create: create the root directory (``file`` driver).
        storage_options: merged into the kvstore spec.
        lease_ttl: seconds a writer's lease lasts without renewal.
        allow_unsafe_commit: write even where the conditions are not enforced
            (``use_conditional_write: false`` on S3).
        retries, retry_delay: tensorstore's own retries of S3/GCS requests (attempts, first
            delay in seconds; the delay doubles up to 10 s).
    """

    def __init__(self, url: str, *, create: bool = True, storage_options: dict | None = None,
                 lease_ttl: float = DEFAULT_LEASE_TTL, allow_unsafe_commit: bool = False,
                 retries: int = 5, retry_delay: float = 0.2) -> None:
        import tensorstore as ts  # lazily: an optional heavy import

        super().__init__(lease_ttl=lease_ttl)
        parsed = urlparse(url)
        scheme = parsed.scheme.removeprefix("tensorstore+")
        if scheme not in _DRIVERS:
            raise ValueError(f"{url}: tensorstore+ URLs take file://, s3:// or gs://")
        self.driver = _DRIVERS[scheme]
        self.url = url.rstrip("/")
        self.allow_unsafe_commit = allow_unsafe_commit
        options = dict(storage_options or {})
        endpoint = (options.pop("client_kwargs", None) or {}).get("endpoint_url")
        if self.driver == "file":
            self.local_root = os.path.abspath(parsed.netloc + parsed.path)
            spec: dict[str, Any] = {"driver": "file", "path": self.local_root + "/"}
            if create:
                os.makedirs(self.local_root, exist_ok=True)
            # Its link checks (tensorstore's file driver follows links, in and out of the root).
            self._local: PosixStorage | None = PosixStorage(self.local_root, create=False)
        else:
            self.local_root = self._local = None
            prefix = parsed.path.strip("/")
            spec = {"driver": self.driver, "bucket": parsed.netloc,
                    "path": f"{prefix}/" if prefix else ""}
            retry = {"max_retries": retries, "initial_delay": f"{retry_delay}s",
                     "max_delay": "10s"}
            spec[f"{self.driver}_request_retries"] = retry
            if self.driver == "s3":
                # Like boto3/s3fs, the endpoint may come from the environment (the CLI).
                endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3",
                                                      os.environ.get("AWS_ENDPOINT_URL"))
                if endpoint:
                    spec["endpoint"] = endpoint
                spec["aws_region"] = os.environ.get("AWS_REGION",
                                                    os.environ.get("AWS_DEFAULT_REGION",
                                                                   "us-east-1"))
                if "AWS_ACCESS_KEY_ID" in os.environ:
                    spec["aws_credentials"] = {"type": "environment"}
                # Real conditional PUTs; tensorstore's default for non-AWS endpoints is a
                # HEAD followed by a plain PUT, which two writers can both pass.
                spec["use_conditional_write"] = True
        spec.update(options)
        self.conditional = self.driver != "s3" or bool(spec.get("use_conditional_write"))
        self.kv = ts.KvStore.open(spec).result()
        self._checked = False
        self._no_value: bytes | None = None

    # -- plumbing -------------------------------------------------------------------------------
    def _call(self, what: str, path: str, fn: Callable[[], Any]) -> Any:
        """Run a tensorstore call; its errors become FileNotFoundError or OSError."""
        try:
            return fn()
        except (FileNotFoundError, EOFError):
            raise
        except Exception as e:
            text = str(e)
            where = f"{self.url}/{path}"
            if text.startswith("NOT_FOUND"):
                raise FileNotFoundError(errno.ENOENT, text, where) from e
            raise OSError(errno.EIO, f"{what} {where} failed: {text}") from e

    def _inside(self, path: str) -> None:
        """``file`` driver: raise SymlinkRefusedError (a FileNotFoundError) when ``path`` is,
        or passes through, a symbolic link."""
        if self._local is not None:
            self._local.local_path(path)

    def _read(self, path: str, byte_range: slice | None = None):
        self._inside(path)

        def read():
            r = self.kv.read(path, byte_range=byte_range).result()
            if r.state != "value":
                raise FileNotFoundError(errno.ENOENT, "no such object", f"{self.url}/{path}")
            return r

        return self._call("reading", path, read)

    # -- bytes ----------------------------------------------------------------------------------
    def list(self, path: str = "") -> list[Entry]:
        try:
            self._inside(path)
        except SymlinkRefusedError:
            return []
        keys = self._call("listing", path, lambda: self.kv.list(_range(path)).result())
        entries = children(path, [k.decode() for k in keys])
        if self._local is not None:  # without the links (reported as the POSIX backend does)
            plain = {e.name for e in self._local.list(path)}
            entries = [e for e in entries if e.name in plain]
        return entries

    def exists(self, path: str) -> bool:
        if not path:
            return self.local_root is None or os.path.isdir(self.local_root)
        try:
            self._inside(path)
            self._read(path, slice(0, 0))
            return True
        except FileNotFoundError:
            return bool(self.list(path))

    def size(self, path: str) -> int:
        if self._local is not None:
            return self._local.size(path)
        try:
            self.kv.read(path, byte_range=slice(_FAR, None)).result()
        except Exception as e:  # the expected answer: a range past the end, with the size
            m = _SIZE_IN_ERROR.search(str(e).encode())
            if m:
                return int(m.group(1) or m.group(2))
        return len(self._read(path).value)

    def write(self, path: str, buffers: Sequence[Buffer]) -> int:
        self._inside(path)  # never into a linked directory
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        self._call("writing", path, lambda: self.kv.write(path, data).result())
        return len(data)

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        end = None if length is None else start + length
        try:
            return bytes(self._read(path, slice(start, end)).value)
        except OSError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise
        if end is None:
            return b""  # starts past the end, like a short read of a file
        # The range runs past the end: what is there, as a file's short read gives it.
        return self.read(path, start, None)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        view = memoryview(out).cast("B")
        if view.nbytes == 0:
            return
        try:
            data = self._read(path, slice(start, start + view.nbytes)).value
        except OSError as e:
            if "OUT_OF_RANGE" not in str(e) or isinstance(e, FileNotFoundError):
                raise
            data = b""
        if len(data) < view.nbytes:
            raise EOFError(f"{self.url}/{path} ends before byte {start + view.nbytes}")
        view[:] = data

    def delete(self, path: str) -> None:
        try:
            self._inside(path)
        except SymlinkRefusedError:
            return  # ignored (and reported): never delete through, or a planted, link
        local = os.path.join(self.local_root, path) if self.local_root is not None else None

        def rm() -> None:
            if path and not (local is not None and os.path.isdir(local)):
                self.kv.write(path, None).result()
            self.kv.delete_range(_range(path)).result()

        try:
            self._call("deleting", path, rm)
        except FileNotFoundError:  # the file driver, when another process removed the
            pass  # directory meanwhile (ranks collecting one root): deleted, as asked
        if local is not None and path and os.path.isdir(local):
            # The file driver leaves the emptied directories behind: remove those (only).
            for d, _, _ in sorted(os.walk(local), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(d)
                except OSError:
                    pass

    # -- conditional writes ---------------------------------------------------------------------
    def check_conditional_writes(self) -> None:
        if self._checked:
            return
        if not self.conditional and not self.allow_unsafe_commit:
            raise OSError(errno.EOPNOTSUPP, f"{self.url}: use_conditional_write is off, so "
                          "create-only writes are a HEAD then a PUT that two writers can both "
                          "pass; pass allow_unsafe_commit=True to write anyway")
        if self.local_root is None and self.conditional:
            self._probe_create_only("")
        self._checked = True

    def _no_value_generation(self) -> bytes:
        if self._no_value is None:  # tensorstore's encoding of "no object", as it reports it
            probe = f".ckpt-absent-{uuid.uuid4().hex}"
            r = self._call("reading", probe, lambda: self.kv.read(probe).result())
            self._no_value = r.stamp.generation
        return self._no_value

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        try:
            r = self._read(path)
        except FileNotFoundError:
            return None
        return bytes(r.value), r.stamp.generation.hex()

    def create_only(self, path: str, data: bytes) -> str | None:
        return self._write_if(path, data, self._no_value_generation())

    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        return self._write_if(path, data, bytes.fromhex(version))

    def _write_if(self, path: str, data: bytes, generation: bytes) -> str | None:
        stamp = self._call("writing", path,
                           lambda: self.kv.write(path, data, if_equal=generation).result())
        if stamp.generation:
            return stamp.generation.hex()
        # Refused; or refused because tensorstore's own retry found its first attempt's object.
        current = self.read_versioned(path)
        return current[1] if current is not None and current[0] == data else None

    def delete_if(self, path: str, version: str) -> bool:
        stamp = self._call("deleting", path, lambda: self.kv.write(
            path, None, if_equal=bytes.fromhex(version)).result())
        return bool(stamp.generation)
