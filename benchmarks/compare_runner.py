#!/usr/bin/env python3
"""Prefill and decode speed of the kvpress::llama runner against transformers on a real model
(issue 32, item 6): SmolLM2-135M-Instruct from its GGUF file, both sides in float32 on the same
threads, no press.

* transformers' side, in this process: the file loaded with `from_pretrained(gguf_file=...)`
  (dequantised to float32, attn_implementation="sdpa", its default); prefill = one forward of the
  S ids with logits_to_keep=1 into a DynamicCache; decode = N forwards of one token each, the
  previous argmax fed back (greedy).
* our side: build/benchmarks/kvpress_bench_generate on the same file and ids (LlamaModel::prefill
  with last_logits_only, then N forward() steps), a separate process with the same thread count,
  run right before transformers' side at each length.

Each side reports its fastest of --repeats runs; the ids are held-out stories, tokenized, repeated
to S. The table prints tokens per second of both and their ratio, with the run's date, commit and
CPU; the greedy tokens of both sides are compared (they should agree).

    ~/.cache/kvpress-cpp/venv/bin/python benchmarks/compare_runner.py --seq 512,2048,8192 --threads 2
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "reference"))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
os.environ["TQDM_DISABLE"] = "1"
from common import load_stories, setup  # noqa: E402 (checks the pinned kvpress first)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

import kvpress_cpp  # noqa: E402,F401  (registers torch.ops.kvpress: run_metadata reads the kernels' ISA)
from compare_kvpress import run_metadata  # noqa: E402  (date, commit, CPU, kernel ISA)


def time_transformers(model, ids, decode, repeats):
    best_prefill = best_decode = float("inf")
    tokens = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache()
            start = time.perf_counter()
            logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            best_prefill = min(best_prefill, time.perf_counter() - start)
            tokens = []
            start = time.perf_counter()
            for _ in range(decode):
                nxt = int(logits[0, -1].argmax())
                tokens.append(nxt)
                logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, logits_to_keep=1).logits
            best_decode = min(best_decode, time.perf_counter() - start)
    return best_prefill, best_decode, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="the GGUF file (default: scripts/setup.sh's SmolLM2)")
    parser.add_argument("--seq", default="512,2048,8192")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build", type=Path, default=REPO / "build")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_file = args.model or Path(subprocess.run(["bash", str(REPO / "scripts/setup.sh"), "--smollm2-path"],
                                                   capture_output=True, text=True, check=True).stdout.strip())
    setup(threads=args.threads)
    bench = args.build / "benchmarks" / "kvpress_bench_generate"
    assert bench.is_file(), f"{bench}: build it first (cmake --build {args.build} --target kvpress_bench_generate)"
    model = AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                                 dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)
    story_ids = tok(" ".join(load_stories(REPO.parent / "shared" / "data" / "tinystories_valid_100.txt")),
                    add_special_tokens=False).input_ids
    meta = run_metadata()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in [int(s) for s in args.seq.split(",")]:
            ids = torch.tensor([(story_ids * (seq // len(story_ids) + 1))[:seq]], dtype=torch.long)
            ids_file = Path(tmp) / f"ids_{seq}.safetensors"
            save_file({"input_ids": ids}, str(ids_file))
            out = subprocess.run([str(bench), str(model_file), str(ids_file), "--decode", str(args.decode),
                                  "--repeats", str(args.repeats), "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout
            ours = json.loads(out.strip().splitlines()[-1])
            prefill, decode, tokens = time_transformers(model, ids, args.decode, args.repeats)
            row = {"seq": seq, "decode_tokens": args.decode,
                   "ours_prefill_tok_s": seq / ours["prefill_s"], "hf_prefill_tok_s": seq / prefill,
                   "ours_decode_tok_s": args.decode / ours["decode_s"], "hf_decode_tok_s": args.decode / decode,
                   "same_tokens": ours["tokens"] == tokens}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nRun {meta['date']}, commit {meta['commit']}, CPU {meta['cpu_model']}, {args.threads} threads, "
          f"float32, {model_file.name}")
    print(f"| tokens | prefill tok/s ours | transformers | ours/transformers | decode tok/s ours | transformers "
          f"| ours/transformers | same greedy tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(f"| {r['seq']} | {r['ours_prefill_tok_s']:.0f} | {r['hf_prefill_tok_s']:.0f} | "
              f"{r['ours_prefill_tok_s'] / r['hf_prefill_tok_s']:.2f} | {r['ours_decode_tok_s']:.1f} | "
              f"{r['hf_decode_tok_s']:.1f} | {r['ours_decode_tok_s'] / r['hf_decode_tok_s']:.2f} | "
              f"{'yes' if r['same_tokens'] else 'no'} |")
    if args.json:
        args.json.write_text(json.dumps({"run": {**meta, "threads": args.threads, "model": str(model_file)},
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
