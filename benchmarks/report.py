"""Run the benchmark scripts and write docs/benchmarks.md with their tables and PNG plots.

Each script prints markdown tables; this keeps each script's output verbatim (saved under
bench-out/results/ so ``--reuse`` re-renders without re-running), parses the tables it
plots, and draws with matplotlib (a benchmark-only dependency, the ``bench`` extra):

* blocking time vs state size: ckpt ``save()`` (async), DCP ``async_save`` and the copy
  floor from bench_async, beside ``torch.save`` (which blocks for the whole save) from
  bench_save_load;
* bytes written per save, full vs incremental, from bench_incremental;
* the recovery timeline of the elastic kill test, from bench_elastic.

Only committed code is measured: it refuses to run while ckpt/, storage_backends/,
benchmarks/, trainer/ or verify/ differ from the last commit, every section's and table's
heading names the commit it ran on (and says so when it was a quick run), and paths of the
machine it ran on (the repository, temporary directories, home) are replaced by
placeholders. ``--only`` re-runs some scripts: the other sections are kept as the document
has them, each still naming its own commit. ``--reuse`` re-renders every saved result.

Run from the repository root::

    python benchmarks/report.py [--quick] [--reuse] [--only async,incremental]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

RESULTS = os.path.join(common.REPO_ROOT, "bench-out", "results")
DOC = os.path.join(common.REPO_ROOT, "docs", "benchmarks.md")
IMG = os.path.join(common.REPO_ROOT, "docs", "img")

# name -> (script, arguments for a full run, arguments for --quick)
SCRIPTS = {
    "save_load": ("bench_save_load.py", ["--reps", "3"], ["--sizes", "256M", "--reps", "2"]),
    "async": ("bench_async.py", ["--reps", "4"], ["--sizes", "256M", "--shapes", "many",
                                                   "--reps", "2"]),
    "sharded": ("bench_sharded.py", ["--sizes", "256M", "--reps", "3"],
                ["--sizes", "128M", "--reps", "1"]),
    "incremental": ("bench_incremental.py", ["--reps", "3"], ["--reps", "1"]),
    "storage": ("bench_storage.py", [], ["--reps", "1"]),
    "verify": ("bench_verify.py", [], []),
    "forward_gate": ("bench_forward_gate.py", [], ["--reps", "3", "--only", "demo"]),
    "elastic": ("bench_elastic.py", [], []),
    "compression": ("bench_compression.py", ["--sizes", "256M", "--reps", "3"],
                    ["--sizes", "64M", "--reps", "1", "--rates", "0.5"]),
    "cuda": ("bench_cuda.py", ["--sizes", "1G,2G", "--reps", "3"], ["--sizes", "256M", "--reps", "1"]),
    "integrations": ("bench_integrations.py", ["--reps", "2"],
                     ["--reps", "1", "--layers", "2", "--width", "128"]),
    "scale": ("bench_scale.py", [], ["--ranks", "8,64", "--layouts", "fsdp,hsdp"]),
    "memory_tier": ("bench_memory_tier.py", [], ["--quick"]),
    "load_fixed": ("bench_load_fixed.py", [], ["--counts", "1000", "--reps", "3"]),
    "peers": ("bench_peers.py", ["--reps", "5"], ["--sizes", "256M", "--reps", "2",
                                                   "--ckpt-variants", ""]),
    "hang": ("bench_hang.py", [], ["--no-torchrun"]),
    "live": ("bench_live.py", [], ["--trials", "1"]),
    "restore": ("bench_restore.py", ["--reps", "5"], ["--sizes", "64M", "--reps", "2"]),
}
TITLES = {
    "save_load": "Save and load",
    "async": "Asynchronous save: blocking time, memory, step slowdown",
    "sharded": "Sharded save and load, resharding",
    "incremental": "Incremental saves and compression",
    "storage": "Storage backends: S3 (moto) against DCP, tensorstore against POSIX",
    "verify": "Verification: ckpt verify",
    "forward_gate": "Verified resume: restore verify=\"forward\" against \"digest\"",
    "elastic": "Elastic recovery",
    "compression": "Compression: zstd levels, threads, throttled storage",
    "cuda": "GPU: overlapped save, restore onto the device, against DCP",
    "integrations": "Lightning, HF Trainer, Accelerate: blocking per checkpoint and bytes",
    "scale": "Planning at scale: 8 to 4,096 simulated ranks",
    "memory_tier": "Memory tier and warm restarts: restore by tier, recovery",
    "load_fixed": "The fixed cost of a load: thousands of small tensors",
    "peers": "Asynchronous save against the peers: torch_checkpointing, DCP, torch.save",
    "hang": "Hung ranks: the progress markers' cost and the time to name a stuck rank",
    "live": "Live recovery: a lost replica group, live (torchft) against restart",
    "restore": "Restore under a process group (replicated bytes read once) and the cold load",
}
COMMIT_TAG = "<!-- measured at commit {} -->"
QUICK_TAG = "<!-- quick run -->"  # the line after COMMIT_TAG in a --quick result
# How to read the tables; the same for every run, so written here rather than measured.
READING = [
    "How to read them: methods run interleaved (A B C A B C ...) and the tables give medians",
    "with min..max over the repetitions. Before each timed case a script waits until other",
    "processes leave the CPUs idle and says how many cases still started while the machine",
    "was busy. Run as root, the scripts drop the page cache before every save and load, so",
    "loads are cold. The anchors: **raw** writes every tensor's bytes into one file",
    "(`os.write`, then `os.fsync`; loads: `os.preadv` into preallocated tensors); **raw, 2",
    "files** does the same with two files on two threads, as many as ckpt uses; **raw, read",
    "twice** reads the file cold and again from the page cache, the floor of a load that",
    "verifies every byte before it changes the first live one; the **copy floor** copies every",
    "tensor into preallocated host buffers, the least an asynchronous save can block for.",
    "**CPU s** is user + system time of all the process's threads. docs/design.md gives the",
    "decisions these figures support; each script's `--help` lists its options.",
    "",
]


def run(name: str, quick: bool) -> str:
    script, full, short = SCRIPTS[name]
    cmd = [sys.executable, os.path.join(common.REPO_ROOT, "benchmarks", script)]
    cmd += short if quick else full
    print(f"running {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    out = subprocess.run(cmd, cwd=common.REPO_ROOT, capture_output=True, text=True)
    text = out.stdout
    if out.returncode != 0:
        text += f"\n\n(exited {out.returncode}; stderr tail)\n\n```\n{out.stderr[-3000:]}\n```\n"
    os.makedirs(RESULTS, exist_ok=True)
    tagged = COMMIT_TAG.format(common.code_version()) + "\n" + (
        QUICK_TAG + "\n" if quick else "") + text
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(tagged)
    print(f"  {name}: {time.time() - t0:.0f} s", file=sys.stderr)
    return tagged  # the same text --reuse reads back (its first line is the tag)


def scrub(text: str) -> str:
    """Replace this machine's paths (repository, temporary directories, home) by placeholders."""
    for path, name in ((common.REPO_ROOT, "<repo>"), (tempfile.gettempdir(), "<tmp>"),
                       (os.path.expanduser("~"), "<home>")):
        if path and path != "/":
            text = text.replace(path, name)
    return text


def tag_tables(text: str, commit: str) -> str:
    """Every table heading names the commit it ran on."""
    return re.sub(r"^(###? .*)$", lambda m: f"{m.group(1)} (commit {commit})", text, flags=re.M)


def recorded_commit(text: str) -> str | None:
    m = re.match(re.escape(COMMIT_TAG).replace(r"\{\}", "(.*)"), text)
    return m.group(1) if m else None


def section(name: str, result: str) -> str:
    """The document's section for a saved result (its tag lines first): a heading naming
    the commit it ran on, and whether it was a quick run, then the script's output."""
    commit = recorded_commit(result)
    body = result.split("\n", 1)[1] if commit else result
    commit = commit or "unknown"
    quick = body.startswith(QUICK_TAG + "\n")
    if quick:
        body = body[len(QUICK_TAG) + 1:]
    note = ", quick run" if quick else ""
    return f"## {TITLES[name]} (commit {commit}{note})\n\n" + scrub(
        tag_tables(body, commit)).strip() + "\n"


def kept_sections(doc: str) -> dict[str, str]:
    """The sections of an existing document, by script name: each from its heading (a
    title of :data:`TITLES` followed by its commit) up to the next such heading. Script
    output has headings of its own, so only these titles split the document."""
    starts = []
    for m in re.finditer(r"^## (.+) \(commit [^\n]*\)$", doc, flags=re.M):
        name = next((n for n, t in TITLES.items() if t == m.group(1)), None)
        if name is not None:
            starts.append((m.start(), name))
    ends = [s for s, _ in starts[1:]] + [len(doc)]
    return {name: doc[start:end].strip() + "\n" for (start, name), end in zip(starts, ends)}


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(nearest heading above, header cells, rows) of every markdown table in ``text``."""
    found, heading, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| ]+\|$",
                                                                   lines[i + 1]):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            found.append((heading, header, rows))
            continue
        i += 1
    return found


def _mib(heading: str) -> float | None:
    m = re.search(r"([\d.]+) (MiB|GiB)", heading)
    return float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1) if m else None


def plot_blocking(async_text: str, save_text: str) -> str | None:
    """Blocking ms vs state size, log-log, one line per method."""
    import matplotlib.pyplot as plt

    series: dict[str, dict[float, float]] = {}
    for heading, header, rows in tables(async_text):
        if not heading.startswith("Blocking time") or "steady median ms" not in header:
            continue
        size, col = _mib(heading), header.index("steady median ms")
        for r in rows:
            series.setdefault(r[0], {})[size] = float(r[col])
    for heading, header, rows in tables(save_text):
        if heading.startswith("Save:") and "median s" in header:
            for r in rows:
                if r[0].startswith("torch.save"):
                    series.setdefault("torch.save (sync: blocks throughout)", {})[
                        _mib(heading)] = float(r[header.index("median s")]) * 1e3
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in sorted(series.items()):
        xs = sorted(k for k in points if k)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="state size (MiB)",
           ylabel="time save() blocks training (ms)", title="Blocking time vs state size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, "blocking.png")


def plot_incremental(text: str) -> str | None:
    import matplotlib.pyplot as plt

    for heading, header, rows in tables(text):
        if heading.startswith("Incremental") and "MiB written" in header:
            col = header.index("MiB written")
            labels = sorted({r[0] for r in rows}, key=lambda s: float(s.rstrip("%")))
            full = [float(next(r[col] for r in rows if r[0] == u and r[1] == "full"))
                    for u in labels]
            inc = [float(next(r[col] for r in rows if r[0] == u and r[1] == "incremental"))
                   for u in labels]
            fig, ax = plt.subplots(figsize=(6, 3.8))
            xs = range(len(labels))
            ax.bar([x - 0.2 for x in xs], full, 0.4, label="full save")
            ax.bar([x + 0.2 for x in xs], inc, 0.4, label="incremental save")
            ax.set_xticks(list(xs), [f"{u} unchanged" for u in labels])
            ax.set(ylabel="MiB written per save", title=heading, ylim=(0, max(full) * 1.3))
            ax.legend(loc="upper center", ncol=2, fontsize=8)
            return _save(fig, "incremental.png")
    return None


def plot_recovery(text: str) -> str | None:
    import matplotlib.pyplot as plt

    events = []
    capture = False
    for line in text.splitlines():
        if line.startswith("recovery timeline"):
            capture = True
            continue
        if capture:
            m = re.match(r"^\s+(.+?)\s{2,}([\d.]+)", line)
            if not m:
                break
            events.append((m.group(1), float(m.group(2))))
    if not events:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [e[0] for e in events][::-1]
    ax.barh(names, [e[1] for e in events][::-1])
    ax.set(xlabel="seconds after the node was killed", title="Elastic recovery timeline")
    ax.tick_params(axis="y", labelsize=8)
    return _save(fig, "recovery.png")


def _save(fig, name: str) -> str:
    import matplotlib.pyplot as plt

    os.makedirs(IMG, exist_ok=True)
    fig.tight_layout()
    fig.savefig(os.path.join(IMG, name), dpi=110)
    plt.close(fig)
    return f"img/{name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--reuse", action="store_true",
                        help="re-render from bench-out/results/ without running")
    parser.add_argument("--only", default="",
                        help=f"comma-separated subset of scripts to run, among {', '.join(SCRIPTS)}"
                             " (the other sections stay as the document has them)")
    args = parser.parse_args()
    only = [n for n in args.only.split(",") if n] or list(SCRIPTS)
    unknown = [n for n in only if n not in SCRIPTS]
    if unknown:
        sys.exit(f"report.py: no benchmark named {', '.join(unknown)}; --only takes names "
                 f"among {', '.join(SCRIPTS)}")
    commit = common.code_version()
    if not args.reuse and ("+" in commit or commit.startswith("unknown")):
        sys.exit(f"report.py measures committed code only: commit first ({commit})")
    kept = {}
    if os.path.exists(DOC):
        with open(DOC) as f:
            kept = kept_sections(f.read())
    sections, ran = {}, []
    for name in SCRIPTS:
        saved = os.path.join(RESULTS, f"{name}.md")
        if name in only and not args.reuse:
            sections[name] = section(name, run(name, args.quick))
            ran.append(name)
        elif args.reuse and os.path.exists(saved):
            with open(saved) as f:
                sections[name] = section(name, f.read())
            ran.append(name)
        elif name in kept:
            sections[name] = kept[name]
    import matplotlib  # after the arguments are checked: a mistyped name needs no plotting

    matplotlib.use("Agg")
    plots = [p for p in (
        plot_blocking(sections.get("async", ""), sections.get("save_load", "")),
        plot_incremental(sections.get("incremental", "")),
        plot_recovery(sections.get("elastic", ""))) if p]
    what = ("every script" if len(ran) == len(SCRIPTS) else
            f"{', '.join(ran)} (the other sections are kept from earlier runs)")
    if args.reuse:
        last = "Last re-rendered from the saved results of earlier runs."
    else:
        how = ("a quick run (`--quick`: fewer sizes and repetitions, so wider spreads)"
               if args.quick else "a full run")
        last = f"Last run at commit {commit}, {how}, for {what}."
    parts = ["# Benchmarks", "",
             "Written by `python benchmarks/report.py`, which runs every `benchmarks/bench_*.py`.",
             last,
             "Each section's and each table's heading names the commit it ran on, and a",
             "section from a quick run says so.",
             f"Machine: {common.machine_description()}. Disk and CPUs are shared and noisy:",
             "compare ratios measured side by side in one run, not numbers across sections.", ""]
    parts += READING
    parts += [f"![{p}]({p})" for p in plots] + [""]
    parts += [sections[name] for name in SCRIPTS if name in sections]
    with open(DOC, "w") as f:
        f.write("\n".join(parts))
    print(f"wrote {DOC} with {len(plots)} plots", file=sys.stderr)


if __name__ == "__main__":
    main()
