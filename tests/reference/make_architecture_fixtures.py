#!/usr/bin/env python3
"""Architecture fixtures: random-weight models of the configurations the runner loads, as Hugging
Face folders, with transformers' logits on them.

    python make_architecture_fixtures.py --out DIR [--models DIR] [--data FILE]

Per model, a folder <name>/ (config.json and model.safetensors from save_pretrained) and
<name>/logits.safetensors: transformers' float32 eager logits of a prefill of 1, 100 and 4096 random
token ids (`ids_<n>`, `logits_<n>`, [1, n] and [1, n, vocab]), and a control that shows the
model's feature matters (so a runner that ignored it could not pass): `logits_4096_unscaled`, the
same weights with the default RoPE, for the scaled models (the scaling must matter at that length);
`logits_100_as_llama`, transformers' LlamaForCausalLM on the same weights without the family's
extras (biases, q/k norms), for the others. Models (2 layers, 8 query / 2 KV heads, head_dim 32,
vocabulary 1000, seeded):

* llama3_rope   Llama with Llama 3.1's RoPE scaling (rope_type llama3, factor 8, low/high frequency
                factors 1 and 4, original context 256: at 4096 tokens every band is exercised)
* linear_rope   Llama with linear RoPE scaling (factor 4)
* mistral       MistralForCausalLM (model_type mistral, sliding_window null: Llama's computation)
* llama_bias    Llama with attention_bias true (q/k/v and o_proj biases)
* qwen2         Qwen2ForCausalLM (q/k/v biases, no o_proj bias)
* qwen3         Qwen3ForCausalLM (per-head q_norm/k_norm before RoPE), tied embeddings as Qwen3-0.6B

Biases and norm weights are drawn at random (transformers initialises them to 0 and 1, which
would hide a runner that dropped them). Takes a few seconds.
"""

from __future__ import annotations

import time

# First: importing common checks the pinned kvpress version (the reference stack's pin).
from common import parse_args, perturb_biases_and_norms, prepare_out, save, setup, versions, write_json

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

LENGTHS = (1, 100, 4096)
DEFAULT_ROPE = {"rope_type": "default"}
MODELS = {  # name -> (family, RoPE scaling, extra config fields)
    "llama3_rope": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 256}, {}),
    "linear_rope": ("llama", {"rope_type": "linear", "factor": 4.0}, {}),
    "mistral": ("mistral", DEFAULT_ROPE, {"sliding_window": None}),
    "llama_bias": ("llama", DEFAULT_ROPE, {"attention_bias": True}),
    "qwen2": ("qwen2", DEFAULT_ROPE, {"use_sliding_window": False}),
    "qwen3": ("qwen3", DEFAULT_ROPE, {"use_sliding_window": False, "tie_word_embeddings": True}),
}
CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
           "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def build(family: str, scaling: dict, extra: dict, seed: int, vocab_size: int = 1000):
    config_class, model_class = CLASSES[family]
    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, rope_theta=500000.0,
                  rope_scaling=scaling, initializer_range=0.08, tie_word_embeddings=False,
                  attn_implementation="eager")
    model = model_class(config_class(**{**fields, **extra})).eval()
    perturb_biases_and_norms(model)
    return model


def as_llama(model):
    """LlamaForCausalLM on `model`'s weights without its family's extras: what a runner that ignored
    them would compute."""
    c = model.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position_embeddings, rope_theta=500000.0,
                         rope_scaling=DEFAULT_ROPE, tie_word_embeddings=c.tie_word_embeddings,
                         attn_implementation="eager")
    llama = LlamaForCausalLM(config).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith((".bias", "q_norm.weight", "k_norm.weight"))}
    missing, unexpected = llama.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return llama


def main() -> None:
    args = parse_args(__doc__)
    start = setup(threads=2)
    out = prepare_out(args.out)
    for seed, (name, (family, scaling, extra)) in enumerate(MODELS.items()):
        model = build(family, scaling, extra, seed)
        folder = prepare_out(out / name)
        model.save_pretrained(folder, safe_serialization=True)
        tensors = {}
        generator = torch.Generator().manual_seed(100 + seed)
        for n in LENGTHS:
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=generator)
            with torch.no_grad():
                tensors[f"ids_{n}"] = ids
                tensors[f"logits_{n}"] = model(input_ids=ids).logits.float()
        # The control: the test checks that it differs from the logits by far more than the tolerance.
        with torch.no_grad():
            if scaling["rope_type"] != "default":
                unscaled = build(family, DEFAULT_ROPE, extra, seed)
                tensors["logits_4096_unscaled"] = unscaled(input_ids=tensors["ids_4096"]).logits.float()
            elif family != "mistral":
                tensors["logits_100_as_llama"] = as_llama(model)(input_ids=tensors["ids_100"]).logits.float()
        save(tensors, folder / "logits.safetensors")
    write_json(out / "manifest.json", {**versions(), "models": list(MODELS), "lengths": list(LENGTHS)})
    print(f"make_architecture_fixtures: {len(MODELS)} models x lengths {LENGTHS} in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
