"""Draws the wings of the code base from its imports, into docs/design.md.

Every module is folded into its wing (``ckpt._save``, ``ckpt._load``, ..., the public face
``ckpt`` for the modules at the top of the package, and one node per other top-level
package); an arrow ``A --> B`` with a count says that many imports of A's modules name B's.
The picture is a Mermaid flowchart (rendered by GitHub and most Markdown viewers), written
between the ``<!-- wings:begin -->`` and ``<!-- wings:end -->`` markers of docs/design.md.

Run from the repository root::

    python docs/wings.py          # rewrite the picture in docs/design.md
    python docs/wings.py --check  # exit 1 if the picture is not the one the imports draw

The imports are read by grimp, the import-graph library behind import-linter (whose contracts
in setup.cfg are what enforces the layering; this script only draws it).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import grimp

PACKAGES = ("trainer", "verify", "ckpt", "storage_backends")
BEGIN, END = "<!-- wings:begin -->", "<!-- wings:end -->"
DESIGN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "design.md")


# Modules at the top of ckpt drawn as nodes of their own: the errors and option types every
# wing uses, and the `python -m ckpt` shim; the other top modules are the public face.
OWN_NODES = ("ckpt.errors", "ckpt.options", "ckpt.__main__")


def wing_of(module: str) -> str:
    """The node a module is drawn in: its ckpt wing, the public face, or its package."""
    parts = module.split(".")
    if parts[0] == "ckpt":
        top = ".".join(parts[:2])
        if top in OWN_NODES or (len(parts) > 1 and parts[1].startswith("_")):
            return top
        return "ckpt (public face)"
    return parts[0]


def arrows(graph: grimp.ImportGraph) -> dict[tuple[str, str], int]:
    """(importing wing, imported wing) -> how many module-to-module imports cross it."""
    counts: collections.Counter = collections.Counter()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = wing_of(importer), wing_of(imported)
            if a != b:
                counts[(a, b)] += 1
    return dict(counts)


def mermaid(counts: dict[tuple[str, str], int]) -> str:
    """The flowchart, nodes and arrows in a stable order so the output is reproducible."""
    nodes = sorted({n for pair in counts for n in pair})
    ident = {n: "".join(c if c.isalnum() else "_" for c in n) for n in nodes}
    lines = ["```mermaid", "flowchart TD"]
    for n in nodes:
        lines.append(f'    {ident[n]}["{n}"]')
    for (a, b), n in sorted(counts.items()):
        lines.append(f"    {ident[a]} -->|{n}| {ident[b]}")
    lines.append("```")
    return "\n".join(lines)


def render(design_text: str) -> str:
    """design.md with the picture between the markers drawn anew."""
    if BEGIN not in design_text or END not in design_text:
        raise SystemExit(f"{DESIGN} has no {BEGIN} ... {END} markers to draw between")
    head, rest = design_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    graph = grimp.build_graph(*PACKAGES)
    picture = mermaid(arrows(graph))
    return f"{head}{BEGIN}\n{picture}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/design.md's picture differs from the imports")
    args = parser.parse_args(argv)
    with open(DESIGN, encoding="utf-8") as f:
        current = f.read()
    drawn = render(current)
    if args.check:
        if drawn != current:
            print("docs/design.md's wings picture is out of date: run python docs/wings.py",
                  file=sys.stderr)
            return 1
        return 0
    if drawn != current:
        with open(DESIGN, "w", encoding="utf-8") as f:
            f.write(drawn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
