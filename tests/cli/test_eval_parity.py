#!/usr/bin/env python3
"""`kvpress-cli eval` against the same protocol run through kvpress + transformers.

    test_eval_parity.py <kvpress-cli> <llama-fixtures-dir>

The fixtures' eval.json (tests/reference/make_model_fixtures.py) holds, for a few stories and
presses (with their parameters: a wrapper's inner press), the per-story mean NLL of the
teacher-forced continuation after a compressed prefix and the greedy agreement with the full
cache (after KeyRerotationPress the continuation starts at the compressed length, as kvpress's
pipeline puts a question there). The CLI runs the same stories and presses with --json;
NLLs must agree within 1e-3 and agreements within one flipped position per story (a near-tie
argmax may fall either way under float32 rounding).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

cli, fixtures = sys.argv[1], Path(sys.argv[2])
ref_path = fixtures / "eval.json"
if not ref_path.exists():
    sys.exit(f"test_eval_parity: {ref_path} is missing; run tests/reference/make_model_fixtures.py (scripts/test.sh does)")
ref = json.loads(ref_path.read_text())

with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "eval.json"
    cmd = [cli, "eval", "--model", ref["model"], "--text", ref["text"],
           "--prefix-fraction", str(ref["prefix_fraction"]), "--min-prefix", str(ref["min_prefix"]),
           "--max-stories", str(ref["max_stories"]), "--ratios", str(ref["ratio"]), "--json", str(out), "--quiet"]
    for r in ref["results"]:
        cmd += ["--press", r["press"]]
        for key, value in r.get("params", {}).items():
            cmd += ["--param", f"{key}={value}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"test_eval_parity: {' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
    got = json.loads(out.read_text())

failures = []
ref_stories = [(s["index"], s["prefix"]) for s in ref["stories"]]
got_stories = [(s["index"], s["prefix"]) for s in got["stories"]]
if ref_stories != got_stories:
    sys.exit(f"test_eval_parity: stories (index, prefix) differ: kvpress {ref_stories}, kvpress-cli {got_stories}")
scored = [s["scored"] for s in got["stories"]]

def close(what, a, b, tol):
    if abs(a - b) > tol:
        failures.append(f"{what}: kvpress {a:.6f}, kvpress-cli {b:.6f} (tolerance {tol:.2g})")

for i, (a, b) in enumerate(zip(ref["full"]["nll"], got["full"]["nll"])):
    close(f"full cache, story {ref_stories[i][0]}: NLL", a, b, 1e-3)
def run_key(r):
    return r["press"], json.dumps(r.get("params", {}), sort_keys=True), r["ratio"]

def run_label(r):
    params = r.get("params", {})
    return r["press"] + ("(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")" if params else "")

got_results = {run_key(r): r for r in got["results"]}
worst = 0.0
for r in ref["results"]:
    label = run_label(r)
    g = got_results.get(run_key(r))
    if g is None:
        failures.append(f"{label} at {r['ratio']}: missing from the CLI's JSON")
        continue
    for i in range(len(ref_stories)):
        close(f"{label}, story {ref_stories[i][0]}: NLL", r["nll"][i], g["nll"][i], 1e-3)
        close(f"{label}, story {ref_stories[i][0]}: greedy agreement", r["agreement"][i], g["agreement"][i],
              1.0 / scored[i] + 1e-9)
        worst = max(worst, abs(r["nll"][i] - g["nll"][i]))
    close(f"{label}: mean NLL", r["mean_nll"], g["mean_nll"], 1e-3)

if failures:
    print("\n".join("FAIL: " + f for f in failures), file=sys.stderr)
    sys.exit(1)
print(f"test_eval_parity: {len(ref['results'])} presses x {len(ref_stories)} stories match kvpress "
      f"(largest NLL difference {worst:.2e})")
