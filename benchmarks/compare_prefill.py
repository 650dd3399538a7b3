#!/usr/bin/env python3
"""Prefill + compression time: transformers + kvpress 0.5.5 against the kvpress::llama runner, on
the same random-weight Llama and the same token ids, press by press (issue 14, item 6).

The model is the shape a new user tries (hidden 1024, 16 query / 4 KV heads, head_dim 64, 8 layers,
MLP 2816, vocabulary 2048, float32, random weights from a seed). This script builds it with
transformers, saves it (config.json + model.safetensors) and the ids to a temporary folder, then:

* kvpress's side, in this process: `with press(model): model(ids, past_key_values=DynamicCache(),
  logits_to_keep=1)` on the model loaded with attn_implementation="sdpa" (kvpress's default), or
  "eager" for the presses that need attention weights (ObservedAttentionPress);
* our side: build/benchmarks/kvpress_bench_prefill on the saved folder (LlamaModel::prefill with
  last_logits_only), a separate process with the same thread count, run right before kvpress's
  side for each press (the sides alternate press by press).

Each side reports the fastest of --repeats prefills and, inside it, the press's own time (score,
selection and gather over every layer), measured by wrapping the press's compress on both sides
("none" = prefill without a press). The table prints both, their ratio, and the press's share of
our prefill; the last line reads `ours/kvpress prefill: max A, median B over N presses`.

    ~/.cache/kvpress-cpp/venv/bin/python benchmarks/compare_prefill.py --seq 4096,16384
    ... --presses none,SnapKVPress,AdaKVPress:press=SnapKVPress --repeats 1 --json /tmp/prefill.json

A press is written NAME or NAME:param=value:param=value (kvpress-cli's parameter syntax, wrappers
naming their inner press with press=...). See docs/PERFORMANCE.md, "Runner prefill".
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "reference"))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from common import build_press, setup  # noqa: E402 (checks the pinned kvpress first)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

DEFAULT_PRESSES = [
    "none", "KnormPress", "StreamingLLMPress", "KeyDiffPress", "LagKVPress", "SnapKVPress", "TOVAPress",
    "ExpectedAttentionPress", "PyramidKVPress", "LeverageScorePress", "NonCausalAttnPress", "CompactorPress",
    "AdaKVPress:press=SnapKVPress", "CriticalKVPress:press=KnormPress", "ChunkKVPress:press=SnapKVPress",
]
EAGER_PRESSES = {"ObservedAttentionPress"}  # kvpress reads the eager attention weights


def parse_press(spec):
    name, *pairs = spec.split(":")
    params = dict(pair.split("=", 1) for pair in pairs)
    return name, params


def random_model(path: Path, seed: int) -> LlamaConfig:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=65536, rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return config


def time_compress(press) -> list:
    """Wraps press.compress (kvpress's forward hook calls self.compress(...)) so that the returned
    one-element list adds up the seconds spent in it."""
    spent = [0.0]
    inner = press.compress

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return result

    press.compress = timed
    return spent


def time_kvpress(path: Path, ids, spec, ratio, repeats):
    """(fastest prefill s, the press's compress time inside it) on transformers + kvpress."""
    name, params = parse_press(spec)
    attn = "eager" if name in EAGER_PRESSES else "sdpa"
    model = LlamaForCausalLM.from_pretrained(str(path), attn_implementation=attn, dtype=torch.float32).eval()
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        press = None if name == "none" else build_press(name, params, ratio)
        spent = time_compress(press) if press is not None else [0.0]
        with torch.inference_mode():
            start = time.perf_counter()
            if press is None:
                model(ids, past_key_values=DynamicCache(), logits_to_keep=1)
            else:
                with press(model):
                    model(ids, past_key_values=DynamicCache(), logits_to_keep=1)
            elapsed = time.perf_counter() - start
        best = min(best, (elapsed, spent[0]))
    del model
    return best


def time_ours(bench: Path, path: Path, ids_file: Path, spec, ratio, repeats, threads):
    """(fastest prefill s, the press's compress time inside it) from kvpress_bench_prefill, one
    process per press so that the two sides alternate press by press."""
    # Where the press cannot be wrapped (its second pass: KVComposePress, KVzipPress), its time is the
    # difference to "none".
    second_pass = spec.startswith(("KVComposePress", "KVzipPress"))
    presses = ["none", spec] if second_pass else [spec]
    cmd = [str(bench), str(path), str(ids_file), "--presses", ",".join(presses), "--ratio", str(ratio),
           "--repeats", str(repeats), "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = [json.loads(line) for line in out.splitlines() if line.strip()][-1]
    return row["prefill_s"], row.get("compress_s", 0.0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", type=Path, default=REPO / "build" / "benchmarks" / "kvpress_bench_prefill")
    parser.add_argument("--seq", default="4096,16384", help="comma-separated prefix lengths")
    parser.add_argument("--presses", default=",".join(DEFAULT_PRESSES))
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if not args.bench.exists():
        sys.exit(f"compare_prefill.py: {args.bench} not found (build the project first)")
    setup(args.threads)
    specs = args.presses.split(",")
    if "none" not in specs:
        specs = ["none"] + specs
    print(f"# threads {args.threads}, ratio {args.ratio}, fastest of {args.repeats}, "
          f"load {os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpress_prefill_") as tmp:
        path = Path(tmp)
        config = random_model(path, args.seed)
        for seq in [int(s) for s in args.seq.split(",")]:
            gen = torch.Generator().manual_seed(args.seed + seq)
            ids = torch.randint(0, config.vocab_size, (1, seq), generator=gen)
            ids_file = path / f"ids_{seq}.safetensors"
            save_file({"input_ids": ids}, str(ids_file))
            print(f"\nS={seq}: seconds (press = the press's own compress time inside the prefill)")
            print(f"{'press':34s} {'kvpress':>9s} {'(press)':>8s} {'ours':>9s} {'(press)':>8s} "
                  f"{'ours/kv':>8s} {'press %':>8s}")
            for spec in specs:
                our_total, our_press = time_ours(args.bench, path, ids_file, spec, args.ratio, args.repeats,
                                                 args.threads)
                kv_total, kv_press = time_kvpress(path, ids, spec, args.ratio, args.repeats)
                row = {"press": spec, "seq": seq, "kvpress_prefill_s": kv_total, "kvpress_compress_s": kv_press,
                       "ours_prefill_s": our_total, "ours_compress_s": our_press}
                rows.append(row)
                print(f"{spec:34s} {kv_total:9.3f} {kv_press:8.3f} {our_total:9.3f} {our_press:8.3f} "
                      f"{our_total / kv_total:8.2f} {100 * our_press / our_total:7.1f}%", flush=True)
    ratios = [r["ours_prefill_s"] / r["kvpress_prefill_s"] for r in rows]
    print(f"\nours/kvpress prefill: max {max(ratios):.2f}, median {statistics.median(ratios):.2f} "
          f"over {len(ratios)} runs")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
