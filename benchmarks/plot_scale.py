"""Plot seconds per planning phase against ranks: format 1 (one manifest) and format 2
(rank tables).

Reads the table that ``benchmarks/bench_scale.py`` prints (a file, or standard input) for
format 2's lines; format 1's are figures measured on a quiet machine at commit 189659f
(docs/design.md, "Planning at scale"; 8 and 64 ranks measured, larger worlds extrapolated
linearly in chunks). Writes docs/img/scale.png.

    python benchmarks/bench_scale.py --layouts fsdp > /tmp/scale.md
    python benchmarks/plot_scale.py /tmp/scale.md
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASES = ("plan", "vote", "merge", "serialize", "validate", "load plan")
# Format 1, FSDP, quiet machine (docs/benchmarks.md at 189659f): seconds per phase.
BEFORE = {8: (0.97, 2.1, 2.8, 1.2, 2.4, 0.17), 64: (2.3, 3.0, 4.3, 4.3, 3.8, 0.15)}
BEFORE_CHUNKS = {8: 92_152, 64: 171_712, 512: 1_110_522, 4096: 7_409_136}


def after_rows(text: str, layout: str = "fsdp") -> dict[int, tuple[float, ...]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 11 and cells[0] == layout and cells[1].isdigit():
            rows[int(cells[1])] = tuple(float(c.rstrip("*~")) for c in cells[5:11])
    return rows


def before_rows() -> dict[int, tuple[float, ...]]:
    """Measured at 8 and 64; beyond, linear in chunks from 64 (the load plan bisects)."""
    rows = dict(BEFORE)
    for ranks in (512, 4096):
        f = BEFORE_CHUNKS[ranks] / BEFORE_CHUNKS[64]
        rows[ranks] = tuple(v * f for v in BEFORE[64][:5]) + (BEFORE[64][5],)
    return rows


def main() -> None:
    text = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    after = after_rows(text)
    before = before_rows()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, phase in enumerate(PHASES):
        xs = sorted(before)
        ax.plot(xs, [before[x][i] for x in xs], "--", color=colors[i], alpha=0.6)
        xs = sorted(after)
        ax.plot(xs, [after[x][i] for x in xs], "o-", color=colors[i], label=phase)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (FSDP, 70B decoder + Adam)")
    ax.set_ylabel("seconds")
    ax.set_title("Planning per phase: format 1 (dashed; 512+ extrapolated) vs format 2")
    ax.legend(ncol=2, fontsize=8)
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "docs", "img", "scale.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
