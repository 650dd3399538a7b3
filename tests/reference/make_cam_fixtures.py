#!/usr/bin/env python3
"""CAMPress fixtures: the pinned kvpress's CAMPress in TinyStories-656K's loop.

    python make_cam_fixtures.py --out DIR [--models DIR] [--data FILE]

As kvpress's pipeline runs a DecodingPress: the context prefilled without compression, then,
inside `with press(model)`, the question in one forward at the original positions and greedy
tokens one at a time. CAMPress's merges draw from torch's default generator (torch.bernoulli), so
it is seeded (SEED) right before the block; kvpress-cpp seeds at::manual_seed the same. Small
intervals and targets so that every layer compresses several times. Each run's file: tokens (fed
after the question), logits [steps, V], and each layer's final keys_<l> / values_<l> (CAM keeps
its cache in position order, as kvpress-cpp does, so they compare directly; values carry the
merges). CPU, one thread, float32 (sdpa: the press recomputes the last query's attention, and
eager: it reads the model's weights). A few seconds.
"""

from __future__ import annotations

import time

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (KVPRESS_VERSION, MODEL, load_model, load_stories, load_tokenizer, model_dir, parse_args,
                    prepare_out, question_then_greedy, save, setup, token_ids, versions, write_json)

import torch
from transformers import DynamicCache

from kvpress import CAMPress, KeyDiffPress, KnormPress

STORY, CONTEXT_LEN, QUESTION_LEN, NEW_TOKENS = 3, 60, 8, 20
SEED = 1234

# (name, C++ params, kvpress press factory, attention implementation)
RUNS = [
    ("cam_knorm", {"press": "KnormPress", "compression_interval": "4", "target_size": "40",
                   "hidden_states_buffer_size": "4", "merge_budget": "4"},
     lambda: CAMPress(KnormPress(), compression_interval=4, target_size=40, hidden_states_buffer_size=4,
                      merge_budget=4), "sdpa"),
    ("cam_keydiff_budget32", {"press": "KeyDiffPress", "compression_interval": "3", "target_size": "48",
                              "hidden_states_buffer_size": "0"},
     lambda: CAMPress(KeyDiffPress(), compression_interval=3, target_size=48, hidden_states_buffer_size=0), "sdpa"),
    ("cam_knorm_eager", {"press": "KnormPress", "compression_interval": "5", "target_size": "36",
                         "merge_budget": "8"},
     lambda: CAMPress(KnormPress(), compression_interval=5, target_size=36, merge_budget=8), "eager"),
]


def run_press(model, context, question, press):
    n = context.shape[1]
    with torch.no_grad():
        cache = DynamicCache()
        model.model(input_ids=context, past_key_values=cache)
        torch.manual_seed(SEED)
        with press(model):
            tokens, logits = question_then_greedy(model, cache, question, n, NEW_TOKENS)
    tensors = {"tokens": tokens, "logits": logits}
    for l, layer in enumerate(cache.layers):
        tensors[f"keys_{l}"] = layer.keys.contiguous()
        tensors[f"values_{l}"] = layer.values.contiguous()
    return tensors


def main():
    args = parse_args(__doc__)
    path = model_dir(args.models)
    start = setup(threads=1)
    out = prepare_out(args.out)
    tok = load_tokenizer(path)
    models = {impl: load_model(path, impl) for impl in ("sdpa", "eager")}
    ids = token_ids(tok, load_stories(args.data)[STORY])
    context = ids[:, :CONTEXT_LEN].contiguous()
    question = ids[:, CONTEXT_LEN:CONTEXT_LEN + QUESTION_LEN].contiguous()
    save({"context_ids": context, "question_ids": question}, out / "inputs.safetensors")
    runs = []
    for name, params, factory, attn in RUNS:
        tensors = run_press(models[attn], context, question, factory())
        save(tensors, out / f"{name}.safetensors")
        lengths = [int(tensors[f"keys_{l}"].shape[2]) for l in range(models[attn].config.num_hidden_layers)]
        runs.append({"name": name, "file": f"{name}.safetensors", "params": params, "attn_implementation": attn,
                     "final_lengths": lengths})
        print(f"  {name}: final cache lengths {lengths}")
    write_json(out / "manifest.json", {**versions(), "model": MODEL, "dtype": "float32", "story": STORY,
                                       "seed": SEED, "inputs": "inputs.safetensors", "runs": runs})
    print(f"make_cam_fixtures: kvpress {KVPRESS_VERSION}: {len(runs)} runs in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
