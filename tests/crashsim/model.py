"""Crash states of a recorded trace, on an inode model of the file system.

The persistence model (ALICE's, without the guarantees of any one file system):

* a file's data is durable once the file is fsynced; before that, a write may be lost, cut
  short, or reach the disk as zeros (its size grew, its data did not);
* a directory entry (a create, mkdir, rename, unlink, rmdir) is durable once its parent
  directory is fsynced (a rename: both parents); before that either state is possible;
* a crash after the first ``k`` operations keeps every durable one among them, and any
  choice of the others. A prefix with few undecided operations is enumerated completely; a
  larger one in a bounded family (all kept, none kept, each one alone flipped, in-order
  prefixes, data lost while every entry is kept and the reverse).

States with the same content are checked once. The base state (before the trace) is durable.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass, field
from typing import Iterator

ROOT = ("root",)
FULL_LIMIT = 256  # a prefix with at most this many choices is enumerated completely
IGNORED = (".lock",)  # the writer lock's files: not written through the storage module


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent, name


class FS:
    """Directories map names to inodes; files are bytes. Inodes are named by what made them."""

    def __init__(self, base: dict[str, bytes | None]) -> None:
        self.dirs: dict[tuple, dict[str, tuple]] = {ROOT: {}}
        self.files: dict[tuple, bytearray] = {}
        for path in sorted(base, key=lambda p: p.count("/")):
            if path.startswith(IGNORED):
                continue
            parent, name = _split(path)
            ino = ("base", path)
            if base[path] is None:
                self.dirs[ino] = {}
            else:
                self.files[ino] = bytearray(base[path])
            self.dirs[self.lookup(parent)][name] = ino

    def lookup(self, path: str) -> tuple | None:
        ino = ROOT
        for part in filter(None, path.split("/")):
            ino = self.dirs.get(ino, {}).get(part)
            if ino is None:
                return None
        return ino

    def tree(self) -> dict[str, bytes | None]:
        """Every reachable directory (None) and file (bytes), by path."""
        out: dict[str, bytes | None] = {}

        def walk(ino: tuple, prefix: str) -> None:
            for name, child in self.dirs[ino].items():
                path = f"{prefix}{name}"
                if child in self.dirs:
                    out[path] = None
                    walk(child, path + "/")
                else:
                    out[path] = bytes(self.files.get(child, b""))

        walk(ROOT, "")
        return out


@dataclass
class Op:
    """One operation of the trace in inode terms."""

    kind: str            # link, move, unlink, data, sync_data, sync_dir
    ino: tuple | None
    parents: tuple = ()  # the directories whose entries it changes
    args: tuple = ()
    durable_at: float = float("inf")  # index of the fsync that makes it durable

    @property
    def choices(self) -> tuple[str, ...]:
        if self.kind in ("link", "move", "unlink"):
            return ("on", "off")
        if self.kind == "data":
            data = self.args[1]
            out = ["full", "off"]
            if len(data) > 1:
                out.append("half")
            if any(data):
                out.append("zero")
            return tuple(out)
        return ()


@dataclass
class Analysis:
    """A trace, resolved to inodes against the base state, with each op's durability."""

    base: dict[str, bytes | None]
    ops: list[Op] = field(default_factory=list)
    final: dict[str, bytes | None] = field(default_factory=dict)  # the state after it all


def analyse(base: dict[str, bytes | None], trace: list[tuple]) -> Analysis:
    """Replay ``trace`` in full on ``base`` to learn which inode each path meant."""
    fs = FS(base)
    out = Analysis(base)
    for i, op in enumerate(trace):
        kind = op[0]
        if kind in ("mkdir", "creat"):
            parent, name = _split(op[1])
            p = fs.lookup(parent)
            ino = ("dir", i) if kind == "mkdir" else ("file", op[2])
            if kind == "mkdir":
                fs.dirs[ino] = {}
            else:
                fs.files[ino] = bytearray()
            fs.dirs[p][name] = ino
            out.ops.append(Op("link", ino, (p,), (name,)))
        elif kind == "write":
            ino = ("file", op[1])
            _write(fs.files[ino], op[2], op[3])
            out.ops.append(Op("data", ino, (), (op[2], op[3])))
        elif kind == "fsync_file":
            out.ops.append(Op("sync_data", ("file", op[1])))
        elif kind == "fsync_dir":
            out.ops.append(Op("sync_dir", fs.lookup(op[1])))
        elif kind == "rename":
            (sp, sn), (dp, dn) = _split(op[1]), _split(op[2])
            s, d = fs.lookup(sp), fs.lookup(dp)
            ino = fs.dirs[s].pop(sn)
            fs.dirs[d][dn] = ino
            out.ops.append(Op("move", ino, tuple(dict.fromkeys((s, d))), (sn, dn)))
        elif kind in ("unlink", "rmdir"):
            parent, name = _split(op[1])
            p = fs.lookup(parent)
            ino = fs.dirs[p].pop(name)
            out.ops.append(Op("unlink", ino, (p,), (name,)))
        else:
            raise AssertionError(f"unknown operation {op!r}")
    for i, op in enumerate(out.ops):
        if op.kind == "data":
            op.durable_at = _first_sync(out.ops, i, "sync_data", op.ino)
        elif op.parents:
            op.durable_at = max(_first_sync(out.ops, i, "sync_dir", p) for p in op.parents)
    out.final = fs.tree()
    return out


def _first_sync(ops: list[Op], after: int, kind: str, ino: tuple) -> float:
    return next((j for j in range(after + 1, len(ops))
                 if ops[j].kind == kind and ops[j].ino == ino), float("inf"))


def _write(buf: bytearray, offset: int, data: bytes) -> None:
    if len(buf) < offset:
        buf.extend(bytes(offset - len(buf)))
    buf[offset:offset + len(data)] = data


def replay(a: Analysis, k: int, choice: dict[int, str]) -> dict[str, bytes | None]:
    """The state after a crash once ``k`` ops were issued; ``choice``: the undecided ones."""
    fs = FS(a.base)
    for op in a.ops[:k]:
        if op.kind == "link" and op.ino[0] == "dir":
            fs.dirs.setdefault(op.ino, {})
        elif op.kind in ("link", "data"):
            fs.files.setdefault(op.ino, bytearray())
    for i, op in enumerate(a.ops[:k]):
        how = choice.get(i, "on" if op.kind != "data" else "full")
        if how == "off":
            continue
        if op.kind == "link":
            fs.dirs[op.parents[0]][op.args[0]] = op.ino
        elif op.kind == "move":
            s, d = op.parents[0], op.parents[-1]
            if fs.dirs[s].get(op.args[0]) == op.ino:
                del fs.dirs[s][op.args[0]]
            fs.dirs[d][op.args[1]] = op.ino
        elif op.kind == "unlink":
            if fs.dirs[op.parents[0]].get(op.args[0]) == op.ino:
                del fs.dirs[op.parents[0]][op.args[0]]
        elif op.kind == "data":
            offset, data = op.args
            if how == "half":
                data = data[:len(data) // 2]
            elif how == "zero":
                data = bytes(len(data))
            _write(fs.files[op.ino], offset, data)
    return fs.tree()


def _family(undecided: list[int], choices: list[tuple[str, ...]]) -> Iterator[dict[int, str]]:
    """Choices for the undecided ops of one prefix: all of them, or a bounded family."""
    total = 1
    for c in choices:
        total *= len(c)
    if total <= FULL_LIMIT:
        for combo in itertools.product(*choices):
            yield dict(zip(undecided, combo))
        return
    on = {i: c[0] for i, c in zip(undecided, choices)}
    off = {i: "off" for i in undecided}
    yield on
    yield off
    for i, c in zip(undecided, choices):
        for alt in c[1:]:
            yield {**on, i: alt}
        yield {**off, i: c[0]}
    for j in range(1, len(undecided)):  # persisted in order, up to j
        yield {**on, **{i: "off" for i in undecided[j:]}}
    data = [i for i, c in zip(undecided, choices) if c[0] == "full"]
    yield {**on, **{i: "off" for i in data}}
    yield {**off, **{i: "full" for i in data}}


@dataclass
class CrashState:
    prefix: int          # ops issued before the crash
    tree: dict[str, bytes | None]
    after_return: bool   # the whole trace ran: the operation had returned


def states_at(a: Analysis, k: int) -> Iterator[dict[str, bytes | None]]:
    """The crash states once ``k`` ops were issued (repeats included)."""
    undecided = [i for i in range(k) if a.ops[i].choices and a.ops[i].durable_at >= k]
    for choice in _family(undecided, [a.ops[i].choices for i in undecided]):
        yield replay(a, k, choice)


def crash_states(a: Analysis) -> tuple[list[CrashState], int]:
    """Distinct crash states of every prefix, and how many were enumerated (with repeats)."""
    seen: set[bytes] = set()
    states, enumerated = [], 0
    n = len(a.ops)
    for k in range(n + 1):
        for tree in states_at(a, k):
            enumerated += 1
            key = fingerprint(tree)
            if key in seen and k < n:
                continue
            if key in seen:
                # the same content once the operation returned: stricter checks, keep it
                key += b"/returned"
                if key in seen:
                    continue
            seen.add(key)
            states.append(CrashState(k, tree, k == n))
    return states, enumerated


HIDDEN = (".tmp-", ".trash-")  # storage_backends.posix's staging and trash directories


def visible(tree: dict[str, bytes | None]) -> dict[str, bytes | None]:
    """``tree`` as readers and a writer's cleanup see it: they never look inside staging or
    trash directories (cleanup removes them whole), so only those directories' names count."""
    out = {}
    for path, data in tree.items():
        top, sep, _ = path.partition("/")
        if top.startswith(HIDDEN):
            out[top] = out.get(top) if sep else data
        else:
            out[path] = data
    return out


def fingerprint(tree: dict[str, bytes | None]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(tree):
        data = tree[path]
        h.update(path.encode() + (b"/" if data is None else b":%d:" % len(data) + data) + b"\0")
    return h.digest()


def materialize(tree: dict[str, bytes | None], where: str) -> None:
    """Write ``tree`` as a real directory at ``where``."""
    os.makedirs(where)
    for path in sorted(tree, key=lambda p: p.count("/")):
        full = os.path.join(where, path)
        if tree[path] is None:
            os.mkdir(full)
        else:
            with open(full, "wb") as f:
                f.write(tree[path])
