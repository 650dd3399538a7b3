#!/usr/bin/env python3
"""Architecture fixtures: random-weight models of the configurations the runner loads, as Hugging
Face folders, with transformers' logits on them.

    python make_architecture_fixtures.py --out DIR [--models DIR] [--data FILE]

Per model, a folder <name>/ (config.json and model.safetensors from save_pretrained) and
<name>/logits.safetensors: transformers' float32 eager logits of a prefill of 1, 100 and 4096 random
token ids (`ids_<n>`, `logits_<n>`, [1, n] and [1, n, vocab]), and `logits_4096_unscaled`: the same
weights with the default RoPE, for the scaled models (the scaling must matter at that length). Models (2 layers, 8 query / 2 KV
heads, head_dim 32, vocabulary 1000, seeded):

* llama3_rope   Llama with Llama 3.1's RoPE scaling (rope_type llama3, factor 8, low/high frequency
                factors 1 and 4, original context 256: at 4096 tokens every band is exercised)
* linear_rope   Llama with linear RoPE scaling (factor 4)
* mistral       MistralForCausalLM (model_type mistral, sliding_window null: Llama's computation)

Issue 32 adds Qwen2 (attention biases) and Qwen3 (q/k norms) here. Takes a few seconds.
"""

from __future__ import annotations

import time

# First: importing common checks the pinned kvpress version (the reference stack's pin).
from common import parse_args, prepare_out, save, setup, versions, write_json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

LENGTHS = (1, 100, 4096)
MODELS = {  # name -> (transformers' config and model classes, RoPE scaling)
    "llama3_rope": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 256}),
    "linear_rope": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "mistral": ("mistral", {"rope_type": "default"}),
}
CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}


def build(family: str, scaling: dict, seed: int):
    config_class, model_class = CLASSES[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, rope_theta=500000.0,
        rope_scaling=scaling, initializer_range=0.08, tie_word_embeddings=False, attn_implementation="eager", **extra)
    return model_class(config).eval()


def main() -> None:
    args = parse_args(__doc__)
    start = setup(threads=2)
    out = prepare_out(args.out)
    for seed, (name, (family, scaling)) in enumerate(MODELS.items()):
        model = build(family, scaling, seed)
        folder = prepare_out(out / name)
        model.save_pretrained(folder, safe_serialization=True)
        tensors = {}
        generator = torch.Generator().manual_seed(100 + seed)
        for n in LENGTHS:
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=generator)
            with torch.no_grad():
                tensors[f"ids_{n}"] = ids
                tensors[f"logits_{n}"] = model(input_ids=ids).logits.float()
        # The same weights without the scaling: the test checks that the scaling changes the logits
        # at 4096 tokens by far more than its tolerance (so ignoring it could not pass).
        if scaling["rope_type"] != "default":
            unscaled = build(family, {"rope_type": "default"}, seed)
            with torch.no_grad():
                tensors["logits_4096_unscaled"] = unscaled(input_ids=tensors["ids_4096"]).logits.float()
        save(tensors, folder / "logits.safetensors")
    write_json(out / "manifest.json", {**versions(), "models": list(MODELS), "lengths": list(LENGTHS)})
    print(f"make_architecture_fixtures: {len(MODELS)} models x lengths {LENGTHS} in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
