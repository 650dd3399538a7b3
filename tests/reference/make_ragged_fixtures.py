#!/usr/bin/env python3
"""Parity fixtures for the presses with head or layer budgets, produced by the pinned kvpress.

    python make_ragged_fixtures.py --out DIR [--models DIR] [--data FILE]

Presses: AdaKVPress, CriticalKVPress, CriticalAdaKVPress, PyramidKVPress,
PerLayerCompressionPress, LUKVPress (budget curves as .npy as LU-KV publishes them, given to
kvpress, and their conversion by scripts/make_artifact.py lukv-curve, given to kvpress-cpp: seeded
random ones for the layer runs, and for TinyStories-656K one profiled by make_artifact.py's lukv
recipe on 8 stories), DuoAttentionPress (pattern folders: random ones, and for TinyStories-656K
scripts/make_artifact.py's on-the-fly recipe, checked against kvpress's duo_attention_on_the_fly). Each run goes through kvpress's own mechanism on a model with SDPA
attention (kvpress's AdaKV refuses eager): `with press(model): model(prefix, past_key_values=cache)`,
then new tokens at the original positions (kvpress's pipeline), one token per forward
(transformers cannot build a multi-token mask over layers of different lengths), through kvpress's
patched attention (attention_patch: masked keys replaced by fake keys).

* layer runs: random-weight Llama (3 layers, 8 query / 2 KV heads, head_dim 64 or 128, float32 or
  bfloat16, batch 1 or 2). `<case>.inputs.safetensors` holds what kvpress's hook sees in every
  layer (keys/values/hidden_states/projection weights, shared cos/sin/inv_freq); each
  `<run>.safetensors` holds per layer l: `kept_l` (bool [B, Hkv, S]: the complement of
  `module.masked_key_indices` for masked presses, the positions of the returned cache rows for
  the others), and for the new tokens `q_new_l` [B, Hq, n, D] (post-RoPE queries), `k_new_l`,
  `v_new_l` [B, Hkv, n, D] and `out_l` [B, Hq, n, D] (kvpress's attention output over its masked
  or shrunk cache, before o_proj).
* model runs: TinyStories-656K (SDPA, float32), the prompts of make_model_fixtures.py: per layer
  `kept_l`, then the question and greedy decode logits (`question_logits`, `decode_tokens`,
  `decode_logits`) over the compressed cache.
* manifest.json: what is where (tests/test_ragged_presses.cpp reads it).

CPU only, one thread, deterministic.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (DTYPE_NAMES, PROMPTS, SHORT_DTYPE, build_press, capture, decode_tail, inv_freq, kept_mask,
                    kept_positions, load_model, load_stories, load_tokenizer, model_dir, parse_args, prepare_out,
                    random_llama, save, setup, token_ids, versions, write_json)

import common
import numpy as np

sys.path.insert(0, str(common.REPO / "scripts"))
import make_artifact  # noqa: E402 (scripts/ is not a package)

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvpress

MASKED = ("AdaKVPress", "CriticalAdaKVPress", "LUKVPress", "DuoAttentionPress")
# LUKVPress's budget curves (no published curve fits these models), in the output folder: seeded random
# prune fractions [99, num_layers, Hkv] around each target ratio for the random layers
# (write_budget_curves); for TinyStories-656K, LU-KV's profiling (write_model_curves).
RANDOM_CURVES = "lukv_curves_random.safetensors"
MODEL_CURVES = "lukv_curves_tinystories.safetensors"
# DuoAttentionPress's patterns (the DuoAttention repository's folder layout): seeded random head
# scores for the random models (sink 16, recent 64); for TinyStories-656K the pattern
# scripts/make_artifact.py computes by kvpress's on-the-fly recipe, checked against kvpress's own
# duo_attention_on_the_fly on the same stories (main()).
RANDOM_PATTERN = "duo_pattern_random"
MODEL_PATTERN = "duo_pattern_tinystories"
N_NEW = 3  # new tokens after the compressed prefix (layer runs)

# (press, parameters in the C++ registry's syntax, ratios). PerLayerCompressionPress's ratio is the
# mean of its list (None here).
LAYER_RUNS = [
    ("AdaKVPress", {"press": "KnormPress"}, (0.5, 0.75)),
    ("AdaKVPress", {"press": "SnapKVPress", "press.window_size": "16"}, (0.5,)),
    ("AdaKVPress", {"press": "ExpectedAttentionPress", "press.epsilon": "0.01"}, (0.5,)),
    ("AdaKVPress", {"press": "KeyDiffPress", "alpha_safeguard": "0.5"}, (0.5,)),
    ("AdaKVPress", {"press": "KnormPress", "alpha_safeguard": "0"}, (0.25,)),
    ("CriticalKVPress", {"press": "KnormPress"}, (0.5, 0.75)),
    ("CriticalKVPress", {"press": "SnapKVPress", "press.window_size": "16", "first_stage_ratio": "0.3"}, (0.5,)),
    ("CriticalKVPress", {"press": "ExpectedAttentionPress", "press.use_vnorm": "False"}, (0.5,)),
    ("CriticalAdaKVPress", {"press": "KnormPress"}, (0.5, 0.75)),
    ("CriticalAdaKVPress", {"press": "SnapKVPress", "press.window_size": "16"}, (0.5,)),
    ("CriticalAdaKVPress", {"press": "ExpectedAttentionPress", "press.use_vnorm": "False", "epsilon": "0.001",
                            "first_stage_ratio": "0.25"}, (0.5,)),
    # n_kept stays >= the window (64) in every layer: SnapKV gives the whole window the same score
    # (max + 1), so a smaller budget would cut through a tie that kvpress breaks arbitrarily.
    ("PyramidKVPress", {}, (0.5, 0.6)),
    ("PyramidKVPress", {"window_size": "16", "beta": "5"}, (0.5, 0.25)),
    # Default inner press (ExpectedAttentionPress, epsilon 2e-2), sink 4, window 1; then Knorm, no sink.
    ("LUKVPress", {"budget_curves": RANDOM_CURVES}, (0.5, 0.3)),
    ("LUKVPress", {"press": "KnormPress", "budget_curves": RANDOM_CURVES, "sink": "0", "window": "8"}, (0.75,)),
    # No ratio: round(0.5 * 6) = 3 and round(0.34 * 6) = 2 of the 6 KV heads stream.
    ("DuoAttentionPress", {"attention_pattern": RANDOM_PATTERN, "head_compression_ratio": "0.5"}, (None,)),
    ("DuoAttentionPress", {"attention_pattern": RANDOM_PATTERN, "head_compression_ratio": "0.34"}, (None,)),
    ("PerLayerCompressionPress", {"press": "KnormPress", "compression_ratios": "0.25,0.5,0.75"}, (None,)),
    ("PerLayerCompressionPress", {"press": "SnapKVPress", "press.window_size": "16",
                                  "compression_ratios": "0.75,0,0.5"}, (None,)),
]

# (head_dim, dtype, seq_len, batch). kvpress's CriticalAdaKVPress sums head budgets over the batch
# (kvpress-cpp counts them per batch row), so it runs on batch 1 only.
LAYER_CASES = [
    (64, torch.float32, 300, 1),
    (128, torch.float32, 256, 1),
    (64, torch.bfloat16, 300, 1),
    (128, torch.bfloat16, 200, 1),
    (64, torch.float32, 160, 2),
]

# Model runs on TinyStories-656K at ratio 0.5.
MODEL_RUNS = [
    ("AdaKVPress", {"press": "SnapKVPress"}),
    ("AdaKVPress", {"press": "KnormPress"}),
    ("CriticalKVPress", {"press": "SnapKVPress"}),
    ("CriticalAdaKVPress", {"press": "KnormPress"}),
    ("PyramidKVPress", {}),
    ("LUKVPress", {"budget_curves": MODEL_CURVES}),
    ("DuoAttentionPress", {"attention_pattern": MODEL_PATTERN, "head_compression_ratio": "0.5"}),
    # Ratios leaving >= 64 (SnapKV's window) of the 140-token prompt: see PyramidKVPress above.
    ("PerLayerCompressionPress", {"press": "SnapKVPress", "compression_ratios": "0.25,0.5"}),
]
MODEL_RATIO = 0.5


def write_budget_curves(path: Path, num_layers: int, kv_heads: int, seed: int) -> None:
    """LUKVPress's curve: for target ratio (t + 1) / 100, prune fractions uniform within 0.3 of it
    per (layer, KV head), clamped to [0, 1], float64, written as LU-KV publishes curves (a .npy
    beside `path`, what kvpress downloads) and converted to `path` by scripts/make_artifact.py."""
    g = torch.Generator().manual_seed(seed)
    target = (torch.arange(1, 100, dtype=torch.float64) / 100).view(99, 1, 1)
    curves = (target + 0.6 * (torch.rand(99, num_layers, kv_heads, generator=g, dtype=torch.float64) - 0.5)).clamp(0, 1)
    np.save(path.with_suffix(".npy"), curves.numpy())
    with contextlib.redirect_stdout(io.StringIO()):
        make_artifact.convert_lukv_curve(path.with_suffix(".npy"), path)


def write_model_curves(path: Path, model_path: Path, data: Path) -> None:
    """TinyStories-656K's curve for LUKVPress's default scorer (ExpectedAttentionPress(epsilon=0.02),
    sink 4, window 1) by scripts/make_artifact.py's lukv recipe, on 8 stories of 96 tokens with 32
    decoding steps (the recipe's defaults are 30 and 64: this keeps the fixtures fast), written as
    LU-KV publishes curves (.npy beside `path`) and converted to `path`."""
    eager, tok = load_model(model_path, "eager"), load_tokenizer(model_path)
    curves, _ = make_artifact.profile_lukv(eager, tok, load_stories(data), "ExpectedAttentionPress", {"epsilon": 0.02},
                                           num_samples=8, context_len=96, future_len=32, sink=4, window=1)
    np.save(path.with_suffix(".npy"), curves.numpy())
    with contextlib.redirect_stdout(io.StringIO()):
        make_artifact.convert_lukv_curve(path.with_suffix(".npy"), path)


def write_random_pattern(folder: Path, num_layers: int, kv_heads: int, seed: int) -> None:
    """A DuoAttention pattern folder: sink 16, recent 64, head scores uniform in [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):
        make_artifact.save_duo_attention_pattern(folder, torch.rand(num_layers, kv_heads, generator=g), 16, 64, {})


def write_model_pattern(folder: Path, path: Path, data: Path) -> None:
    """TinyStories-656K's pattern by scripts/make_artifact.py's recipe, which must equal kvpress's own
    duo_attention_on_the_fly given the same stories in place of BookSum."""
    from kvpress.presses import duo_attention_press
    model, tok = load_model(path, "sdpa"), load_tokenizer(path)
    stories = load_stories(data)
    ours = make_artifact.duo_attention_scores(model, tok, stories, num_samples=50, q_len=500)

    class Stories:  # what load_dataset("kmfoda/booksum", split="train") gives, with the stories
        def to_pandas(self):
            import pandas as pd
            return pd.DataFrame({"chapter": stories})

    real_load_dataset = duo_attention_press.load_dataset
    duo_attention_press.load_dataset = lambda *args, **kwargs: Stories()
    try:
        with torch.no_grad():
            theirs = torch.as_tensor(duo_attention_press.duo_attention_on_the_fly(model, num_samples=50, q_len=500))
    finally:
        duo_attention_press.load_dataset = real_load_dataset
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), (ours, theirs)
    make_artifact.save_duo_attention_pattern(folder, ours, make_artifact.DUO_SINK_SIZE, make_artifact.DUO_RECENT_SIZE,
                                             {"recipe": "kvpress duo_attention_on_the_fly", "num_samples": 50})


def run_tag(name: str, params: dict[str, str], ratio) -> str:
    tag = name + "".join(f"_{k.replace('press.', '')}{v.replace(',', '+')}" for k, v in params.items()
                         if k not in ("press", *common.ARTIFACT_PARAMS))
    if "press" in params:
        tag += "_" + params["press"]
    return tag + ("" if ratio is None else f"_r{ratio:g}")


def random_model(head_dim: int, dtype: torch.dtype):
    """A small hidden size (128 < Hq * D) keeps the fixtures fast and small; the attention shapes
    are what matters here."""
    return random_llama(4321 + head_dim, head_dim, num_layers=3, hidden_size=128, intermediate_size=256,
                        attn_implementation="sdpa").to(dtype)


# ---------------------------------------------------------------------------------------------
# What kvpress sees and does
# ---------------------------------------------------------------------------------------------
class AttentionRecorder:
    """Wraps the (kvpress-patched) SDPA attention function to record the queries and outputs of
    the new tokens' forward."""

    def __init__(self):
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.active = False
        self.inner = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
            q = query.detach().clone()
            out = self.inner(module, query, key, value, attention_mask, *args, **kwargs)
            if self.active:
                self.records[module.layer_idx] = (q, out[0].detach().transpose(1, 2).contiguous())
            return out

        ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapper

    def restore(self):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = self.inner


def kept_masks(model, press_name: str, captured: dict, cache) -> dict[int, torch.Tensor]:
    """Per layer, bool [B, Hkv, S]: what kvpress keeps."""
    out = {}
    for layer in model.model.layers:
        module = layer.self_attn
        l = module.layer_idx
        keys, values = captured[l]["keys"], captured[l]["values"]
        b, h, s, _ = keys.shape
        if press_name in MASKED:
            mask = torch.ones(b, h, s, dtype=torch.bool)
            if getattr(module, "masked_key_indices", None) is not None:
                bi, hi, si = module.masked_key_indices
                mask[bi, hi, si] = False
        else:
            mask = kept_mask(kept_positions(keys, values, cache.layers[l].keys, cache.layers[l].values), s)
        out[l] = mask.contiguous()
    return out


def prefill(model, press, ids) -> tuple[DynamicCache, dict]:
    """The prefill with the press; returns the cache and, per layer, what the press's hook received
    (common.capture's hooks are registered first, so they record it before the press compresses)."""
    cache = DynamicCache()
    with capture(model) as seen, torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache, seen


# ---------------------------------------------------------------------------------------------
# Layer runs on random models
# ---------------------------------------------------------------------------------------------
def layer_case(out: Path, recorder: AttentionRecorder, head_dim, dtype, seq_len, batch) -> dict:
    name = f"rand_d{head_dim}_{SHORT_DTYPE[dtype]}_s{seq_len}_b{batch}"
    model = random_model(head_dim, dtype)
    gen = torch.Generator().manual_seed(seq_len * 13 + head_dim + batch)
    # Distinct tokens: a repeated token has the same pre-RoPE key, so the same key norm up to RoPE's
    # rounding, which would make near-ties for KnormPress (broken differently by kvpress and us).
    ids = torch.randperm(model.config.vocab_size, generator=gen)[:batch * (seq_len + N_NEW)].view(batch, -1)
    prefix, new = ids[:, :seq_len], ids[:, seq_len:]
    num_layers = model.config.num_hidden_layers

    _, base = prefill(model, kvpress.KnormPress(compression_ratio=0.0), prefix)
    cos, sin = base[0]["position_embeddings"]
    tensors = {"cos": cos[0], "sin": sin[0], "inv_freq": inv_freq(model.model.rotary_emb)}
    for l, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for key in ("keys", "values", "hidden_states"):
            tensors[f"{key}_l{l}"] = base[l][key]
        for proj in ("q_proj", "k_proj", "o_proj"):
            tensors[f"{proj}_l{l}"] = getattr(attn, proj).weight.detach()
    save(tensors, out / f"{name}.inputs.safetensors")
    case = {"name": name, "dtype": DTYPE_NAMES[dtype], "inputs": f"{name}.inputs.safetensors",
            "batch": batch, "num_heads": 8, "num_kv_heads": 2, "head_dim": head_dim, "seq_len": seq_len,
            "num_layers": num_layers, "new_tokens": N_NEW, "runs": []}

    for press_name, params, ratios in LAYER_RUNS:
        if press_name == "CriticalAdaKVPress" and batch > 1:
            continue
        for ratio in ratios:
            press = build_press(press_name, params, ratio)
            cache, seen = prefill(model, press, prefix)
            for l in range(num_layers):  # the press saw exactly the stored inputs
                assert torch.equal(seen[l]["keys"], base[l]["keys"]) and torch.equal(seen[l]["hidden_states"],
                                                                                     base[l]["hidden_states"])
            kept = kept_masks(model, press_name, base, cache)
            # One new token per forward: with layers of different lengths (PyramidKV, per-layer
            # ratios) transformers builds a multi-token mask from layer 0's length and fails.
            steps = []
            for i in range(N_NEW):
                recorder.records.clear()
                recorder.active = True
                try:
                    with torch.no_grad():
                        model.model(input_ids=new[:, i:i + 1], past_key_values=cache,
                                    position_ids=torch.full((batch, 1), seq_len + i, dtype=torch.int64))
                finally:
                    recorder.active = False
                steps.append(dict(recorder.records))
            run = f"{name}__{run_tag(press_name, params, ratio)}"
            tensors = {}
            for l in range(num_layers):
                tensors[f"kept_l{l}"] = kept[l]
                tensors[f"q_new_l{l}"] = torch.cat([st[l][0] for st in steps], 2)
                tensors[f"k_new_l{l}"] = cache.layers[l].keys[:, :, -N_NEW:]
                tensors[f"v_new_l{l}"] = cache.layers[l].values[:, :, -N_NEW:]
                tensors[f"out_l{l}"] = torch.cat([st[l][1] for st in steps], 2)
            save(tensors, out / f"{run}.safetensors")
            case["runs"].append({"name": run, "press": press_name, "params": dict(params),
                                 "compression_ratio": common.registry_ratio(press_name, press.compression_ratio),
                                 "masked": press_name in MASKED,
                                 "file": f"{run}.safetensors"})
    return case


# ---------------------------------------------------------------------------------------------
# Model runs on TinyStories-656K
# ---------------------------------------------------------------------------------------------
def model_runs(out: Path, models: Path, data: Path) -> dict:
    path = model_dir(models)
    tok = load_tokenizer(path)
    model = load_model(path, "sdpa")
    stories = load_stories(data)
    entry = {"model": str(path), "attn_implementation": "sdpa", "prompts": []}
    for name, story, prefix_len, n_question, n_decode in PROMPTS:
        ids = token_ids(tok, stories[story])
        prefix, question = ids[:, :prefix_len], ids[:, prefix_len:prefix_len + n_question]
        prompt = {"name": name, "input_ids": f"model__{name}.safetensors", "prefix_len": prefix_len,
                  "question_len": n_question, "runs": []}
        save({"input_ids": ids[:, :prefix_len + n_question]}, out / prompt["input_ids"])
        for press_name, params in MODEL_RUNS:
            press = build_press(press_name, params, MODEL_RATIO)
            cache, seen = prefill(model, press, prefix)
            kept = kept_masks(model, press_name, seen, cache)
            with torch.no_grad():
                # The question one token per forward: transformers cannot mask a multi-token forward
                # over layers of different lengths.
                q_logits, fed, d_logits = decode_tail(model, cache, question, prefix_len, n_decode, one_by_one=True)
            run = f"model__{name}__{run_tag(press_name, params, None)}"
            tensors = {"question_logits": q_logits, "decode_tokens": fed, "decode_logits": d_logits}
            for l, mask in kept.items():
                tensors[f"kept_l{l}"] = mask
            save(tensors, out / f"{run}.safetensors")
            prompt["runs"].append({"name": run, "press": press_name, "params": dict(params),
                                   "compression_ratio": common.registry_ratio(press_name, MODEL_RATIO),
                                   "masked": press_name in MASKED,
                                   "file": f"{run}.safetensors"})
        entry["prompts"].append(prompt)
    return entry


def main():
    args = parse_args(__doc__)
    start = setup(threads=1)  # tiny matmuls: a second thread only adds synchronisation
    out = prepare_out(args.out, stale=("*.safetensors", "manifest.json"))
    common.ARTIFACT_DIR = out  # LUKVPress's curve files, named relative to it
    write_budget_curves(out / RANDOM_CURVES, num_layers=3, kv_heads=2, seed=99)
    write_model_curves(out / MODEL_CURVES, model_dir(args.models), args.data)
    write_random_pattern(out / RANDOM_PATTERN, num_layers=3, kv_heads=2, seed=97)
    write_model_pattern(out / MODEL_PATTERN, model_dir(args.models), args.data)

    recorder = AttentionRecorder()
    try:
        cases = [layer_case(out, recorder, *c) for c in LAYER_CASES]
    finally:
        recorder.restore()
    model = model_runs(out, args.models, args.data)
    write_json(out / "manifest.json", {**versions(), "layer_cases": cases, "model": model})
    n_runs = sum(len(c["runs"]) for c in cases) + sum(len(p["runs"]) for p in model["prompts"])
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"make_ragged_fixtures: {n_runs} runs, {size / 2**20:.1f} MiB in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
