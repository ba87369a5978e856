"""Uploads to S3 as single requests, each under the operation deadline of
:class:`~storage_backends.fsspec_store.FsspecStorage`.

s3fs's file objects upload their parts through calls that take no deadline, and a request
whose body the server stops reading (a frozen endpoint: its kernel buffers fill, then the
write waits for ever) is not covered by botocore's read timeout, which starts only once the
body is sent. So ckpt issues the requests itself: one ``put_object`` when the object fits in
one part, else ``create_multipart_upload``, one ``upload_part`` per part and
``complete_multipart_upload``; every request is retried and cut off by the storage's
``_call``, which cancels it at its deadline.
"""

from __future__ import annotations

from typing import Any, Iterator

PART_LIMIT = 9_000  # S3 allows 10,000 parts per object; keep a margin


def part_size(block_size: int, total: int) -> int:
    """Bytes per part: ``block_size``, larger when the object would need too many parts."""
    return max(block_size, -(-total // PART_LIMIT))


def _parts(views: list[memoryview], block: int) -> Iterator[bytes]:
    """The concatenation of ``views`` in pieces of ``block`` bytes (the last one shorter)."""
    pending: list[memoryview] = []
    size = 0
    for view in views:
        offset = 0
        while offset < view.nbytes:
            take = min(block - size, view.nbytes - offset)
            pending.append(view[offset:offset + take])
            size += take
            offset += take
            if size == block:
                yield b"".join(pending)
                pending, size = [], 0
    if pending:
        yield b"".join(pending)


def put(store: Any, path: str, full: str, views: list[memoryview], total: int) -> None:
    """Upload the concatenation of ``views`` as the object ``full`` (``path`` under the
    store's root, for messages). Raises OSError (the store's ``_call``) on failure; a
    multipart upload that fails is aborted when the store still answers."""
    block = part_size(store.block_size, total)
    bucket, key, _ = store.fs.split_path(full)
    s3 = store.fs.call_s3
    if total <= block:
        body = b"".join(views)
        store._call("writing", path, lambda: s3("put_object", Bucket=bucket, Key=key,
                                                 Body=body, **store.time_left()))
        return
    upload = store._call("writing", path, lambda: s3(
        "create_multipart_upload", Bucket=bucket, Key=key, **store.time_left()))["UploadId"]
    ids = {"Bucket": bucket, "Key": key, "UploadId": upload}
    try:
        parts = []
        for number, body in enumerate(_parts(views, block), 1):
            answer = store._call(f"writing part {number} of", path, lambda: s3(
                "upload_part", PartNumber=number, Body=body, **ids, **store.time_left()))
            parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        store._call("writing", path, lambda: s3(
            "complete_multipart_upload", MultipartUpload={"Parts": parts}, **ids,
            **store.time_left()))
    except BaseException:
        if not store.unreachable:  # else the store's lifecycle rules (or ckpt gc) do it
            try:
                store._call("aborting the upload of", path, lambda: s3(
                    "abort_multipart_upload", **ids, **store.time_left()))
            except Exception:
                pass
        raise
