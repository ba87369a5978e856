"""What ``ckpt verify`` found, as objects, and their two renderings: text for a terminal and
JSON for programs. The ``ckpt`` command only parses arguments and prints these; a library
caller gets the same objects from :func:`verify.verify`.

Exit statuses (the command's, also :attr:`Report.exit_code`): 0 every check passed, 1 a check
failed, 2 a check could not run (usage or environment: a missing root or step, no probe
recorded, a model factory that cannot be imported...).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """What was asked cannot be done (exit status 2): the check could not run, which says
    nothing about the checkpoint's health. The message says what to do instead."""


@dataclass
class Problem:
    """One failed check. ``check`` names it (manifest, structure, header, digest, weights,
    output, loss; file: a Lightning ``.ckpt`` against its step); ``file`` is the file it is
    about, when there is one."""

    check: str
    message: str
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.check}: {self.message}"


@dataclass
class StepReport:
    """The outcome of verifying one step at one level.

    ``ok`` is True when every check of the level ran and passed. ``problems`` lists failed
    checks (exit 1); ``error`` says why the level could not run to the end (exit 2) when no
    check failed before. ``checks`` lists the checks that ran, in order; ``forward`` holds
    the forward level's figures (tolerance, differences, loss).
    """

    step: int
    level: str
    ok: bool = False
    problems: list[Problem] = field(default_factory=list)
    error: str | None = None
    checks: list[str] = field(default_factory=list)
    location: str = ""
    tensors: int = 0
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    forward: dict[str, Any] | None = None

    @property
    def exit_code(self) -> int:
        if self.problems:
            return EXIT_FAILED
        return EXIT_USAGE if self.error is not None else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["status"] = ("ok" if self.ok else "failed" if self.problems else "error")
        return doc


@dataclass
class Report:
    """Several steps of one root verified together (``ckpt verify --all``)."""

    root: str
    steps: list[StepReport]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @property
    def exit_code(self) -> int:
        """1 when any check failed, else 2 when any level could not run, else 0."""
        codes = {s.exit_code for s in self.steps}
        return EXIT_FAILED if EXIT_FAILED in codes else max(codes, default=EXIT_OK)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "ok": self.ok, "exit_code": self.exit_code,
                "steps": [s.to_dict() for s in self.steps]}


# -- small text helpers -----------------------------------------------------------------------

def size(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned text table with a rule under the headers."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def count(n: int, noun: str, plural: str | None = None) -> str:
    """A count and its noun, singular for one: ``1 file``, ``0 files``, ``2 aliases``."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def number(x: float | None, digits: int = 3) -> str:
    """A float for a table: ``-`` for None, ``nan``/``inf`` spelled out."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def with_status(doc: dict[str, Any], code: int) -> dict[str, Any]:
    """A command's JSON document with the two keys every one carries, errors included:
    ``ok`` (the status is 0) and ``exit_code`` (the status)."""
    return {"ok": code == EXIT_OK, "exit_code": code, **doc}


def to_json(doc: Any) -> str:
    """Strict JSON (parses anywhere): NaN and infinities become the strings "nan", "inf"."""
    return json.dumps(_jsonable(doc), indent=2, allow_nan=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal.

    Call it with a number of bytes done; call it from one thread (the verifier does).
    """

    def __init__(self, total: int, label: str, stream: Any = None) -> None:
        self.total, self.done, self.label = max(total, 1), 0, label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self._last = 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {size(self.done)}")
            if self.done >= self.total:
                self.stream.write("\n")
            self.stream.flush()


# -- verify -----------------------------------------------------------------------------------

def render_verify(report: Report) -> str:
    """``ckpt verify`` for a terminal: one line per step, then one line per problem."""
    lines = []
    for r in report.steps:
        status = "OK" if r.ok else "FAILED" if r.problems else "NOT VERIFIED"
        lines.append(f"step {r.step}: {status} ({r.level}: {', '.join(r.checks) or 'nothing'} "
                     f"checked; {count(r.tensors, 'tensor')} in {count(r.files, 'file')}, "
                     f"{size(r.bytes)}, "
                     f"{r.seconds:.2f}s)")
        if r.forward:
            lines.append(f"  forward: {_forward_line(r.forward)}")
        lines += [f"  - {p}" for p in r.problems]
        if r.error is not None:
            lines.append(f"  ! {r.error}")
    return "\n".join(lines)


def _forward_line(f: dict[str, Any]) -> str:
    parts = [f"model {f.get('factory')}"]
    if f.get("max_abs_diff") is not None:
        parts.append(f"output {f.get('output_shape')} {f.get('output_dtype')}, max |diff| "
                     f"{number(f['max_abs_diff'])} (rtol {f['rtol']:g}, atol {f['atol']:g})")
    if f.get("loss_recorded") is not None:
        if f.get("loss_now") is not None:
            parts.append(f"loss {number(f['loss_now'], 6)} vs recorded "
                         f"{number(f['loss_recorded'], 6)}")
        else:
            why = f.get("loss_note") or "no loss function: pass --loss module:callable"
            parts.append(f"loss {number(f['loss_recorded'], 6)} recorded, not rechecked ({why})")
    return "; ".join(parts)


# -- diff -------------------------------------------------------------------------------------

def render_diff(d: Any) -> str:
    """``ckpt diff`` for a terminal (``d`` is a :class:`verify.diff.StepDiff`)."""
    lines = [f"{d.root}: step {d.a} -> step {d.b}" if d.other is None else
             f"{d.root} step {d.a} -> {d.other} step {d.b}"]
    if d.filters:
        lines.append(f"only {', '.join(d.filters)}")
    rows = []
    for t in d.tensors:
        if t.status == "equal":
            continue  # counted in the summary line
        shape = _shape(t.shape) if t.old_shape is None or t.old_shape == t.shape else (
            f"{_shape(t.old_shape)} -> {_shape(t.shape)}")
        dtype = t.dtype if t.old_dtype is None or t.old_dtype == t.dtype else (
            f"{t.old_dtype} -> {t.dtype}")
        changed = "-" if t.changed_elements is None else f"{t.changed_elements}/{t.numel}"
        rows.append([t.name or t.key, t.status, shape, dtype, number(t.max_abs_diff),
                     number(t.rel_l2), changed])
    if rows:
        lines.append(table(["TENSOR", "STATUS", "SHAPE", "DTYPE", "MAX|DIFF|", "REL L2",
                            "CHANGED"], rows))
    for a in d.aliases:
        lines.append(f"alias {a['key']}: {a['a']} -> {a['b']}")
    if d.values:
        lines.append("values:")
        lines += [f"  {v.path}: {_short(v.a)} -> {_short(v.b)}" for v in d.values]
    c = d.counts()
    lines.append(f"{count(len(d.tensors), 'tensor')}: {c['equal']} equal, {c['changed']} "
                 f"changed, {c['added']} added, {c['removed']} removed; "
                 f"{count(len(d.values), 'value differs', 'values differ')} "
                 f"({size(d.bytes_read)} read, {d.seconds:.2f}s)")
    return "\n".join(lines)


def _shape(shape: Sequence[int] | None) -> str:
    if shape is None:
        return "-"
    return "x".join(map(str, shape)) or "scalar"


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(_jsonable(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- export -----------------------------------------------------------------------------------

def render_export(e: Any) -> str:
    """``ckpt export`` for a terminal (``e`` is a :class:`verify.export.ExportResult`)."""
    text = (f"wrote {e.path}: step {e.step} as {e.format}, {count(e.tensors, 'tensor')}, "
            f"{size(e.bytes)} in {e.seconds:.2f}s")
    if e.aliases:
        kept = "stored once, recorded in the metadata as ckpt_aliases" if (
            e.format == "safetensors") else "sharing their storage"
        text += f"\n{count(len(e.aliases), 'alias', 'aliases')} ({kept}): " + ", ".join(
            f"{k} -> {v}" for k, v in sorted(e.aliases.items()))
    return text
