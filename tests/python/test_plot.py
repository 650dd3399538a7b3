"""scripts/plot.py draws valid PNGs for every chart from JSON and CSV, and fails cleanly.

Usage: python test_plot.py /path/to/scripts/plot.py   (the Python needs matplotlib)
"""
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile

plot_py = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.dirname(plot_py))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checklist import Checklist  # noqa: E402
import plot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
check = Checklist()


def run(*args):
    return subprocess.run([sys.executable, plot_py, *args], capture_output=True, text=True)


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG_SIGNATURE and os.path.getsize(path) > 1000


def no_temporaries(directory):
    return not [name for name in os.listdir(directory) if name.startswith(".plot-")]


tmp = tempfile.mkdtemp(prefix="kvpress_plot_test.")
umask = os.umask(0)
os.umask(umask)

# What `kvpress-cli eval --json` writes (tools/eval.cpp), trimmed to the fields plot.py reads and
# with a DecodingPress row (ratio null: no curve).
eval_json = os.path.join(tmp, "eval.json")
results = [dict(press=p, label=label, ratio=r, mean_nll=nll) for p, label, r, nll in [
    ("KnormPress", "KnormPress", 0.25, 3.08), ("KnormPress", "KnormPress", 0.5, 3.17),
    ("SnapKVPress", "SnapKVPress(window_size=16)", 0.25, 3.03), ("SnapKVPress", "SnapKVPress(window_size=16)", 0.5, 3.11),
    ("DecodingPress", "DecodingPress", None, 3.43)]]
with open(eval_json, "w") as f:
    json.dump({"prefix_tokens": None, "prefix_fraction": 0.5, "stories": [{"index": 0}, {"index": 3}],
               "full": {"mean_nll": 2.94}, "results": results}, f)
full, curves, title = plot.load_eval(eval_json)
check("eval json: curves start at the full cache, DecodingPress left out",
      full == 2.94 and list(curves) == ["KnormPress", "SnapKVPress(window_size=16)"]
      and curves["KnormPress"] == [(0.0, 2.94), (0.25, 3.08), (0.5, 3.17)], curves)
check("eval json: title", title == "Continuation NLL under compression (2 stories, prefix 0.5)", title)

# What `kvpress-cli eval --csv` writes: the full cache first, quoted labels, empty ratio.
eval_csv = os.path.join(tmp, "eval.csv")
with open(eval_csv, "w") as f:
    f.write("press,ratio,mean_nll,delta_nll,greedy_agreement,stories\n"
            "full cache,0,2.94,0,1,2\nKnormPress,0.25,3.08,0.14,0.8,2\nKnormPress,0.5,3.17,0.23,0.7,2\n"
            '"PerLayerCompressionPress(SnapKVPress, ramp)",0.5,3.1,0.16,0.77,2\n'
            '"DecodingPress(KnormPress, every 16, 64 tokens)",,3.43,0.49,0.61,2\n')
full, curves, title = plot.load_eval(eval_csv)
check("eval csv: curves", list(curves) == ["KnormPress", "PerLayerCompressionPress(SnapKVPress, ramp)"], curves)

# What benchmarks/compare_kvpress.py writes with --json / --csv; one press slower than kvpress.
compare_rows = [dict(table="a", press="KnormPress", kvpress_ms=74.55, kvpress_cpp_ms=35.7, agree=1.0, floor_ms=10.1),
                dict(table="a", press="LeverageScorePress", kvpress_ms=90.0, kvpress_cpp_ms=100.0, agree=None, floor_ms=None),
                dict(table="b", press="KnormPress", kvpress_ms=80.0, kvpress_cpp_ms=40.0, agree=1.0, floor_ms=None)]
compare_json = os.path.join(tmp, "compare.json")
with open(compare_json, "w") as f:
    json.dump({"title": "test run", "rows": compare_rows}, f)
compare_csv = os.path.join(tmp, "compare.csv")
with open(compare_csv, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=plot.COMPARE_COLUMNS)
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in compare_rows)
rows, title = plot.load_compare(compare_csv)
check("compare csv: rows and numbers", [(r["table"], r["press"], r["kvpress_ms"]) for r in rows] ==
      [("a", "KnormPress", 74.55), ("a", "LeverageScorePress", 90.0), ("b", "KnormPress", 80.0)] and title is None)

# What `kvpress-cli bench --csv` writes (tools/bench.cpp): two tasks, a fixed-ratio press and its
# calibrated form (ratio column: the tolerance), a press without a ratio.
bench_csv = os.path.join(tmp, "bench.csv")
with open(bench_csv, "w") as f:
    f.write("press,ratio,task,length,examples,accuracy,kept_fraction\n"
            '"none",,qa,2048,10,60.0,1.0\n"none",,vt,2048,10,80.0,1.0\n'
            '"KnormPress",0.5,qa,2048,10,40.0,0.5\n"KnormPress",0.5,vt,2048,10,60.0,0.5\n'
            '"KnormPress [calibrated]",0.05,qa,2048,10,55.0,0.7\n"KnormPress [calibrated]",0.05,vt,2048,10,75.0,0.5\n'
            '"DuoAttentionPress",,qa,2048,10,50.0,0.8\n"DuoAttentionPress",,vt,2048,10,50.0,0.8\n')
baseline, curves, _ = plot.load_bench(bench_csv)
check("bench csv: mean over tasks, curves from ratio 0, calibrated and ratio-less presses left out",
      baseline == 70.0 and curves == {"KnormPress": [(0.0, 70.0), (0.5, 50.0)]}, curves)
baseline, curves, _ = plot.load_kept(bench_csv)
check("kept csv: accuracy against mean kept fraction from (1, uncompressed), calibrated included",
      baseline == 70.0 and curves == {"KnormPress": [(0.5, 50.0), (1.0, 70.0)],
                                      "KnormPress [calibrated]": [(0.6, 65.0), (1.0, 70.0)]}, curves)

# Every subcommand, both formats where it reads both, from the command line.
for chart, source in (("eval", eval_json), ("eval", eval_csv), ("compare", compare_json), ("compare", compare_csv),
                      ("bench", bench_csv), ("kept", bench_csv)):
    out = os.path.join(tmp, f"{chart}-{os.path.basename(source)}.png")
    r = run(chart, source, "--out", out)
    check(f"{chart} {os.path.basename(source)}: exit 0, a PNG, no temporary left",
          r.returncode == 0 and is_png(out) and no_temporaries(tmp), r.stderr)
    mode = os.stat(out).st_mode & 0o777
    check(f"{chart} {os.path.basename(source)}: permissions from the umask, not mkstemp's 0600",
          mode == 0o666 & ~umask, oct(mode))

# compare_kvpress.py's way: import and call.
out = os.path.join(tmp, "imported.png")
plot.plot_compare(rows, out, "imported")
check("plot_compare called from Python", is_png(out))

# Errors: one line "plot.py: error: ...", exit code 2, an existing OUT left as it was.
out = os.path.join(tmp, "kept.png")
with open(out, "wb") as f:
    f.write(b"previous chart")
bad_table = os.path.join(tmp, "bad_table.csv")
with open(bad_table, "w") as f:
    f.write("table,press,kvpress_ms,kvpress_cpp_ms\nc,KnormPress,1,1\n")
not_json = os.path.join(tmp, "not.json")
with open(not_json, "w") as f:
    f.write("{results: ")
no_ms = os.path.join(tmp, "no_ms.csv")
with open(no_ms, "w") as f:
    f.write("table,press\na,KnormPress\n")
for name, args, want in [
    ("missing results file", ["eval", os.path.join(tmp, "missing.json"), "--out", out], "cannot read"),
    ("not JSON", ["eval", not_json, "--out", out], "not valid JSON"),
    ("unknown table", ["compare", bad_table, "--out", out], "'table' must be one of a, b, got 'c'"),
    ("missing column", ["compare", no_ms, "--out", out], "lacks kvpress_ms, kvpress_cpp_ms"),
    ("eval csv lacking columns", ["eval", no_ms, "--out", out], "lacks ratio, mean_nll, stories"),
    ("kept without kept_fraction", ["kept", no_ms, "--out", out], "lacks ratio, task, length, examples, accuracy, "
     "kept_fraction"),
    ("output folder missing", ["compare", compare_csv, "--out", os.path.join(tmp, "nope", "x.png")], "cannot create"),
    ("output is a folder", ["compare", compare_csv, "--out", tmp], "cannot write: Is a directory"),
]:
    r = run(*args)
    lines = r.stderr.strip().splitlines()
    check(f"error: {name}", r.returncode == 2 and len(lines) == 1 and lines[0].startswith("plot.py: error: ")
          and want in lines[0], f"rc {r.returncode}, stderr {r.stderr!r}")
with open(out, "rb") as f:
    check("error: the existing OUT is untouched", f.read() == b"previous chart")
check("error: no temporary left", no_temporaries(tmp))

if check.failures:
    print(f"files kept in {tmp}")
else:
    shutil.rmtree(tmp)
check.finish()
