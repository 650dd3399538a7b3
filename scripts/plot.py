#!/usr/bin/env python3
"""Charts of kvpress-cpp's results, drawn with matplotlib (Agg backend: no display needed).

    plot.py eval RESULTS.json|RESULTS.csv --out OUT.png [--title TITLE]
        Mean NLL against compression ratio, one curve per press starting at the full cache
        (ratio 0), the full cache as a dashed line. Input: the file `kvpress-cli eval --json` or
        `--csv` writes (docs/CLI.md). Presses without a ratio (DecodingPress) get no curve.
    plot.py bench SUMMARY.csv --out OUT.png [--title TITLE]
        Accuracy (mean over tasks and lengths, each weighted alike) against compression ratio, one
        line per press starting at the uncompressed accuracy (ratio 0), as kvpress's leaderboard
        draws it; no compression as a dashed line. Input: `kvpress-cli bench --csv`. Calibrated
        presses ("[calibrated]": their ratio column is a tolerance) are left to the kept chart.
    plot.py kept SUMMARY.csv --out OUT.png [--title TITLE]
        Accuracy against the mean kept fraction of the cache, one line per press, fixed-ratio and
        calibrated ("[calibrated]", bench --calibrate) alike, all from the uncompressed point (1, its
        accuracy): accuracy per byte kept. Input: `kvpress-cli bench --csv` (column kept_fraction).
    plot.py compare RESULTS.json|RESULTS.csv --out OUT.png [--title TITLE]
        Speedup of kvpress-cpp over kvpress 0.5.5 per press (kvpress_ms / kvpress_cpp_ms),
        horizontal bars on a log scale, one colour per table of benchmarks/compare_kvpress.py
        ("a": projections excluded, "b": full path). Input: what compare_kvpress.py writes with
        --json ({"title": ..., "rows": [...]}) or --csv, rows with the columns COMPARE_COLUMNS.

`kvpress-cli eval --png` runs this script; benchmarks/compare_kvpress.py imports plot_compare.
OUT is written to a temporary file in its directory and renamed, so it is never half-written.
Errors: one line "plot.py: error: ..." on stderr, exit code 2.
"""
import argparse
import csv
import json
import os
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)
import matplotlib.ticker  # noqa: E402

# The run's metadata (date, commit, cpu_model, kernel_isa) repeats on every row: a file says where
# and when it was measured. Files without it still load.
COMPARE_COLUMNS = ["table", "press", "kvpress_ms", "kvpress_cpp_ms", "agree", "floor_ms", "date", "commit",
                   "cpu_model", "kernel_isa"]
TABLE_NAMES = {"a": "(a) projections excluded", "b": "(b) full path from hidden states"}
MARKERS = "osD^v<>"  # 7 markers against 20 colours: no two of the first 140 curves look alike


class PlotError(Exception):
    """Bad input: reported as one line, exit code 2."""


def number(row, key, where, optional=False):
    """row[key] as a float; None for an empty/null optional value."""
    value = row.get(key)
    if value in (None, "") and optional:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise PlotError(f"{where}: '{key}' must be a number, got {value!r}") from None


def read_rows(path, required):
    """(rows, metadata) of a JSON object {..., "rows"|"results": [...]} or of a CSV with a header."""
    try:
        with open(path, newline="") as f:
            if path.endswith(".csv"):
                rows, meta = list(csv.DictReader(f)), {}
            else:
                meta = json.load(f)
                rows = meta.get("rows", meta.get("results")) if isinstance(meta, dict) else None
    except OSError as e:
        raise PlotError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as e:
        raise PlotError(f"{path}: not valid {'CSV' if path.endswith('.csv') else 'JSON'}: {e}") from None
    if not isinstance(rows, list) or not rows:
        raise PlotError(f"{path}: no rows (expected a CSV with a header or JSON with a 'rows'/'results' list)")
    for i, row in enumerate(rows):
        missing = [k for k in required if not isinstance(row, dict) or k not in row]
        if missing:
            raise PlotError(f"{path}: row {i + 1} lacks {', '.join(missing)} (expected columns {', '.join(required)})")
    return rows, meta


# ----------------------------------------------------------------------------- eval


def load_eval(path):
    """(full-cache mean NLL, {label: [(ratio, mean NLL)]} in file order, default title)."""
    if path.endswith(".csv"):
        rows, _ = read_rows(path, ["press", "ratio", "mean_nll", "stories"])
        full = [r for r in rows if r["press"] == "full cache"]
        if not full:
            raise PlotError(f"{path}: no 'full cache' row")
        full_nll = number(full[0], "mean_nll", path)
        stories = f"{int(number(full[0], 'stories', path))} stories"
        rows = [dict(r, label=r["press"]) for r in rows if r["press"] != "full cache"]
    else:
        rows, meta = read_rows(path, ["label", "ratio", "mean_nll"])
        full_nll = number(meta.get("full", {}), "mean_nll", f"{path}: 'full'")
        prefix = (f"{meta['prefix_tokens']} tokens" if meta.get("prefix_tokens") is not None
                  else f"{meta.get('prefix_fraction')}")
        stories = f"{len(meta.get('stories', []))} stories, prefix {prefix}"
    curves = {}
    for i, r in enumerate(rows):
        where = f"{path}: row {i + 1} ({r['label']})"
        ratio = number(r, "ratio", where, optional=True)
        curves.setdefault(r["label"], [(0.0, full_nll)])
        if ratio:  # None: no ratio (DecodingPress); 0: already the curve's start
            curves[r["label"]].append((ratio, number(r, "mean_nll", where)))
    curves = {label: sorted(points) for label, points in curves.items() if len(points) > 1}
    return full_nll, curves, f"Continuation NLL under compression ({stories})"


def plot_eval(full_nll, curves, out, title):
    fig, ax = plt.subplots(figsize=(12, 7), layout="constrained")
    tab20 = plt.get_cmap("tab20").colors
    colours = tab20[0::2] + tab20[1::2]  # the 10 strong colours first, then their pale pairs
    # Legend in the order of the curves' right ends, highest NLL first, so that it reads like the chart.
    ordered = sorted(curves.items(), key=lambda item: -item[1][-1][1])
    for i, (label, points) in enumerate(ordered):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=4, linewidth=1.4,
                color=colours[i % len(colours)], label=label)
    ax.axhline(full_nll, color="0.3", linestyle="--", linewidth=1.2, label=f"full cache ({full_nll:.3f})")
    ax.set_title(title)
    ax.set_xlabel("compression ratio (fraction of cached tokens removed)")
    ax.set_ylabel("mean NLL of the continuation (nats/token)")
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7.5, title="press", title_fontsize=8)
    save(fig, out)


# ----------------------------------------------------------------------------- bench


CALIBRATED = " [calibrated]"  # kvpress-cli bench's label suffix for --calibrate rows


def mean_cells(rows, path, value):
    """{(press, ratio): mean over its (task, length) cells of value(row, where)}."""
    cells = {}
    for i, r in enumerate(rows):
        where = f"{path}: row {i + 1} ({r['press']})"
        cells.setdefault((r["press"], number(r, "ratio", where, optional=True)), []).append(value(r, where))
    return {key: sum(v) / len(v) for key, v in cells.items()}


def load_bench(path):
    """(uncompressed accuracy or None, {press: [(ratio, accuracy)]}, default title) of a bench summary CSV."""
    rows, _ = read_rows(path, ["press", "ratio", "task", "length", "examples", "accuracy"])
    mean = mean_cells(rows, path, lambda r, where: number(r, "accuracy", where))
    baseline = mean.get(("none", None))
    curves = {}
    for (press, ratio), acc in mean.items():
        if ratio is not None and not press.endswith(CALIBRATED):
            curves.setdefault(press, [] if baseline is None else [(0.0, baseline)]).append((ratio, acc))
    tasks = sorted({r["task"] for r in rows})
    lengths = sorted({int(number(r, "length", path)) for r in rows})
    return baseline, {p: sorted(v) for p, v in curves.items()}, (
        f"Accuracy under compression ({len(tasks)} tasks, {', '.join(map(str, lengths))} tokens)")


def load_kept(path):
    """(uncompressed accuracy or None, {press: [(mean kept fraction, accuracy)]}, default title)."""
    rows, _ = read_rows(path, ["press", "ratio", "task", "length", "examples", "accuracy", "kept_fraction"])
    accuracy = mean_cells(rows, path, lambda r, where: number(r, "accuracy", where))
    kept = mean_cells(rows, path, lambda r, where: number(r, "kept_fraction", where))
    baseline = accuracy.get(("none", None))
    curves = {}
    for key, acc in accuracy.items():
        press, ratio = key
        if ratio is not None:
            curves.setdefault(press, [] if baseline is None else [(1.0, baseline)]).append((kept[key], acc))
    tasks = sorted({r["task"] for r in rows})
    return baseline, {p: sorted(v) for p, v in curves.items()}, (
        f"Accuracy against the cache kept ({len(tasks)} tasks): fixed ratios and calibrated")


def plot_bench(baseline, curves, out, title, xlabel="compression ratio (fraction of cached tokens removed)"):
    fig, ax = plt.subplots(figsize=(12, 7), layout="constrained")
    tab20 = plt.get_cmap("tab20").colors
    colours = tab20[0::2] + tab20[1::2]
    ordered = sorted(curves.items(), key=lambda item: -item[1][-1][1])  # legend in the order of the right ends
    for i, (label, points) in enumerate(ordered):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=4, linewidth=1.4,
                color=colours[i % len(colours)], label=label,
                linestyle="--" if label.endswith(CALIBRATED) else "-")
    if baseline is not None:
        ax.axhline(baseline, color="0.3", linestyle="--", linewidth=1.2, label=f"no compression ({baseline:.1f})")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%, RULER string match)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7.5, title="press", title_fontsize=8)
    save(fig, out)


# ----------------------------------------------------------------------------- compare


def load_compare(path):
    """(rows with numeric fields, title or None) from compare_kvpress.py's --json or --csv."""
    rows, meta = read_rows(path, ["table", "press", "kvpress_ms", "kvpress_cpp_ms"])
    for i, r in enumerate(rows):
        where = f"{path}: row {i + 1} ({r['press']})"
        if r["table"] not in TABLE_NAMES:
            raise PlotError(f"{where}: 'table' must be one of {', '.join(TABLE_NAMES)}, got {r['table']!r}")
        for key in ("kvpress_ms", "kvpress_cpp_ms"):
            r[key] = number(r, key, where)
            if r[key] <= 0:
                raise PlotError(f"{where}: '{key}' must be > 0, got {r[key]}")
    return rows, meta.get("title")


def plot_compare(rows, out, title):
    """Horizontal bars: one row per press, one bar per table it appears in."""
    presses = list(dict.fromkeys(r["press"] for r in rows))
    tables = [t for t in TABLE_NAMES if any(r["table"] == t for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.42 * len(presses) * len(tables)), layout="constrained")
    height = 0.8 / len(tables)
    for j, table in enumerate(tables):
        mine = {r["press"]: r["kvpress_ms"] / r["kvpress_cpp_ms"] for r in rows if r["table"] == table}
        ys = [i + (j - (len(tables) - 1) / 2) * height for i, p in enumerate(presses) if p in mine]
        speedups = [mine[p] for p in presses if p in mine]
        # Bars grow from 1x (parity): right for faster, left for slower.
        bars = ax.barh(ys, [s - 1.0 for s in speedups], left=1.0, height=height * 0.9, color=f"C{j}",
                       label=TABLE_NAMES[table])
        ax.bar_label(bars, labels=[f"{s:.2f}×" for s in speedups], padding=3, fontsize=8)
    ax.set_xscale("log")
    all_speedups = [r["kvpress_ms"] / r["kvpress_cpp_ms"] for r in rows]
    ax.set_xlim(min(min(all_speedups), 1.0) / 1.5, max(max(all_speedups), 1.0) * 1.6)  # room for the labels
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(presses)), presses)
    ax.invert_yaxis()  # first press on top, as in the tables
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
    # Minor ticks (labelled by matplotlib only when the range spans under a decade): 2, 3, 5 only.
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v:g}×" if f"{v:.0e}"[0] in "235" else ""))
    ax.set_title(title)
    ax.set_xlabel("speedup of kvpress-cpp over kvpress 0.5.5 (× = kvpress time / kvpress-cpp time, log scale)")
    ax.set_ylabel("press")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=len(tables), fontsize=8)  # below: never over a bar
    save(fig, out)


# ----------------------------------------------------------------------------- output


def save(fig, out):
    """Writes the PNG next to `out` under a temporary name, then renames it into place."""
    directory = os.path.dirname(os.path.abspath(out))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".plot-", suffix=".png")
    except OSError as e:
        plt.close(fig)
        raise PlotError(f"--out {out}: cannot create a file in {directory}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the chart private
        os.replace(tmp, out)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):  # e.g. disk full, or OUT is a folder
            raise PlotError(f"--out {out}: cannot write: {e.strerror}") from None
        raise
    finally:
        plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="plot.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="chart", required=True)
    for name, help_text in (("eval", "mean NLL against compression ratio (kvpress-cli eval --json/--csv)"),
                            ("bench", "accuracy against compression ratio (kvpress-cli bench --csv)"),
                            ("kept", "accuracy against mean kept fraction (kvpress-cli bench --csv)"),
                            ("compare", "speedup per press (benchmarks/compare_kvpress.py --json/--csv)")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("results", help="results file, .json or .csv")
        p.add_argument("--out", required=True, help="PNG to write")
        p.add_argument("--title", help="chart title (default: from the results)")
    args = parser.parse_args(argv)
    try:
        if args.chart == "eval":
            full_nll, curves, title = load_eval(args.results)
            plot_eval(full_nll, curves, args.out, args.title or title)
        elif args.chart == "bench":
            baseline, curves, title = load_bench(args.results)
            plot_bench(baseline, curves, args.out, args.title or title)
        elif args.chart == "kept":
            baseline, curves, title = load_kept(args.results)
            plot_bench(baseline, curves, args.out, args.title or title, xlabel="mean fraction of the cache kept")
        else:
            rows, title = load_compare(args.results)
            plot_compare(rows, args.out, args.title or title or "kvpress-cpp vs kvpress 0.5.5")
    except PlotError as e:
        print(f"plot.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
