#!/usr/bin/env python3
"""`kvpress-cli bench` end to end on SmolLM2-135M-Instruct: a reduced run of the quality benchmark.

    test_bench.py <kvpress-cli> <make_tasks.py>

make_tasks.py writes two 1,024-token examples of one task; the bench runs them with no compression
and SnapKVPress at ratio 0.5 (4 runs) and must:
* write one row per run, each scored as RULER scores it (recomputed here: the fraction of the
  expected strings in the answer, case-insensitive), the uncompressed rows keeping every token;
* resume: a second run with the same --out runs nothing; after the file loses half of its last row
  (an interrupted write), a third run drops that partial row and runs exactly that one again;
* write the summary CSV (accuracy per press, ratio, task and length, from every row) and the chart,
  and benchmarks/quality/leaderboard.py turn that CSV into the leaderboard's tables;
* with --calibrate, run each score-based press again at the ratio its search finds per example;
* run KVzipPress (under a --label) and query-aware SnapKVPress at two ratios given by --press-ratios,
  each from one prefill;
* with --kv-dtype int8, answer over int8 pages, keeping what the dense run keeps;
* refuse a results file of another model, a --task the folder does not hold, and a press that
  observes the question given without --query-aware (before running anything), two presses of one
  label, --press-ratios naming no press or a press without a ratio, an unknown --kv-dtype and a
  press a paged prefill cannot run, with clear errors.
"""
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

cli, make_tasks = sys.argv[1], sys.argv[2]
TASK, LENGTH = "niah_single_1", 1024


def run(cmd, expect_ok=True):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if expect_ok and proc.returncode != 0:
        sys.exit(f"test_bench: {' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def ruler_all(answer, expected):
    return sum(e.lower() in answer.lower() for e in expected) / len(expected)


with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    tasks, out, summary, chart = tmp / "tasks", tmp / "results.jsonl", tmp / "summary.csv", tmp / "chart.png"
    run([sys.executable, make_tasks, "--out", tasks, "--tasks", TASK, "--lengths", str(LENGTH), "--examples", "2"])
    bench = [cli, "bench", "--tasks", tasks, "--out", out, "--press", "none", "--press", "SnapKVPress",
             "--ratios", "0.5", "--csv", summary, "--png", chart, "--threads", "2", "--no-progress"]
    first = run(bench)
    got = rows(out)
    assert len(got) == 4, f"expected 4 rows (2 examples x 2 presses), got {len(got)}:\n{first.stdout}"
    for r in got:
        assert r["task"] == TASK and r["length"] == LENGTH, r
        assert r["score"] == ruler_all(r["answer"], r["expected"]), r
        assert r["shared_prefill"] is True, r  # both presses compress the one captured prefill
        if r["press"] == "none":
            assert r["ratio"] is None and r["kept_fraction"] == 1.0, r
        else:
            assert r["ratio"] == 0.5 and 0.45 < r["kept_fraction"] <= 0.5, r
    assert summary.exists() and chart.stat().st_size > 10_000, "no summary CSV or chart"
    table = list(csv.DictReader(summary.open()))
    assert {(t["press"], t["ratio"]) for t in table} == {("none", ""), ("SnapKVPress", "0.5")}, table
    for t in table:
        mine = [r["score"] for r in got if r["press"] == t["press"]]
        assert abs(float(t["accuracy"]) - 100 * sum(mine) / len(mine)) < 1e-3, (t, mine)

    # The leaderboard's Markdown (benchmarks/quality/leaderboard.py, docs/QUALITY.md's tables): the
    # uncompressed table and SnapKVPress's mean over the one task and length at 0.5.
    board = run([sys.executable, Path(make_tasks).with_name("leaderboard.py"), summary]).stdout
    snap = next(t for t in table if t["press"] == "SnapKVPress")
    assert "### The model uncompressed" in board and f"| {TASK} |" in board, board
    assert f"| SnapKVPress | {float(snap['accuracy']):.1f} | {float(snap['accuracy']):.1f} |" in board, board

    second = run(bench)
    assert "0 runs to do (4 already in" in second.stdout, second.stdout
    assert len(rows(out)) == 4

    text = out.read_text()
    last = text.rstrip("\n").rfind("\n") + 1
    out.write_text(text[: last + (len(text) - last) // 2])  # half of the last row, no newline
    third = run(bench)
    assert "dropping an incomplete last row" in third.stderr, third.stderr
    assert "1 runs to do (3 already in" in third.stdout, third.stdout
    again = rows(out)
    assert len(again) == 4 and again[3]["id"] == got[3]["id"] and again[3]["press"] == got[3]["press"], again
    assert again[3]["answer"] == got[3]["answer"], (again[3], got[3])  # the same answer on a rerun

    # --calibrate: SnapKVPress also runs "[calibrated]", its ratio per example searched on the
    # captured prefill (attention output of the last 16 queries within the tolerance); the rows'
    # ratio is the tolerance, the ratio found is in "calibration", and the summary has its kept fraction.
    calibrate = run(bench + ["--calibrate", "0.2"])
    assert "2 runs to do (4 already in" in calibrate.stdout, calibrate.stdout
    cal = [r for r in rows(out) if r["press"] == "SnapKVPress [calibrated]"]
    assert len(cal) == 2, rows(out)
    for r in cal:
        c = r["calibration"]
        assert r["ratio"] == 0.2 and c["tolerance"] == 0.2 and 0 <= c["ratio"] <= 0.95, r
        assert c["quality"] >= 1 - 0.2 - 1e-9 and c["evaluations"] >= 1 and c["observed_queries"] == 16, r
        assert abs(r["kept_fraction"] - (1 - c["ratio"])) < 0.02, r  # SnapKV keeps int(S * (1 - ratio)) a head
        assert r["score"] == ruler_all(r["answer"], r["expected"]), r
    assert all(r["calibration"] is None for r in rows(out) if r not in cal)
    table = list(csv.DictReader(summary.open()))
    cell = next(t for t in table if t["press"] == "SnapKVPress [calibrated]")
    assert abs(float(cell["kept_fraction"]) - sum(r["kept_fraction"] for r in cal) / 2) < 1e-3, cell

    # KVzipPress and query-aware SnapKVPress at two ratios on one example, each from one prefill: KVzip's
    # scoring pass then the captured prefill cut to each ratio's selection (llama::kvzip_compress_captured;
    # tests/test_kvzip.cpp checks the caches), SnapKV's from a capture of context + question
    # (tests/test_pipeline.cpp checks the answers).
    # Their two ratios come from --press-ratios (by label, --label's for KVzip), over --ratios 0.5.
    shared_out = tmp / "shared.jsonl"
    run([cli, "bench", "--tasks", tasks, "--out", shared_out, "--press", "KVzipPress", "--label", "KVzip",
         "--query-aware", "SnapKVPress", "--ratios", "0.5", "--press-ratios", "KVzip=0.75,0.5",
         "--press-ratios", "SnapKVPress [query-aware]=0.5,0.75", "--examples", "1", "--threads", "2", "--no-progress"])
    both = rows(shared_out)
    assert sorted((r["press"], r["ratio"]) for r in both) == [
        ("KVzip", 0.5), ("KVzip", 0.75), ("SnapKVPress [query-aware]", 0.5),
        ("SnapKVPress [query-aware]", 0.75)], both
    for r in both:
        assert r["shared_prefill"] is True and abs(r["kept_fraction"] - (1 - r["ratio"])) < 0.02, r
        assert r["score"] == ruler_all(r["answer"], r["expected"]), r

    # --kv-dtype: SnapKVPress answered over int8 pages (llama::PipelineOptions::paged_kv_format), its
    # rows labelled "[int8 pages]", each its own paged prefill keeping the tokens the dense run keeps.
    paged_out = tmp / "paged.jsonl"
    run([cli, "bench", "--tasks", tasks, "--out", paged_out, "--press", "SnapKVPress", "--ratios", "0.5",
         "--kv-dtype", "int8", "--examples", "1", "--threads", "2", "--no-progress"])
    paged = rows(paged_out)
    assert [(r["press"], r["kv_format"], r["shared_prefill"]) for r in paged] == [
        ("SnapKVPress [int8 pages]", "int8", False)], paged
    dense = next(r for r in got if r["press"] == "SnapKVPress" and r["id"] == paged[0]["id"])
    assert dense["kv_format"] == "dense" and abs(paged[0]["kept_fraction"] - dense["kept_fraction"]) < 1e-9, paged
    assert paged[0]["score"] == ruler_all(paged[0]["answer"], paged[0]["expected"]), paged

    other = tmp / "other.jsonl"
    other.write_text(json.dumps(dict(got[0], model="another.gguf")) + "\n")
    proc = run([*bench[:5], other, *bench[6:]], expect_ok=False)
    assert proc.returncode != 0 and "holds results of model another.gguf" in proc.stderr, proc.stderr
    proc = run([cli, "bench", "--tasks", tasks, "--out", tmp / "x.jsonl", "--task", "vt"], expect_ok=False)
    assert proc.returncode != 0 and "--task vt: not in" in proc.stderr, proc.stderr
    # Refused before any run: FinchPress observes the question, so its prefill must hold it.
    proc = run([cli, "bench", "--tasks", tasks, "--out", tmp / "y.jsonl", "--press", "FinchPress"], expect_ok=False)
    assert proc.returncode != 0 and "FinchPress observes the question: give it with --query-aware" in proc.stderr, \
        proc.stderr
    assert not (tmp / "y.jsonl").exists() or not (tmp / "y.jsonl").read_text(), "a refused run wrote rows"
    for args, message in [(["--press", "SnapKVPress", "--press", "SnapKVPress"], "two presses are labelled SnapKVPress"),
                          (["--press-ratios", "KVzip=0.5"], "--press-ratios KVzip: no press of this run is labelled so"),
                          (["--press", "none", "--press-ratios", "none=0.5"], "this press takes no compression ratio"),
                          (["--press", "KnormPress", "--press-ratios", "KnormPress=0.5,1"], "--press-ratios must be"),
                          (["--kv-dtype", "int2"], "bench: --kv-dtype: the KV format must be full, int8, fp8 or int4"),
                          (["--press", "KVzipPress", "--kv-dtype", "int8"],
                           "bench: --kv-dtype: KVzipPress [int8 pages] runs a second pass over the context")]:
        proc = run([cli, "bench", "--tasks", tasks, "--out", tmp / "z.jsonl", *args], expect_ok=False)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)

print(f"test_bench: 4 runs scored as RULER does, resumed after an interrupted row; answers: "
      f"{[(r['press'], r['answer'].strip()[:20], r['score']) for r in got]}")
