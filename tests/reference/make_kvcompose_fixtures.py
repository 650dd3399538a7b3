#!/usr/bin/env python3
"""KVComposePress fixtures: the pinned kvpress's KVCompose on TinyStories-656K.

    python make_kvcompose_fixtures.py --out DIR [--models DIR] [--data FILE]

For each run (structured / unstructured at a few ratios, non-default parameters, a custom task
prompt) kvpress's own mechanism runs: `with press(model): model.model(context, past_key_values=cache)`
(the context's prefill, then the task prompt, by default the context again, over the same cache in
eager mode). We record, before kvpress resets its state:

* scores            [L, Hkv, N] float32  kvpress's enhanced token scores (press.scores)
* per_layer         [L] int64            structured budgets k_l (press.important_per_layer)
* per_head          [L, Hkv] int64       unstructured budgets k_{l,g} (press.important_per_head)
* keep_mask         [L, Hkv, N] bool     structured: the tokens the compressed cache holds (checked
                                         against the cache's keys); unstructured: the complement of
                                         module.masked_key_indices
* decode_tokens, decode_logits           the next token of the story at position N, then greedy tokens,
                                         ONE token per forward at the original positions N, N+1, ...
                                         (a multi-token question would meet HF's causal mask sliced
                                         to a shorter layer, which lets tokens see later ones).

Unstructured: kvpress masks evicted tokens but leaves the task prompt's N keys/values in the cache
(compress_unstructured never truncates it), so its later tokens attend to a second copy of the
context. kvpress-cpp drops them, as the structured variant does. The reference logits are computed
over kvpress's masked cache truncated to the context's N tokens (`decode_logits`); the raw ones,
over the 2N cache, are kept as `decode_logits_untruncated` for information.

CPU only, two threads, float32. Takes a few seconds.
"""

from __future__ import annotations

import time

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (KVPRESS_VERSION, MODEL, greedy_steps, kept_mask, kept_positions, load_model, load_stories,
                    load_tokenizer, model_dir, parse_args, parse_value, prepare_out, save, setup, token_ids,
                    versions, write_json)

import torch
from transformers import DynamicCache

from kvpress import KVComposePress

STORY = 2          # held-out story index
CONTEXT_LEN = 256  # N, BOS included
DECODE_STEPS = 4   # the story's next token, then 3 greedy tokens
PROMPT_STORY = 5   # the custom task prompt: the first PROMPT_LEN tokens of this story
PROMPT_LEN = 48

# (name, KVComposePress parameters as text (kvpress names), custom task prompt?)
RUNS = [
    ("structured_r0.25", {"structured": "true", "compression_ratio": "0.25"}, False),
    ("structured_r0.5", {"structured": "true", "compression_ratio": "0.5"}, False),
    ("structured_r0.75", {"structured": "true", "compression_ratio": "0.75"}, False),
    ("unstructured_r0.25", {"structured": "false", "compression_ratio": "0.25"}, False),
    ("unstructured_r0.5", {"structured": "false", "compression_ratio": "0.5"}, False),
    ("unstructured_r0.75", {"structured": "false", "compression_ratio": "0.75"}, False),
    ("structured_options_r0.5", {"structured": "true", "compression_ratio": "0.5", "agg_task": "mean",
                                 "agg_group": "max", "agg_head": "max", "add_mean_across_heads": "false",
                                 "keep_token_lower_bound": "16"}, False),
    ("unstructured_options_r0.6", {"structured": "false", "compression_ratio": "0.6", "agg_task": "mean",
                                   "agg_group": "max", "add_mean_across_heads": "false"}, False),
    ("structured_prompt_r0.5", {"structured": "true", "compression_ratio": "0.5"}, True),
]


def run_press(model, context, first_token, params: dict, prompt):
    kwargs = {k: parse_value(v) for k, v in params.items()}
    press = KVComposePress(**kwargs)
    n = context.shape[1]
    record = {}
    if prompt is not None:
        # kvpress resets prompt_ids when the context is registered (inside the forward), so a
        # custom prompt must be set right after that.
        register = press.register_context_ids

        def register_then_prompt(ids):
            register(ids)
            press.register_prompt_ids([prompt])

        press.register_context_ids = register_then_prompt

    compress_cache = press.compress_cache

    def spy(m):
        record["scores"] = press.scores.detach().to(torch.float32).clone().contiguous()
        record["per_layer"] = torch.as_tensor(press.important_per_layer, dtype=torch.int64).contiguous()
        record["per_head"] = torch.as_tensor(press.important_per_head, dtype=torch.int64).contiguous()
        record["cache_lengths"] = [layer.keys.shape[2] for layer in press.cache.layers]
        full_keys = [layer.keys[:, :, :n].clone() for layer in press.cache.layers]
        compress_cache(m)
        masks = []
        for li, layer in enumerate(m.model.layers):
            if press.structured:
                # The compressed cache's rows: find each kept key among the context's keys.
                kept = kept_positions(full_keys[li], None, press.cache.layers[li].keys, None)  # [1, Hkv, k_l]
                masks.append(kept_mask(kept, n)[0])
            else:
                b, h, s = layer.self_attn.masked_key_indices
                assert bool((b == 0).all()) and bool((s < n).all())
                mask = torch.ones(model.config.num_key_value_heads, n, dtype=torch.bool)
                mask[h, s] = False
                masks.append(mask)
        record["keep_mask"] = torch.stack(masks).contiguous()

    press.compress_cache = spy
    # An earlier unstructured run leaves its masks on the attention modules; kvpress clears them in
    # the patched (non-eager) attention at a square prefill, but KVCompose prefills in eager mode.
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    with torch.no_grad():
        cache = DynamicCache()
        with press(model):
            model.model(input_ids=context, past_key_values=cache)
        tensors = {k: record[k] for k in ("scores", "per_layer", "per_head", "keep_mask")}
        lengths = [layer.keys.shape[2] for layer in cache.layers]
        if press.structured:
            assert lengths == record["per_layer"].tolist(), (lengths, record["per_layer"])
        else:
            assert lengths == [2 * n if prompt is None else n + prompt.shape[1]] * len(lengths), lengths
            untruncated = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
            _, tensors["decode_logits_untruncated"] = greedy_steps(model, cache, first_token, n, DECODE_STEPS)
            for layer, (k, v) in zip(cache.layers, untruncated):
                layer.keys, layer.values = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
        tensors["decode_tokens"], tensors["decode_logits"] = greedy_steps(model, cache, first_token, n, DECODE_STEPS)
    return tensors, record["cache_lengths"]


def main():
    args = parse_args(__doc__)
    path = model_dir(args.models)
    start = setup(threads=2)
    out = prepare_out(args.out)

    stories = load_stories(args.data)
    tok = load_tokenizer(path)
    # sdpa outside the press (kvpress switches to eager for its own pass): kvpress's attention patch,
    # which applies the unstructured variant's masks, wraps the non-eager attention functions only.
    model = load_model(path, "sdpa")
    ids = token_ids(tok, stories[STORY])
    assert ids.shape[1] > CONTEXT_LEN, ids.shape
    context, first_token = ids[:, :CONTEXT_LEN].contiguous(), ids[0, CONTEXT_LEN]
    prompt = token_ids(tok, stories[PROMPT_STORY])[:, :PROMPT_LEN].contiguous()
    assert prompt.shape[1] == PROMPT_LEN

    with torch.no_grad():
        cache = DynamicCache()
        model.model(input_ids=context, past_key_values=cache)
        _, full_logits = greedy_steps(model, cache, first_token, CONTEXT_LEN, DECODE_STEPS)
    save({"context_ids": context, "prompt_ids": prompt, "full_decode_logits": full_logits}, out / "inputs.safetensors")

    runs = []
    for name, params, custom_prompt in RUNS:
        tensors, cache_lengths = run_press(model, context, first_token, params, prompt if custom_prompt else None)
        save(tensors, out / f"{name}.safetensors")
        runs.append({"name": name, "file": f"{name}.safetensors",
                     "params": {k: v for k, v in params.items() if k != "compression_ratio"},
                     "compression_ratio": float(params["compression_ratio"]), "custom_prompt": custom_prompt,
                     "cache_lengths_before_compression": cache_lengths})

    manifest = {
        **versions(),
        "model": MODEL,
        "dtype": "float32",
        "story": STORY,
        "context_len": CONTEXT_LEN,
        "decode_steps": DECODE_STEPS,
        "inputs": "inputs.safetensors",
        "runs": runs,
    }
    write_json(out / "manifest.json", manifest)
    print(f"make_kvcompose_fixtures: kvpress {KVPRESS_VERSION}: {len(runs)} runs in {out} "
          f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
