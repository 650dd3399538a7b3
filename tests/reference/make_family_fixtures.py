#!/usr/bin/env python3
"""Press parity on the model families real checkpoints use: make_model_fixtures.py's press runs on
random-weight Llama 3, Qwen2 and Qwen3 models.

    python make_family_fixtures.py --out DIR [--models DIR] [--data FILE]

Per family, a model built as make_architecture_fixtures.py builds it (2 layers, 8 query / 2 KV
heads, head_dim 32, random biases and norm weights) but with TinyStories-656K's vocabulary (2048
tokens), so that the bundled tokenizer and held-out stories give its prompts and its artifacts:

* llama3   Llama with Llama 3.1's RoPE scaling (original context 256: the prompts reach every band)
* qwen2    Qwen2 (q/k/v biases: the presses' recomputed queries and keys carry them)
* qwen3    Qwen3 (per-head q_norm / k_norm before RoPE), tied embeddings

written to <out>/<family>/model/ (save_pretrained; the C++ test loads this folder, and so does the
reference below, eager and SDPA), then exactly make_model_fixtures.py's prompt runs (kvpress's
forward hook at prefill, the question and greedy decode at kvpress's pipeline positions) for its
PRESSES, with the filters, statistics and surrogate scripts/make_artifact.py computes for that model,
into <out>/<family>/ with a manifest.json of the same form (tests/test_llama.cpp,
Families/LlamaPressRun.*). CPU only, two threads, deterministic.
"""

from __future__ import annotations

import sys
import time

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import MODEL, PROMPTS, load_stories, load_tokenizer, model_dir, parse_args, prepare_out, save, setup, \
    versions, write_json

import common
import torch
from transformers import AutoModelForCausalLM

import make_architecture_fixtures as architectures
import make_model_fixtures as runs

sys.path.insert(0, str(common.REPO / "scripts"))
import make_artifact  # noqa: E402 (scripts/ is not a package)

FAMILIES = {  # name -> make_architecture_fixtures.MODELS entry
    "llama3": architectures.MODELS["llama3_rope"],
    "qwen2": architectures.MODELS["qwen2"],
    "qwen3": architectures.MODELS["qwen3"],
}


def main() -> None:
    args = parse_args(__doc__)
    path = model_dir(args.models)
    start = setup(threads=2)
    out = prepare_out(args.out)
    stories = load_stories(args.data)
    tok = load_tokenizer(path)
    total = 0
    for seed, (name, (family, scaling, extra)) in enumerate(FAMILIES.items()):
        folder = prepare_out(out / name)
        built = architectures.build(family, scaling, extra, seed, vocab_size=tok.vocab_size)
        built.save_pretrained(folder / "model", safe_serialization=True)
        model, sdpa_model = (AutoModelForCausalLM.from_pretrained(str(folder / "model"), attn_implementation=a).eval()
                             for a in ("eager", "sdpa"))
        filters, _ = make_artifact.qfilters(sdpa_model, tok, stories)
        save({"q_filters": filters}, folder / runs.QFILTERS_FILE)
        mean, cov, _ = make_artifact.expected_attention_stats(sdpa_model, tok, stories, sample_seq_len=1000, n_sink=4)
        make_artifact.save_stats_folder(folder / runs.STATS_FOLDER, mean, cov,
                                        {"dataset_name": str(args.data), "model_name": name, "num_samples": 100,
                                         "sample_seq_len": 1000, "n_sink": 4})
        surrogate, fit = make_artifact.train_kvzap(model, tok, stories, num_train=80, num_test=10, model_type="mlp")
        make_artifact.save_kvzap_folder(folder / runs.KVZAP_FOLDER, surrogate, fit)
        common.ARTIFACT_DIR = folder
        prompts = []
        for prompt in PROMPTS:
            entry, stats = runs.prompt_fixture(folder, model, sdpa_model, tok, stories, prompt)
            prompts.append(entry)
            total += stats["runs"]
        write_json(folder / "manifest.json", {**versions(), "family": family, "model": "model", "tokenizer": MODEL,
                                              "dtype": "float32", "attn_implementation": "eager",
                                              "stories_file": args.data.name, "prompts": prompts})
    print(f"make_family_fixtures: {len(FAMILIES)} families, {total} press runs in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
