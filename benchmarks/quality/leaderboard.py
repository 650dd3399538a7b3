#!/usr/bin/env python3
"""The quality benchmark's summary as Markdown tables, in the form of kvpress's leaderboard.

    python benchmarks/quality/leaderboard.py SUMMARY.csv [--ratios 0.25,0.5,0.75,0.9]

SUMMARY.csv is what `kvpress-cli bench --csv` writes (accuracy and mean kept fraction per press,
ratio, task and length). Prints, for docs/QUALITY.md:
1. the model uncompressed: accuracy per task and context length (what it can do at all);
2. the leaderboard: per press, the mean accuracy over every task and length at each ratio (every
   (task, length) cell weighs alike, as the chart of `kvpress-cli bench --png` averages them), the
   uncompressed mean beside it, presses ordered by their mean over the ratios they all share;
3. the same mean per context length, at each ratio;
4. the presses without a ratio (e.g. DuoAttentionPress at a head ratio): accuracy and kept fraction.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict


def read(path):
    cells = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            cells.append({
                "press": row["press"],
                "ratio": float(row["ratio"]) if row["ratio"] else None,
                "task": row["task"],
                "length": int(row["length"]),
                "examples": int(row["examples"]),
                "accuracy": float(row["accuracy"]),
                "kept": float(row["kept_fraction"]),
            })
    if not cells:
        sys.exit(f"leaderboard: {path} has no rows")
    return cells


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def number(x, digits=1):
    return "–" if x != x else f"{x:.{digits}f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", help="kvpress-cli bench --csv output")
    parser.add_argument("--ratios", help="ratio columns (default: every ratio in the file)")
    args = parser.parse_args(argv)
    cells = read(args.summary)
    tasks = sorted({c["task"] for c in cells})
    lengths = sorted({c["length"] for c in cells})
    ratios = (sorted(float(r) for r in args.ratios.split(",")) if args.ratios else
              sorted({c["ratio"] for c in cells if c["ratio"] is not None}))
    examples = sorted({c["examples"] for c in cells})

    by = defaultdict(dict)  # (press, ratio) -> {(task, length): cell}
    for c in cells:
        by[(c["press"], c["ratio"])][(c["task"], c["length"])] = c
    grid = [(t, n) for t in tasks for n in lengths]
    # The leaderboard's mean needs every (task, length) cell; a press with a partial grid is marked.
    complete = {key for key, per in by.items() if all(g in per for g in grid)}

    print(f"{len(tasks)} tasks x {len(lengths)} lengths ({', '.join(map(str, lengths))} tokens), "
          f"{'/'.join(map(str, examples))} examples per cell\n")

    base = by.get(("none", None), {})
    if base:
        print("### The model uncompressed\n")
        rows = []
        for t in tasks:
            rows.append([t] + [number(base[(t, n)]["accuracy"]) if (t, n) in base else "–" for n in lengths]
                        + [number(mean(base[(t, n)]["accuracy"] for n in lengths if (t, n) in base))])
        rows.append(["**mean**"] + [f"**{number(mean(base[(t, n)]['accuracy'] for t in tasks if (t, n) in base))}**"
                                    for n in lengths] + [f"**{number(mean(c['accuracy'] for c in base.values()))}**"])
        print(table(["task"] + [f"{n} tokens" for n in lengths] + ["mean"], rows) + "\n")

    presses = sorted({p for p, r in by if r is not None})
    shared = [r for r in ratios if all((p, r) in by for p in presses)]

    def press_mean(p, r, length=None):
        per = by.get((p, r))
        if not per:
            return float("nan")
        return mean(c["accuracy"] for (t, n), c in per.items() if length is None or n == length)

    order = sorted(presses, key=lambda p: -mean(press_mean(p, r) for r in shared))
    baseline = mean(c["accuracy"] for c in base.values()) if base else float("nan")
    print("### Mean accuracy over every task and length (leaderboard)\n")
    rows = []
    for p in order:
        marks = ["" if (p, r) in complete or (p, r) not in by else "*" for r in ratios]
        rows.append([p] + [number(press_mean(p, r)) + m for r, m in zip(ratios, marks)]
                    + [number(mean(press_mean(p, r) for r in shared))])
    print(table(["press"] + [f"{r:g}" for r in ratios] + [f"mean over {'/'.join(f'{r:g}' for r in shared)}"], rows))
    print(f"\nNo compression: {number(baseline)}. `–`: not run at that ratio; `*`: some cells missing.\n")

    print("### Mean accuracy per context length\n")
    rows = []
    for p in order:
        rows.append([p] + [number(press_mean(p, r, n)) for n in lengths for r in ratios])
    rows.insert(0, ["none"] + [number(mean(base[(t, n)]["accuracy"] for t in tasks if (t, n) in base))
                               for n in lengths for _ in ratios])
    print(table(["press"] + [f"{n}: {r:g}" for n in lengths for r in ratios], rows) + "\n")

    fixed = sorted({p for p, r in by if r is None and p != "none"})
    if fixed:
        print("### Presses without a compression ratio\n")
        rows = [[p, number(mean(c["accuracy"] for c in by[(p, None)].values())),
                 number(mean(c["kept"] for c in by[(p, None)].values()), 2)] for p in fixed]
        print(table(["press", "mean accuracy", "kept (mean)"], rows) + "\n")


if __name__ == "__main__":
    main()
