#!/usr/bin/env python3
"""kvpress's own KVPressTextGenerationPipeline with and without kvpress_cpp.accelerate(): the time
spent in compression and end to end, press by press (issue 16, item 4).

The pipeline runs as a kvpress user runs it: `pipe(context, question=..., press=press,
max_new_tokens=N)` on the random-weight Llama of compare_prefill.py (hidden 1024, 16 query / 4 KV
heads, head_dim 64, 8 layers, vocabulary 2048, float32, sdpa attention) with the bundled
TinyStories-656K tokenizer (the same 2048 tokens), over a long synthetic context: the held-out
stories repeated until --tokens tokens. For each press and side (kvpress's Python, then accelerated)
it reports the fastest of --repeats calls: the press's compress time summed over the layers
(measured by wrapping compress on the instance, which kvpress's forward hook calls) and the whole
call (tokenisation, prefill with compression, the question and the answer's tokens).

    ~/.cache/kvpress-cpp/venv/bin/python benchmarks/compare_pipeline.py --tokens 4096,16384

Needs the Python package installed (pip install ./python). docs/PERFORMANCE.md, "Pipeline".
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from compare_prefill import random_model  # noqa: E402  (the model compare_prefill.py times)
from common import setup  # noqa: E402  (tests/reference/common.py: threads, seed, quiet logging)

import kvpress  # noqa: E402
import kvpress_cpp  # noqa: E402
import torch  # noqa: E402
from transformers import pipeline  # noqa: E402

DEFAULT_PRESSES = ["KnormPress", "StreamingLLMPress", "SnapKVPress", "TOVAPress", "ExpectedAttentionPress",
                   "NonCausalAttnPress"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
QUESTION = "What did the little girl find in the garden?"


def synthetic_context(tokenizer, data: Path, tokens: int) -> str:
    """The held-out stories, repeated, cut to `tokens` tokens and decoded back to text."""
    text = data.read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    return tokenizer.decode(ids)


def time_call(pipe, context, press, max_new_tokens, repeats):
    """(fastest call s, the press's compress time inside that call)."""
    best = (float("inf"), 0.0)
    for _ in range(repeats):
        spent = [0.0]

        def timed(*args, _press=press, **kwargs):
            start = time.perf_counter()
            result = type(_press).compress(_press, *args, **kwargs)  # accelerated or not, as now patched
            spent[0] += time.perf_counter() - start
            return result

        press.compress = timed
        start = time.perf_counter()
        pipe(context, question=QUESTION, press=press, max_new_tokens=max_new_tokens)
        elapsed = time.perf_counter() - start
        del press.compress
        best = min(best, (elapsed, spent[0]))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096", help="comma-separated context lengths in tokens")
    parser.add_argument("--presses", default=",".join(DEFAULT_PRESSES))
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", type=Path, default=Path(os.environ.get("KVPRESS_MODELS", REPO.parent.parent / "shared" / "models")))
    parser.add_argument("--data", type=Path, default=None, help="held-out text (default: MODELS/../data/tinystories_valid_100.txt)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    setup(args.threads)
    data = args.data or args.models.parent / "data" / "tinystories_valid_100.txt"
    print(f"# threads {args.threads}, ratio {args.ratio}, fastest of {args.repeats}, max_new_tokens "
          f"{args.max_new_tokens}, load {os.getloadavg()[0]:.2f}, torch {torch.__version__}, kvpress_cpp "
          f"{kvpress_cpp.__version__}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpress_pipeline_") as tmp:
        path = Path(tmp)
        random_model(path, seed=0)
        for name in TOKENIZER_FILES:
            (path / name).write_bytes((args.models / "tinystories-656k" / name).read_bytes())
        pipe = pipeline("kv-press-text-generation", model=str(path), dtype=torch.float32,
                        model_kwargs={"attn_implementation": "sdpa"})
        for tokens in [int(t) for t in args.tokens.split(",")]:
            context = synthetic_context(pipe.tokenizer, data, tokens)
            print(f"\n## context {tokens} tokens\n")
            print("| press | kvpress compress (s) | accelerated compress (s) | compress speedup | kvpress end to end (s) "
                  "| accelerated end to end (s) | end-to-end speedup |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for name in args.presses.split(","):
                press = getattr(kvpress, name)(compression_ratio=args.ratio)
                plain = time_call(pipe, context, press, args.max_new_tokens, args.repeats)
                with kvpress_cpp.accelerate() as handle:
                    fast = time_call(pipe, context, press, args.max_new_tokens, args.repeats)
                if handle.fallbacks:
                    print(f"  ({name}: {handle.fallbacks} calls fell back: {handle.fallback_reasons})")
                row = dict(tokens=tokens, press=name, kvpress_compress_s=plain[1], accelerated_compress_s=fast[1],
                           kvpress_total_s=plain[0], accelerated_total_s=fast[0])
                rows.append(row)
                print(f"| {name} | {plain[1]:.3f} | {fast[1]:.3f} | {plain[1] / max(fast[1], 1e-9):.2f}x | "
                      f"{plain[0]:.3f} | {fast[0]:.3f} | {plain[0] / fast[0]:.2f}x |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
