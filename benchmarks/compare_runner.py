#!/usr/bin/env python3
"""Prefill and decode speed of the kvpress::llama runner against transformers (+ kvpress for a press):
both sides in float32 on the same threads (by default torch's own, every core: what a user gets).

Models:
* default: SmolLM2-135M-Instruct from its GGUF file (issue 32, item 6), dequantised on both sides;
  the ids are held-out stories, tokenized, repeated to S.
* --random-llama: compare_prefill.py's random-weight Llama (issue 35's shape: hidden 1024, 16 query /
  4 KV heads, 8 layers, MLP 2816, vocabulary 2048, seed 0), written as a Hugging Face folder that
  both sides load (with tinystories-656k's tokenizer); compare_prefill.py's random ids.

* transformers' side, in this process: attn_implementation="sdpa" (its default); prefill = one
  forward of the S ids with logits_to_keep=1 into a DynamicCache; decode = N forwards of one token
  each, the previous argmax fed back (greedy). With --press, the same again inside kvpress's
  `with press(model):` (the press compresses in the prefill's forward hooks).
* our side: build/benchmarks/kvpress_bench_generate on the same files (LlamaModel::prefill with
  last_logits_only, then N forward() steps; with --press, the same with PrefillOptions::press), a
  separate process with the same thread count, run right before transformers' side at each length.

Each side reports its fastest of --repeats runs. The press's own cost is the time spent in its
compression inside that prefill, on each side (our kvpress_bench::TimedPress, kvpress's
press.compress wrapped as compare_prefill.py does). The table prints tokens per second of both and their ratio, with
the run's date, commit and CPU; the greedy tokens of both sides are compared (they should agree).

    ~/.cache/kvpress-cpp/venv/bin/python benchmarks/compare_runner.py --seq 512,2048,8192 --threads 2
    ~/.cache/kvpress-cpp/venv/bin/python benchmarks/compare_runner.py --random-llama --seq 512,4096,16384 \
        --decode 8 --repeats 1 --press SnapKVPress --ratio 0.5
"""
import argparse
import json
import os
import shutil
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
import kvpress  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig  # noqa: E402

import kvpress_cpp  # noqa: E402,F401  (registers torch.ops.kvpress: run_metadata reads the kernels' ISA)
from compare_kvpress import run_metadata  # noqa: E402  (date, commit, CPU, kernel ISA)
from compare_prefill import random_model, time_compress  # noqa: E402  (its random-weight Llama, press timing)


def time_transformers(model, ids, decode, repeats, make_press=None):
    """Fastest prefill, the press's compress time inside it, fastest decode, and the last run's
    greedy tokens. make_press: builds a fresh kvpress press per run (None: no press)."""
    best_prefill, best_press, best_decode = float("inf"), 0.0, float("inf")
    tokens = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache()
            press = make_press() if make_press else None
            spent = time_compress(press) if press else [0.0]
            start = time.perf_counter()
            if press is None:
                logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            else:
                with press(model):
                    logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            elapsed = time.perf_counter() - start
            if elapsed < best_prefill:
                best_prefill, best_press = elapsed, spent[0]
            tokens = []
            start = time.perf_counter()
            for step in range(decode):
                nxt = int(logits[0, -1].argmax())
                tokens.append(nxt)
                # The next position, explicitly (as kvpress's pipeline does): a compressed cache is shorter.
                position = torch.tensor([ids.size(1) + step])
                logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, position_ids=position[None],
                               cache_position=position, logits_to_keep=1).logits
            best_decode = min(best_decode, time.perf_counter() - start)
    return best_prefill, best_press, best_decode, tokens


def write_random_llama(folder: Path) -> LlamaConfig:
    """compare_prefill.py's random-weight Llama (seed 0) as a Hugging Face folder, with tinystories-656k's
    tokenizer (the runner's checkpoint loader reads one; the ids are random)."""
    config = random_model(folder, seed=0)
    shutil.copy(REPO.parent / "shared" / "models" / "tinystories-656k" / "tokenizer.json", folder / "tokenizer.json")
    return config


def load_side(args, tmp: Path):
    """(our model argument, transformers' model, ids of length S for each S) for the chosen model."""
    if args.random_llama:
        folder = tmp / "random-llama"
        config = write_random_llama(folder)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        # compare_prefill.py's ids for each length
        return folder, model, lambda seq: torch.randint(0, config.vocab_size, (1, seq),
                                                        generator=torch.Generator().manual_seed(seq))
    model_file = args.model or Path(subprocess.run(["bash", str(REPO / "scripts/setup.sh"), "--smollm2-path"],
                                                   capture_output=True, text=True, check=True).stdout.strip())
    model = AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                                 dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)
    story_ids = tok(" ".join(load_stories(REPO.parent / "shared" / "data" / "tinystories_valid_100.txt")),
                    add_special_tokens=False).input_ids
    return model_file, model, lambda seq: torch.tensor([(story_ids * (seq // len(story_ids) + 1))[:seq]])


def print_table(rows, meta, args, model_name, threads):
    print(f"\nRun {meta['date']}, commit {meta['commit']}, CPU {meta['cpu_model']}, {threads} threads, "
          f"float32, {model_name}")
    print("| tokens | prefill tok/s ours | transformers | ours/transformers | decode tok/s ours | transformers "
          "| ours/transformers | same greedy tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(f"| {r['seq']} | {r['ours_prefill_tok_s']:.0f} | {r['hf_prefill_tok_s']:.0f} | "
              f"{r['ours_prefill_tok_s'] / r['hf_prefill_tok_s']:.2f} | {r['ours_decode_tok_s']:.1f} | "
              f"{r['hf_decode_tok_s']:.1f} | {r['ours_decode_tok_s'] / r['hf_decode_tok_s']:.2f} | "
              f"{'yes' if r['same_tokens'] else 'no'} |")
    if not args.press:
        return
    print(f"\n{args.press} at ratio {args.ratio} (kvpress on transformers' side); the press's own cost: the "
          "time in its compression inside that prefill")
    print("| tokens | prefill s with press, ours | transformers + kvpress | press s, ours | kvpress | "
          "decode tok/s after it, ours | transformers + kvpress | same greedy tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(f"| {r['seq']} | {r['ours_press_prefill_s']:.2f} | {r['hf_press_prefill_s']:.2f} | "
              f"{r['ours_press_s']:.3f} | {r['hf_press_s']:.3f} | {r['ours_press_decode_tok_s']:.1f} | "
              f"{r['hf_press_decode_tok_s']:.1f} | {'yes' if r['same_press_tokens'] else 'no'} |")


def measure(args, bench, model_arg, model, ids, tmp: Path):
    """One row: both sides at one length."""
    seq = ids.size(1)
    ids_file = tmp / f"ids_{seq}.safetensors"
    save_file({"input_ids": ids}, str(ids_file))
    command = [str(bench), str(model_arg), str(ids_file), "--decode", str(args.decode),
               "--repeats", str(args.repeats), "--threads", str(torch.get_num_threads())]
    if args.press:
        command += ["--press", args.press, "--ratio", str(args.ratio)]
    ours = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    prefill, _, decode, tokens = time_transformers(model, ids, args.decode, args.repeats)
    row = {"seq": seq, "decode_tokens": args.decode,
           "ours_prefill_tok_s": seq / ours["prefill_s"], "hf_prefill_tok_s": seq / prefill,
           "ours_decode_tok_s": args.decode / ours["decode_s"], "hf_decode_tok_s": args.decode / decode,
           "same_tokens": ours["tokens"] == tokens, "ours_tokens": ours["tokens"], "hf_tokens": tokens}
    if args.press:
        press_prefill, press_s, press_decode, press_tokens = time_transformers(
            model, ids, args.decode, args.repeats, lambda: getattr(kvpress, args.press)(compression_ratio=args.ratio))
        row.update({"ours_press_prefill_s": ours["press_prefill_s"], "hf_press_prefill_s": press_prefill,
                    "ours_press_s": ours["press_s"], "hf_press_s": press_s,
                    "ours_press_decode_tok_s": args.decode / ours["press_decode_s"],
                    "hf_press_decode_tok_s": args.decode / press_decode,
                    "same_press_tokens": ours["press_tokens"] == press_tokens,
                    "ours_press_tokens": ours["press_tokens"], "hf_press_tokens": press_tokens})
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="the GGUF file (default: scripts/setup.sh's SmolLM2)")
    parser.add_argument("--random-llama", action="store_true", help="issue 35's random-weight Llama instead")
    parser.add_argument("--seq", default="512,2048,8192")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="0 (default): torch's own, every core")
    parser.add_argument("--press", default="", help="a kvpress press class, timed on both sides")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--build", type=Path, default=REPO / "build")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    setup(threads=args.threads or torch.get_num_threads())
    threads = torch.get_num_threads()
    bench = args.build / "benchmarks" / "kvpress_bench_generate"
    assert bench.is_file(), f"{bench}: build it first (cmake --build {args.build} --target kvpress_bench_generate)"
    meta = run_metadata()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_arg, model, ids_of = load_side(args, Path(tmp))
        model_name = "compare_prefill.py's random-weight Llama" if args.random_llama else model_arg.name
        for seq in [int(s) for s in args.seq.split(",")]:
            rows.append(measure(args, bench, model_arg, model, ids_of(seq), Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows, meta, args, model_name, threads)
    if args.json:
        args.json.write_text(json.dumps({"run": {**meta, "threads": threads, "model": model_name,
                                                 "press": args.press, "ratio": args.ratio}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
