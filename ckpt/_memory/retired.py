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

The caller's node may not hold every retired save: its memory was lost (a replaced node)
and the job restored from the replicas other nodes hold. The token of such a save is then
taken from what the manager saw or from the root: the saves its last restore found in
the live nodes' memory (the group agrees on each whole save's token before it
restores); then, for a step still without one among the root's newest steps (only those can
still be in memory), the root's manifest (:func:`root_saves`: a save's token is in the names
of the files it wrote, and its memory copies carry the same token). A retired step that none
of them knows (a memory-only step held on other nodes only, retired by a manager that has
not restored) is not recorded, and a warning names it and says what to do. No entry by time
("saved before the retire") is written for it: a holding's ``created`` is stamped by the
clock of the node that saved it, the retire's time by the caller's, so any margin for clock
skew either passes over the new line's save of the same step number made just after a
rollback (the next step the job saves) or misses the retired one made just before it.

Written atomically: on POSIX a new file renamed over the old one (a link planted at its name
is replaced, never followed), on an object store a plain overwrite (a whole object or none).
Earlier entries for steps below the oldest step the retiring rank's node held in memory
(before this retire) are pruned when it is written: every rank keeps the same newest
``keep`` steps of one line of training, so no live segment holds such a step any more; the
entries being added are always kept (a node that lost its memory holds fewer steps than the
others); at most :data:`MAX_ENTRIES` are kept, the newest steps'.

Threat model: the document is input from the root, trusted no more than the root's other
files. It is read through the storage (on POSIX refusing a link or anything but a regular
file: a link there is damage, not an absent record), at most :data:`MAX_BYTES`, and validated
as a whole (its format, each entry an integer step and a short string token); it names steps
and tokens only, never a path, so it cannot make a restore read anything. A document that
fails (damaged, hand-edited, too large, unreadable) cannot say which saves were retired: that
restore takes no step from memory (the root's steps are restored) and a warning names the
file; the next ``retire`` replaces it. It is not signed: whoever can write the root can
already remove or replace its checkpoints (and removing this file lets retired steps in
memory be restored again); what it can do besides is make restores read the root. The
tokens read from a step's manifest in the root (:func:`root_saves`, validated as a restore
validates it, each name matched exactly) are trusted as that: they only add entries for the
steps being retired, whose every save is passed over anyway.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any, Iterable

from storage_backends import Storage
from storage_backends.files import atomic_write
from storage_backends.posix import SymlinkRefusedError

from ckpt._format.names import step_dir
from ckpt._format.ranktable import table_name
from ckpt._save.chunking import data_file_name
from ckpt._step.integrity import read_manifest
from ckpt.errors import CheckpointError, CheckpointNotFoundError

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
    """Add ``saves`` (step, token) to the root's retired-saves document, dropping the earlier
    entries for steps below ``oldest_held`` (the oldest step the caller's node held before
    the retire; None: it held none, nothing is dropped). A damaged document is replaced, with a
    warning.

    Raises:
        OSError: the storage failed (nothing is recorded).
    """
    current = read_retired(storage)  # (a damaged one has warned already)
    merged = set(current.saves)
    if oldest_held is not None:
        merged = {(s, t) for s, t in merged if s >= oldest_held}
    merged |= set(saves)
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


# The files a save writes carry its token: data-<rank mod 256>-<token>-r<rank>-<index>
# (ckpt/_save/chunking.py) and, format 2, table-<rank mod 256>-<token>-r<rank> (ranktable.py).
_SAVE_FILE = re.compile(r"(data|table)-[0-9a-f]{2}-([0-9a-f]{1,%d})-r([0-9]{5,9})"
                        r"(?:-([0-9]{3,9}))?\.(?:safetensors|ckt)" % MAX_TOKEN)


def root_saves(storage: Storage, steps: Iterable[int]) -> set[tuple[int, str]]:
    """The saves (step, token) of ``steps`` committed in ``storage`` (the root), read from
    each step's manifest (validated; a format-2 manifest's rank tables are not read): the
    token in the names of the files the save wrote. A step the root does not hold is left
    out; one whose manifest cannot be read, or names no file of its save (a format-1 step
    that wrote no data file), too, with a warning for the first."""
    out: set[tuple[int, str]] = set()
    for step in steps:
        try:
            manifest = read_manifest(storage, step_dir(step), step)
        except CheckpointNotFoundError:
            continue
        except (CheckpointError, OSError) as e:
            log.warning("ckpt._memory.retired cannot read step %d's save token from the root: "
                        "%s", step, e)
            continue
        names = [t[0] for t in manifest.tables] + list(manifest.files)
        out |= {(step, t) for t in map(_token_of, names) if t is not None}
    return out


def _token_of(name: str) -> str | None:
    """The save token in a data or table file's name; None for any other name (the name
    must be exactly what the save's naming function makes of it)."""
    m = _SAVE_FILE.fullmatch(name)
    if m is None:
        return None
    kind, token, rank, index = m.groups()
    if kind == "table":
        made = table_name(token, int(rank)) if index is None else None
    else:
        made = None if index is None else data_file_name(token, int(rank), int(index))
    return token if made == name else None


def exchange(storage: Storage, pg: Any, is_coordinator: bool) -> RetiredSaves:
    """The retired saves, read by the group's rank 0 (one small read of the root) and sent to
    the other ranks over ``pg``; the same on every rank. Collective."""
    import torch.distributed as dist

    box = [read_retired(storage) if is_coordinator else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    return box[0]
