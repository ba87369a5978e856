"""The saves retired from the memory tier, recorded in the root so that every rank honours them.

``CheckpointManager.retire`` may run on one rank only (the trainer's rank 0, after a health
rollback). That rank drops the retired steps from its own segment, but the other ranks' shares
and the replicas other nodes hold of them stay in their segments until those ranks save again:
a restart before then would find the retired step whole in memory and resume from it, the
timeline the job undid. So the retiring rank also records each retired *save* in
``<root>/.ckpt-memory-retired.json``, as (step, token): the token every rank's share of one
save carries (the save's ``StepPayload.token``, in each rank document), so a later save of the
same step number, on the new timeline, has another token and is not affected. A restore under
a process group reads the document once (rank 0, one small read of the root), sends it to the
other ranks, and passes over each memory step recorded there, saying why
(``last_restore.skipped``: "retired").

Written atomically: on POSIX a new file renamed over the old one (a link planted at its name
is replaced, never followed), on an object store a plain overwrite (a whole object or none).
Entries for steps below the oldest step the retiring rank held in memory (before this
retire) are pruned when it is written: every rank keeps the same newest ``keep`` steps of one
line of training, so no live segment holds such a step any more; at most :data:`MAX_ENTRIES`
are kept, the newest steps'.

Threat model: the document is input from the root, trusted no more than the root's other
files. It is read through the storage (on POSIX refusing a link or anything but a regular
file: a link there is damage, not an absent record), at most :data:`MAX_BYTES`, and validated
as a whole (its format, each entry an integer step and a short string token); it names steps
and tokens only, never a path, so it cannot make a restore read anything. A document that
fails (damaged, hand-edited, too large, unreadable) cannot say which saves were retired: that
restore takes no step from memory (the root's steps are restored) and a warning names the
file; the next ``retire`` replaces it. It is not signed: whoever can write the root can
already remove or replace its checkpoints (and removing this file lets retired steps in
memory be restored again); what it can do besides is make restores read the root.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Iterable

from storage_backends import Storage
from storage_backends.files import atomic_write
from storage_backends.posix import SymlinkRefusedError

log = logging.getLogger("ckpt")

RETIRED_NAME = ".ckpt-memory-retired.json"
RETIRED_FORMAT = "ckpt-memory-retired/1"
MAX_BYTES = 64 * 1024  # a longer document is damage (MAX_ENTRIES take under 40 KiB)
MAX_ENTRIES = 512
MAX_TOKEN = 64  # characters (a save's token is 12 hex digits)


@dataclasses.dataclass(frozen=True)
class RetiredSaves:
    """What the root says was retired from memory: ``saves``, (step, token) pairs, or, when
    the document failed its checks, ``problem`` (then no memory step is trusted)."""

    saves: frozenset[tuple[int, str]] = frozenset()
    problem: str | None = None

    def why(self, step: int, token: str) -> str | None:
        """Why the save ``token`` of ``step`` in memory is passed over, or None."""
        if self.problem is not None:
            return f"step {step} in memory not restored: {self.problem}"
        if (step, token) in self.saves:
            return (f"step {step} in memory was retired (CheckpointManager.retire; recorded "
                    f"in {RETIRED_NAME} in the root): not restored from memory")
        return None


def read_retired(storage: Storage) -> RetiredSaves:
    """The retired saves recorded in ``storage`` (the root); never raises for what the file
    holds or how it fails to read (see the module docstring)."""
    where = f"{storage.url}/{RETIRED_NAME}"
    try:
        raw = storage.read(RETIRED_NAME, 0, MAX_BYTES + 1)
    except SymlinkRefusedError as e:  # never followed; nor taken for "nothing retired"
        return _unusable(where, f"a symbolic link ({e.strerror})")
    except FileNotFoundError:
        return RetiredSaves()
    except Exception as e:  # a link, a directory, a storage failure: the list is unknown
        return _unusable(where, f"unreadable ({e})")
    try:
        return RetiredSaves(frozenset(parse(raw)))
    except ValueError as e:
        return _unusable(where, str(e))


def _unusable(where: str, why: str) -> RetiredSaves:
    problem = (f"{where} is {why}; it lists the steps retired from the memory tier, so no "
               "step is restored from memory until the next retire() replaces it (or the "
               "file is removed, which lets retired steps in memory be restored again)")
    log.warning("ckpt._memory.retired %s", problem)
    return RetiredSaves(problem=problem)


def parse(raw: bytes) -> list[tuple[int, str]]:
    """The entries of a retired-saves document; ValueError saying what is wrong."""
    if len(raw) > MAX_BYTES:
        raise ValueError(f"longer than {MAX_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != RETIRED_FORMAT:
        raise ValueError(f"not a {RETIRED_FORMAT} document")
    entries = doc.get("retired")
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise ValueError(f"its 'retired' is not a list of at most {MAX_ENTRIES} entries")
    out = []
    for e in entries:
        step = e.get("step") if isinstance(e, dict) else None
        token = e.get("token") if isinstance(e, dict) else None
        if not (type(step) is int and step >= 0 and isinstance(token, str)
                and 0 < len(token) <= MAX_TOKEN):
            raise ValueError(f"an entry is not {{'step': N, 'token': '...'}}: {str(e)[:80]}")
        out.append((step, token))
    return out


def record_retired(storage: Storage, saves: Iterable[tuple[int, str]],
                   oldest_held: int | None) -> None:
    """Add ``saves`` (step, token) to the root's retired-saves document, dropping the entries
    for steps below ``oldest_held`` (the oldest step the caller's segment held before the
    retire; None: it held none, nothing is dropped). A damaged document is replaced, with a
    warning.

    Raises:
        OSError: the storage failed (nothing is recorded).
    """
    current = read_retired(storage)  # (a damaged one has warned already)
    merged = set(current.saves) | set(saves)
    if oldest_held is not None:
        merged = {(s, t) for s, t in merged if s >= oldest_held}
    if merged == set(current.saves) and current.problem is None:
        return  # every rank retiring the same steps: the first one wrote them
    kept = sorted(merged, key=lambda e: (-e[0], e[1]))[:MAX_ENTRIES]  # the newest steps
    data = json.dumps({"format": RETIRED_FORMAT, "retired": [
        {"step": s, "token": t} for s, t in sorted(kept)]}, separators=(",", ":")).encode()
    local = getattr(storage, "local_path", None)
    if callable(local):  # a new file renamed over the old one: never a torn document
        atomic_write(f"{local('')}/{RETIRED_NAME}", data, getattr(storage, "file_mode", 0o644),
                     durable=True, umask=True)  # (as the root's other files are created)
    else:  # an object store: one PUT replaces the whole object
        storage.write(RETIRED_NAME, [data])


def exchange(storage: Storage, pg: Any, is_coordinator: bool) -> RetiredSaves:
    """The retired saves, read by the group's rank 0 (one small read of the root) and sent to
    the other ranks over ``pg``; the same on every rank. Collective."""
    import torch.distributed as dist

    box = [read_retired(storage) if is_coordinator else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]
