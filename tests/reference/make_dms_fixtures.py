#!/usr/bin/env python3
"""DMSPress fixtures: the pinned kvpress's DMSPress in TinyStories-656K's loop.

    python make_dms_fixtures.py --out DIR [--models DIR] [--data FILE]

As kvpress's pipeline runs a DMSPress: the context prefilled inside `with press(model)`, then,
inside `with press(model)` again when the press has decoding=True (the pipeline's rule for it), the
question in one forward at the original positions and greedy tokens one at a time. The press's
window of scores lives on between the two blocks (kvpress resets it only at a prefill), and its
evictions are module.masked_key_indices, applied by kvpress's attention patch (sdpa model). Runs:
inner KnormPress and KVzapPress (a linear surrogate scripts/make_artifact.py kvzap fits on the first
20 stories, saved as kvzap/), with and without decoding, windows of 16 and 0. Thresholds are
quantiles of the inner scores over the context (computed here, recorded in the manifest), so that
a real fraction is evicted. Each run's file: context_ids, question_ids, tokens (the greedy tokens
fed), logits [steps, V] (the question's last position, then every greedy step), prefill_mask and
final_mask [L, Hkv, positions] (the complement of masked_key_indices after the prefill and at the
end). CPU, one thread, float32. A few seconds.
"""

from __future__ import annotations

import sys
import time

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (KVPRESS_VERSION, MODEL, REPO, load_model, load_stories, load_tokenizer, model_dir, parse_args,
                    prepare_out, question_then_greedy, save, setup, token_ids, versions, write_json)

import torch
from transformers import DynamicCache

from kvpress import DMSPress, KnormPress, KVzapPress
from kvpress.presses.kvzap_press import KVzapModel

sys.path.insert(0, str(REPO / "scripts"))
import make_artifact  # noqa: E402 (scripts/ is not a package)

STORY, CONTEXT_LEN, QUESTION_LEN, NEW_TOKENS = 3, 100, 8, 20
KVZAP_FOLDER = "kvzap"

# (name, inner press, C++ inner parameters, threshold quantile, sliding_window_size, decoding)
RUNS = [
    ("knorm_w16_decoding", "KnormPress", {}, 0.4, 16, True),
    ("knorm_w16_prefill_only", "KnormPress", {}, 0.4, 16, False),
    ("knorm_w0_decoding", "KnormPress", {}, 0.3, 0, True),
    ("kvzap_w16_decoding", "KVzapPress", {"model_type": "linear", "kvzap_model": KVZAP_FOLDER}, 0.5, 16, True),
]


def masks(model, length: int) -> torch.Tensor:
    """[L, Hkv, length] bool: False where a layer's masked_key_indices hide a position."""
    out = torch.ones(model.config.num_hidden_layers, model.config.num_key_value_heads, length, dtype=torch.bool)
    for i, layer in enumerate(model.model.layers):
        indices = getattr(layer.self_attn, "masked_key_indices", None)
        if indices is not None:
            b, h, s = indices
            assert bool((b == 0).all())
            out[i, h, s] = False
    return out


def inner_press(name: str, surrogate):
    if name == "KnormPress":
        return KnormPress()
    press = KVzapPress(model_type="linear")
    press.kvzap_model = surrogate
    press.post_init_from_model = lambda model: None  # what would download it
    return press


def threshold_for(model, context, press, quantile: float) -> float:
    """The quantile of the inner press's scores over the context, every layer, rounded."""
    scores = []

    def hook(module, args, kwargs, output):
        keys = kwargs["past_key_values"].layers[module.layer_idx].keys
        values = kwargs["past_key_values"].layers[module.layer_idx].values
        scores.append(press.score(module, kwargs["hidden_states"], keys, values, None, kwargs).flatten())

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model.model(input_ids=context, past_key_values=DynamicCache())
    finally:
        for handle in hooks:
            handle.remove()
    return round(float(torch.cat(scores).float().quantile(quantile)), 4)


def run_press(model, context, question, press, decoding: bool):
    n = context.shape[1]
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    with torch.no_grad():
        cache = DynamicCache()
        with press(model):
            model.model(input_ids=context, past_key_values=cache)
        prefill_mask = masks(model, n)
        with press(model) if decoding else torch.no_grad():
            tokens, logits = question_then_greedy(model, cache, question, n, NEW_TOKENS)
        final_mask = masks(model, n + question.shape[1] + NEW_TOKENS - 1)
    return {"prefill_mask": prefill_mask, "final_mask": final_mask, "tokens": tokens, "logits": logits}


def main():
    args = parse_args(__doc__)
    path = model_dir(args.models)
    start = setup(threads=1)
    out = prepare_out(args.out)
    stories = load_stories(args.data)
    tok = load_tokenizer(path)
    model = load_model(path, "sdpa")
    eager = load_model(path, "eager")
    surrogate, _ = make_artifact.train_kvzap(eager, tok, stories, num_train=20, num_test=1, model_type="linear")
    make_artifact.save_kvzap_folder(out / KVZAP_FOLDER, surrogate, {"recipe": "make_artifact.py kvzap, 20 stories"})
    surrogate = KVzapModel.from_pretrained(str(out / KVZAP_FOLDER))

    ids = token_ids(tok, stories[STORY])
    assert ids.shape[1] >= CONTEXT_LEN + QUESTION_LEN
    context = ids[:, :CONTEXT_LEN].contiguous()
    question = ids[:, CONTEXT_LEN:CONTEXT_LEN + QUESTION_LEN].contiguous()
    save({"context_ids": context, "question_ids": question}, out / "inputs.safetensors")
    runs = []
    for name, inner, inner_params, quantile, window, decoding in RUNS:
        threshold = threshold_for(model, context, inner_press(inner, surrogate), quantile)
        press = DMSPress(inner_press(inner, surrogate), threshold=threshold, sliding_window_size=window,
                         decoding=decoding)
        tensors = run_press(model, context, question, press, decoding)
        save(tensors, out / f"{name}.safetensors")
        params = {"press": inner, **{f"press.{k}": v for k, v in inner_params.items()}, "threshold": str(threshold),
                  "sliding_window_size": str(window), "decoding": str(decoding).lower()}
        evicted = int((~tensors["final_mask"]).sum())
        runs.append({"name": name, "file": f"{name}.safetensors", "params": params, "evicted": evicted})
        print(f"  {name}: threshold {threshold}, {evicted} evicted of "
              f"{tensors['final_mask'].numel()} (prefill {int((~tensors['prefill_mask']).sum())})")
    write_json(out / "manifest.json", {**versions(), "model": MODEL, "dtype": "float32", "story": STORY,
                                       "inputs": "inputs.safetensors", "runs": runs})
    print(f"make_dms_fixtures: kvpress {KVPRESS_VERSION}: {len(runs)} runs in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
