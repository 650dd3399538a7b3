#!/usr/bin/env python3
"""DuoAttentionPress's and QFilterPress's artifacts for SmolLM2-135M-Instruct, made from its GGUF file
by scripts/make_artifact.py, and both presses through `kvpress-cli bench` with them.

    test_bench_artifacts.py <kvpress-cli> <make_artifact.py> <make_tasks.py> <smollm2.gguf> <stories>

Small recipes (3 stories for the filters, 2 samples for the pattern), so the test checks the commands
and the files, not the artifacts' quality (docs/QUALITY.md uses the full recipes):
* q_filters [30 layers, 3 KV heads, 64]: unit vectors; the pattern: one row of 3 scores in [0, 1]
  per layer and kvpress's on-the-fly sink / recent sizes;
* the bench runs both on one 1,024-token example, one row each, with the artifact paths in the
  rows' params (so the kvpress comparison can rebuild the presses);
* a GGUF model without --stories is refused with a clear error.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

cli, make_artifact, make_tasks, gguf_file, stories = sys.argv[1:6]


def run(cmd, expect_ok=True):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if expect_ok and proc.returncode != 0:
        sys.exit(f"test_bench_artifacts: {' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout}\n"
                 f"{proc.stderr}")
    return proc


with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    filters_file, pattern = tmp / "q_filters.safetensors", tmp / "duo"
    run([sys.executable, make_artifact, "qfilters", "--model", gguf_file, "--stories", stories, "--max-stories", "3",
         "--out", filters_file])
    filters = load_file(str(filters_file))["q_filters"]
    assert list(filters.shape) == [30, 3, 64], filters.shape
    assert torch.allclose(filters.norm(dim=-1), torch.ones(30, 3), atol=1e-4), filters.norm(dim=-1)
    run([sys.executable, make_artifact, "duo-attention", "--model", gguf_file, "--stories", stories,
         "--num-samples", "2", "--out", pattern])
    config = json.loads((pattern / "config.json").read_text())
    assert (config["sink_size"], config["recent_size"]) == (128, 256), config
    scores = [[float(v) for v in line.split("\t")] for line in (pattern / "full_attention_heads.tsv").read_text().splitlines()]
    assert len(scores) == 30 and all(len(r) == 3 and all(0 <= v <= 1 for v in r) for r in scores), scores

    proc = run([sys.executable, make_artifact, "qfilters", "--model", gguf_file, "--out", tmp / "x.safetensors"],
               expect_ok=False)
    assert proc.returncode == 2 and "--stories: required with a GGUF model" in proc.stderr, proc.stderr

    tasks, out = tmp / "tasks", tmp / "results.jsonl"
    run([sys.executable, make_tasks, "--out", tasks, "--tasks", "niah_single_1", "--lengths", "1024", "--examples", "1"])
    run([cli, "bench", "--tasks", tasks, "--out", out, "--press", "QFilterPress", "--param", f"q_filters={filters_file}",
         "--press", "DuoAttentionPress", "--param", f"attention_pattern={pattern}", "--ratios", "0.5", "--threads", "2",
         "--no-progress"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["press_name"] for r in rows) == ["DuoAttentionPress", "QFilterPress"], rows
    for r in rows:
        assert r["params"] in ({"q_filters": str(filters_file)}, {"attention_pattern": str(pattern)}), r
        assert 0 < r["kept_fraction"] <= 1 and isinstance(r["answer"], str), r

print(f"test_bench_artifacts: q_filters {list(filters.shape)}, DuoAttention pattern {len(scores)} x 3; bench rows: "
      f"{[(r['press'], r['ratio'], round(r['kept_fraction'], 3), r['score']) for r in rows]}")
