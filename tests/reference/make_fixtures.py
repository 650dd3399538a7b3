#!/usr/bin/env python3
"""Parity fixtures for kvpress-cpp, produced by the pinned Python kvpress package.

    python make_fixtures.py --out DIR [--only real|random] [--models DIR] [--data FILE]

For every captured attention layer this writes the press inputs exactly as kvpress's forward
hook sees them, and for every (press, parameters, compression ratio, input source) the scores
and kept positions that kvpress itself computes. See README.md next to this file for the
layout; tests/test_parity.cpp reads it.

CPU only, deterministic (fixed seeds), two threads.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
import types
from pathlib import Path

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
import common
from common import (DTYPE_NAMES, KVPRESS_VERSION, MODEL, SHORT_DTYPE, apply_rope, build_press, capture,
                    first_story_with, inv_freq, kept_positions, load_model, load_stories, load_tokenizer,
                    model_dir, parse_args, prepare_out, random_llama, registry_ratio, save, setup, split_seed,
                    versions, write_json)

import torch
from transformers import DynamicCache

import kvpress
from kvpress.utils import compute_n_kept, get_prerope_query_states

sys.path.insert(0, str(common.REPO / "scripts"))
import make_artifact  # noqa: E402 (scripts/ is not a package)

# Attention weights are stored only when B * Hq * S * S * 4 bytes stays below this.
MAX_ATTENTION_BYTES = 40 * 1024 * 1024

# ---------------------------------------------------------------------------------------------
# Press configurations. Parameter values are text, named as kvpress names them.
# sources: which inputs the C++ side gets for the run.
#   "keys"          keys, values
#   "attentions"    keys, values, attentions (eager weights)
#   "hidden_states" keys, values, hidden_states, q_proj, k_proj, cos, sin (queries recomputed)
#   "queries"       keys, values, post-RoPE queries (all positions)
#   "rope"          keys, values, cos, sin (pre-RoPE keys by inverting RoPE on the cached keys)
#   "k_proj"        keys, values, hidden_states, k_proj (pre-RoPE keys recomputed, no cos/sin)
#   "queries_rope"  keys, values, post-RoPE queries (all positions), cos, sin
#   "queries_k_proj" keys, values, post-RoPE queries (all positions), hidden_states, k_proj
#   "keys_inv_freq" keys, values, inv_freq (RoPE inverse frequencies, float32)
# ("hidden_states" also gives inv_freq.)
#
# Wrappers (ChunkKVPress, EntropyGatedChunkKVPress, ChunkPress, BlockPress, KeyRerotationPress, ComposedPress) name their
# inner press with the C++ registry's syntax: "press" = inner class name, "press.<param>" its
# parameters; ComposedPress: "presses" = "A,B", "presses.<i>.<param>". Their run files hold the
# kept positions (recovered from the returned cache) and, for KeyRerotationPress, the re-rotated
# keys, and the inner scorer's scores where the selection is a top-k of them or, for
# EntropyGatedChunkKVPress, where the test replays its gate on them.
# kvpress itself always recomputes queries / pre-RoPE keys from the hidden states, so every source
# but "attentions" shares one kvpress run (the C++ side must reach the same numbers by its path).
#
# "seed" is a C++ parameter of the presses with a random sketch (LeverageScorePress,
# CompactorPress): kvpress has none, so the generator calls torch.manual_seed(seed) right before
# each score()/compress() of those presses (RandomPress takes its seed as kvpress does).
# ---------------------------------------------------------------------------------------------
KEYS_ONLY = ("keys",)
ATTENTION_BASED = ("attentions", "hidden_states", "queries")

PRESSES = [
    # (class name, params, sources, extra ratios)
    ("RandomPress", {"seed": "42"}, KEYS_ONLY, ()),
    ("KnormPress", {}, KEYS_ONLY, (0.25, 0.75)),
    ("StreamingLLMPress", {}, KEYS_ONLY, (0.25, 0.75)),
    ("StreamingLLMPress", {"n_sink": "8"}, KEYS_ONLY, ()),
    ("KeyDiffPress", {}, KEYS_ONLY, ()),
    ("SnapKVPress", {}, ATTENTION_BASED, (0.25, 0.75)),
    ("SnapKVPress", {"window_size": "16", "kernel_size": "3"}, ATTENTION_BASED, ()),
    ("LagKVPress", {}, KEYS_ONLY, (0.25, 0.75)),
    ("LagKVPress", {"lag_size": "32"}, KEYS_ONLY, ()),
    ("LagKVPress", {"cross_scoring": "True"}, KEYS_ONLY, ()),
    ("LagKVPress", {"lag_size": "32", "cross_scoring": "True"}, KEYS_ONLY, ()),
    ("TOVAPress", {}, ATTENTION_BASED, (0.25,)),
    ("ObservedAttentionPress", {}, ("attentions",), ()),
    ("CURPress", {}, KEYS_ONLY, (0.25, 0.75)),
    ("CURPress", {"leverage_type": "key", "num_sinks": "0", "local_window_size": "7"}, KEYS_ONLY, ()),
    ("CURPress", {"leverage_type": "value", "use_local_approximation": "False"}, KEYS_ONLY, ()),
    ("CURPress", {"leverage_type": "kv_avg", "use_random_leverage": "True", "seed": "9"}, KEYS_ONLY, ()),
    # Compactor (seeded sketch; chunk 64 exercises the padded last chunk on every length).
    ("LeverageScorePress", {"seed": "7"}, ("rope", "k_proj"), (0.25, 0.75)),
    ("LeverageScorePress", {"sketch_dimension": "16", "seed": "3"}, ("rope", "k_proj"), ()),
    ("NonCausalAttnPress", {}, ("hidden_states", "queries"), (0.25, 0.75)),
    ("NonCausalAttnPress", {"chunk_size": "64"}, ("hidden_states", "queries"), ()),
    ("CompactorPress", {"seed": "11"}, ("hidden_states", "queries_rope", "queries_k_proj"), (0.25, 0.75)),
    ("CompactorPress", {"blending": "0.3", "seed": "11"}, ("hidden_states", "queries_rope"), ()),
    ("CompactorPress", {"sink_size_start": "4", "sink_size_end": "0", "chunk_size": "64", "seed": "5"},
     ("queries_rope",), ()),
    ("ExpectedAttentionPress", {}, ("hidden_states", "queries_rope"), (0.25, 0.75)),
    ("ExpectedAttentionPress", {"use_covariance": "False", "use_vnorm": "False", "epsilon": "0.01"},
     ("hidden_states",), ()),
    ("ExpectedAttentionPress", {"n_future_positions": "64", "n_sink": "0", "epsilon": "0.01"}, ("hidden_states",), ()),
    ("CapPress", {}, ("hidden_states", "queries_rope"), (0.25, 0.75)),
    # ThinKPress: the ratio is key_channel_compression_ratio (its compression_ratio is half of it).
    ("ThinKPress", {}, ("hidden_states", "queries"), (0.25, 0.75)),
    ("ThinKPress", {"window_size": "8"}, ("hidden_states",), ()),
    # QFilterPress: "{case}" is the case's name; its filters file holds random filters of the case's
    # shape (write_case), given to kvpress's press in the cache dtype (what post_init_from_model does).
    ("QFilterPress", {"q_filters": "{case}.qfilters.safetensors"}, KEYS_ONLY, (0.25, 0.75)),
    # ExpectedAttentionStatsPress: kvpress's statistics folder of random statistics of the case's
    # shape (write_case), loaded by its post_init_from_model.
    ("ExpectedAttentionStatsPress", {"stats_folder": "{case}.eastats"}, ("keys_inv_freq", "rope"), (0.25,)),
    # KVzapPress: kvpress's KVzapModel folders of random surrogates for the case's hidden size (write_case).
    ("KVzapPress", {"kvzap_model": "{case}.kvzap_mlp"}, ("hidden_states",), (0.25,)),
    ("KVzapPress", {"kvzap_model": "{case}.kvzap_linear", "model_type": "linear"}, ("hidden_states",), ()),
    ("ExpectedAttentionStatsPress", {"stats_folder": "{case}.eastats", "use_covariance": "False", "n_sink": "0",
                                     "epsilon": "0.01"}, ("keys_inv_freq",), ()),
    # SimLayerKVPress: no ratio (registry ratio 0); the default threshold 1 keeps every token.
    ("SimLayerKVPress", {}, ("hidden_states",), ()),
    ("SimLayerKVPress", {"lazy_threshold": "0.5", "n_recent": "64"}, ATTENTION_BASED, ()),
    ("SimLayerKVPress", {"lazy_threshold": "0.1", "n_last": "4", "n_recent": "32", "n_initial": "8"},
     ("hidden_states",), ()),
    ("CapPress", {"tau": "2.0", "n_sink": "0", "n_future_positions": "64", "epsilon": "0.001"}, ("hidden_states",), ()),
    # FinchPress: its window is the case's question (the last QUESTION_LENGTH positions), which
    # kvpress's delimiter hook would set; re-rotation needs the RoPE frequencies ("hidden_states").
    ("FinchPress", {}, ("hidden_states",), (0.25, 0.75)),
    ("FinchPress", {"rerotate_keys": "False"}, ATTENTION_BASED, ()),
    ("FinchPress", {"chunk_length": "96", "normalize_scores": "False"}, ("hidden_states",), ()),
    # Wrappers.
    ("KeyRerotationPress", {"press": "KnormPress"}, ("keys_inv_freq",), (0.25,)),
    ("KeyRerotationPress", {"press": "SnapKVPress", "press.window_size": "16"}, ("hidden_states",), ()),
    ("ChunkKVPress", {"press": "KnormPress"}, KEYS_ONLY, (0.25,)),
    ("ChunkKVPress", {"press": "SnapKVPress", "press.window_size": "16", "chunk_length": "16"}, ("hidden_states",), ()),
    ("EntropyGatedChunkKVPress", {"press": "KnormPress"}, KEYS_ONLY, (0.25, 0.75)),
    ("EntropyGatedChunkKVPress", {"press": "KeyDiffPress", "chunk_length": "16", "low_entropy_chunk_length": "1"},
     KEYS_ONLY, ()),
    ("EntropyGatedChunkKVPress", {"press": "SnapKVPress", "press.window_size": "16"}, ("hidden_states",), ()),
    ("ChunkPress", {"press": "KnormPress", "chunk_length": "256"}, KEYS_ONLY, (0.25,)),
    ("ChunkPress", {"press": "SnapKVPress", "press.window_size": "16", "chunk_length": "256"}, ("hidden_states",), ()),
    ("BlockPress", {"press": "KeyDiffPress", "block_size": "64"}, KEYS_ONLY, (0.25,)),
    ("BlockPress", {"press": "KnormPress"}, KEYS_ONLY, ()),
    ("ComposedPress", {"presses": "KnormPress,KeyDiffPress"}, KEYS_ONLY, ()),
    # MergingPress: inner scorers without exact ties (a tie would change the kept set and so every
    # merge target); the run file holds kvpress's merged values.
    ("MergingPress", {"press": "KeyDiffPress"}, KEYS_ONLY, (0.25, 0.75)),
    ("MergingPress", {"press": "KeyDiffPress", "similarity_threshold": "0.2", "merge_fraction": "0.75"}, KEYS_ONLY,
     ()),
    ("ComposedPress", {"presses": "SnapKVPress,KnormPress", "presses.0.window_size": "16"}, ("hidden_states",), ()),
]
WRAPPERS = ("KeyRerotationPress", "ChunkKVPress", "EntropyGatedChunkKVPress", "ChunkPress", "BlockPress",
            "ComposedPress", "MergingPress")
CHANNEL_PRESSES = ("ThinKPress",)  # prune key channels: the run file holds kvpress's returned keys
LAYER_PRESSES = ("SimLayerKVPress",)  # keep all or a layer's ends: kept positions and kvpress's lazy score
QUERY_AWARE_PRESSES = ("FinchPress",)  # observe the question: scores, kept positions and returned keys
# The last positions of every case that play the user's question (LayerInputs::question_length).
QUESTION_LENGTH = 12
BASE_RATIO = 0.5

# Random-weight Llama cases: (head_dim, dtype, seq_len, store attentions). 8 query heads,
# 2 KV heads, one layer. S=200 takes LagKV's short-input ramp; the long cases have a LagKV
# remainder that is not a multiple of the lag.
RANDOM_CASES = [
    (64, torch.float32, 200),
    (64, torch.bfloat16, 200),
    (128, torch.float32, 200),
    (64, torch.float32, 1024),
    (128, torch.bfloat16, 1024),
    (128, torch.float32, 3000),
    (64, torch.bfloat16, 2900),
]


def param_tag(params: dict[str, str]) -> str:
    # One artifact per case, not a variant (model_type tells the KVzap runs apart).
    params = {k: v for k, v in params.items() if k not in common.ARTIFACT_PARAMS}
    if not params:
        return "default"
    if "press" in params or "presses" in params:
        return "_".join(f"{k.split('.')[-1] if k.startswith('press') and k not in ('press', 'presses') else ''}"
                        f"{v.replace(',', '+')}" for k, v in params.items())
    short = {"window_size": "w", "kernel_size": "k", "lag_size": "lag", "n_sink": "sink",
             "cross_scoring": "cross", "seed": "seed", "sketch_dimension": "sk", "chunk_size": "c",
             "blending": "bl", "sink_size_start": "ss", "sink_size_end": "se", "leverage_type": "lt",
             "num_sinks": "ns", "local_window_size": "lw", "use_local_approximation": "local",
             "use_random_leverage": "rand", "lazy_threshold": "lazy", "n_recent": "rec", "n_last": "last",
             "n_initial": "init"}
    return "_".join(f"{short.get(k, k)}{'' if v == 'True' else v}" for k, v in params.items())


# ---------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------
def capture_layers(model, input_ids: torch.Tensor) -> list[dict]:
    """Runs a prefill and records, for every layer, what kvpress's forward hook receives."""
    with capture(model) as captured, torch.no_grad():
        model(input_ids=input_ids, past_key_values=DynamicCache(), use_cache=True)
    layers = [captured[i] for i in sorted(captured)]
    for layer in layers:
        layer["module"].rotary_emb = model.model.rotary_emb  # what kvpress's post_init_from_model sets
        # The kwargs kvpress's score()/compress() get.
        layer["kwargs"] = {k: layer.pop(k) for k in ("position_embeddings", "cache_position")}
    return layers


def post_rope_queries(module, hidden_states, cos, sin) -> torch.Tensor:
    """Post-RoPE queries of all positions, computed the way kvpress's SnapKV/TOVA do."""
    return apply_rope(get_prerope_query_states(module, hidden_states), cos, sin)


# ---------------------------------------------------------------------------------------------
# Running the presses
# ---------------------------------------------------------------------------------------------
def run_press(press, layer: dict, source: str, seed: int | None = None):
    attentions = layer["attentions"] if source == "attentions" else None
    args = (layer["module"], layer["hidden_states"], layer["keys"], layer["values"], attentions, layer["kwargs"])
    with torch.no_grad():
        if seed is not None:
            torch.manual_seed(seed)
        scores = press.score(*args)
        if seed is not None:
            torch.manual_seed(seed)
        new_keys, new_values = press.compress(*args)
    keys = layer["keys"]
    n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
    assert tuple(scores.shape) == tuple(keys.shape[:3]), (scores.shape, keys.shape)
    topk = scores.topk(n_kept, dim=-1).indices
    gathered = keys.gather(2, topk.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    if not torch.equal(gathered, new_keys):
        raise AssertionError(f"{type(press).__name__}: compress() kept other keys than score().topk()")
    gathered_v = layer["values"].gather(2, topk.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    assert torch.equal(gathered_v, new_values)
    kept = topk.sort(dim=-1).values.to(torch.int64).contiguous()
    return scores.to(torch.float32).contiguous(), kept, n_kept


def run_channel_press(press, layer: dict) -> dict[str, torch.Tensor]:
    """A press that prunes key channels (ThinKPress) as kvpress's hook runs it: its kwargs carry the
    hidden states; it writes into the keys it is given, so it gets a copy. Returns the new keys."""
    kwargs = dict(layer["kwargs"], hidden_states=layer["hidden_states"])
    with torch.no_grad():
        new_keys, new_values = press.compress(layer["module"], layer["hidden_states"], layer["keys"].clone(),
                                              layer["values"], None, kwargs)
    assert torch.equal(new_values, layer["values"])
    return {"keys": new_keys.contiguous()}


def run_wrapper(press, layer: dict, source: str) -> dict[str, torch.Tensor]:
    """Runs a wrapper like kvpress's hook does; returns the run file's tensors."""
    attentions = layer["attentions"] if source == "attentions" else None
    module, hidden, keys, values, kwargs = (layer["module"], layer["hidden_states"], layer["keys"],
                                            layer["values"], layer["kwargs"])
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if isinstance(press, kvpress.ComposedPress):
            new_keys, new_values = keys, values
            for p in press.presses:  # what ComposedPress.forward_hook chains
                new_keys, new_values = p.compress(module, hidden, new_keys, new_values, attentions, kwargs)
        else:
            new_keys, new_values = press.compress(module, hidden, keys, values, attentions, kwargs)
        if isinstance(press, kvpress.KeyRerotationPress):
            scores = press.press.score(module, hidden, keys, values, attentions, kwargs)
            n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
            kept = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
            out["scores"] = scores.to(torch.float32).contiguous()
            out["keys"] = new_keys.contiguous()
        elif isinstance(press, kvpress.MergingPress):  # values blended: rows found by their (unchanged) keys
            kept = kept_positions(keys, None, new_keys, None, sort=False)
            order = kept.argsort(dim=-1).unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            out["values"] = new_values.gather(2, order).contiguous()  # in ascending kept order
        else:
            kept = kept_positions(keys, values, new_keys, new_values, sort=False)  # in the order kvpress left them
        if isinstance(press, kvpress.EntropyGatedChunkKVPress):  # its gate replayed on these scores,
            # in the dtype kvpress sums them in (float32 from KnormPress, the cache dtype from others)
            out["scores"] = press.press.score(module, hidden, keys, values, None, kwargs).contiguous()
    gathered_v = values.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    assert isinstance(press, kvpress.MergingPress) or torch.equal(gathered_v, new_values), type(press).__name__
    out["kept_indices"] = kept.sort(dim=-1).values.to(torch.int64).contiguous()
    return out


def run_query_aware_press(press, layer: dict, source: str) -> dict[str, torch.Tensor]:
    """FinchPress with its window set to the question, as its delimiter hook sets it: its scores,
    the positions it keeps (its own selection: the best n_kept, or of every chunk) and, re-rotated,
    the keys it returns."""
    press.window_size = QUESTION_LENGTH
    attentions = layer["attentions"] if source == "attentions" else None
    args = (layer["module"], layer["hidden_states"], layer["keys"], layer["values"], attentions, layer["kwargs"])
    with torch.no_grad():
        scores = press.score(*args)
        new_keys, new_values = press.compress(*args)
    keys, s = layer["keys"], layer["keys"].shape[2]
    chunk = press.chunk_length or s
    # kvpress's own selection, in its order (topk per chunk, sorted when it re-rotates), checked
    # against the values it returned.
    kept = torch.cat([start + scores[:, :, start:start + chunk].topk(
        compute_n_kept(min(chunk, s - start), press.compression_ratio), dim=-1).indices
        for start in range(0, s, chunk)], dim=-1)
    if press.rerotate_keys:
        kept = kept.sort(dim=-1).values
    assert torch.equal(layer["values"].gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])), new_values)
    kept = kept.sort(dim=-1).values
    out = {"scores": scores.to(torch.float32).contiguous(), "kept_indices": kept.to(torch.int64).contiguous()}
    if press.rerotate_keys:
        out["keys"] = new_keys.contiguous()
    return out


def run_layer_press(press, layer: dict, source: str) -> dict[str, torch.Tensor]:
    """SimLayerKVPress: the kept positions (as run_wrapper records them) and, where the layer is
    judged, kvpress's lazy score (float32 [1]: the attention share is_lazy compares with
    lazy_threshold), so the C++ test can tell a decision taken on a near-tie."""
    out = run_wrapper(press, layer, source)
    keys = layer["keys"]
    if press.lazy_threshold < 1.0 and keys.shape[2] > press.n_initial + press.n_recent + press.n_last:
        with torch.no_grad():
            attn = kvpress.SnapKVPress.compute_window_attention(layer["module"], layer["hidden_states"], keys,
                                                                press.n_last, layer["kwargs"]["position_embeddings"])
            attn = attn.mean((0, 1, 2))
            share = attn[: press.n_initial].sum() + attn[-press.n_recent:].sum()
        out["lazy_score"] = share.to(torch.float32).reshape(1)
    return out


def lagkv_statistic(press, layer: dict) -> torch.Tensor:
    """LagKV's per-token statistic before the within-partition ranking: the scores of the same
    press with cross_scoring=True (sinks and tail are 1). The C++ test needs it to tell which
    rank differences come from near-equal statistics."""
    cross = kvpress.LagKVPress(compression_ratio=press.compression_ratio, n_sink=press.n_sink,
                               lag_size=press.lag_size, cross_scoring=True)
    with torch.no_grad():
        stat = cross.score(layer["module"], layer["hidden_states"], layer["keys"], layer["values"], None,
                           layer["kwargs"])
    return stat.to(torch.float32).contiguous()


def write_random_query_statistics(folder: Path, num_layers: int, num_heads: int, head_dim: int,
                                  generator: torch.Generator):
    """kvpress's ExpectedAttentionStats folder (model.safetensors + config.json) holding random
    statistics: query_mean ~ N(0, 1), query_cov = A Aᵀ / head_dim (positive semi-definite)."""
    mean = torch.randn(num_layers, num_heads, head_dim, generator=generator)
    a = torch.randn(num_layers, num_heads, head_dim, head_dim, generator=generator)
    make_artifact.save_stats_folder(folder, mean, (a @ a.transpose(-1, -2) / head_dim).contiguous(),
                                    {"dataset_name": "random", "model_name": "random", "num_samples": 1,
                                     "sample_seq_len": 1, "n_sink": 4})


def straddling_tie(scores: torch.Tensor, n_kept: int) -> bool:
    """True when some row has equal scores on both sides of the selection threshold."""
    s = scores.reshape(-1, scores.shape[-1])
    if n_kept >= s.shape[-1]:
        return False
    top = s.topk(n_kept + 1, dim=-1).values
    return bool((top[:, n_kept - 1] == top[:, n_kept]).any())


def write_case(out: Path, name: str, family: str, description: str, model_cfg, layer: dict, num_layers: int,
               keep_attentions: bool) -> tuple[dict, dict]:
    module = layer["module"]
    keys = layer["keys"]
    dtype = keys.dtype
    b, hkv, s, d = keys.shape
    cos, sin = layer["kwargs"]["position_embeddings"]
    hidden_states = layer["hidden_states"]
    with torch.no_grad():
        queries = post_rope_queries(module, hidden_states, cos, sin)
    if not keep_attentions:
        layer = dict(layer, attentions=None)
    has_attn = layer["attentions"] is not None

    tensors = {
        "keys": keys,
        "values": layer["values"],
        "hidden_states": hidden_states,
        "q_proj": module.q_proj.weight.detach(),
        "k_proj": module.k_proj.weight.detach(),
        "cos": cos[0],
        "sin": sin[0],
        "queries": queries,
    }
    if has_attn:
        tensors["attentions"] = layer["attentions"]
    for key, t in tensors.items():
        assert t.dtype == dtype, (key, t.dtype, dtype)
    tensors["inv_freq"] = inv_freq(module.rotary_emb)  # float32 whatever the cache dtype
    save(tensors, out / f"{name}.inputs.safetensors")

    case = {
        "name": name,
        "family": family,
        "description": description,
        "dtype": DTYPE_NAMES[dtype],
        "inputs": f"{name}.inputs.safetensors",
        "num_heads": model_cfg.num_attention_heads,
        "num_kv_heads": model_cfg.num_key_value_heads,
        "head_dim": d,
        "seq_len": s,
        "layer_idx": module.layer_idx,
        "num_layers": num_layers,
        "question_length": QUESTION_LENGTH,
        "has_attentions": has_attn,
        "runs": [],
    }
    stats = {"runs": 0, "ties": 0}
    generator = torch.Generator().manual_seed(1234)
    save({"q_filters": torch.randn(num_layers, hkv, d, generator=generator)}, out / f"{name}.qfilters.safetensors")
    write_random_query_statistics(out / f"{name}.eastats", num_layers, module.config.num_attention_heads, d, generator)
    for kind, hidden_dim in (("mlp", 16), ("linear", None)):
        common.write_random_kvzap(out / f"{name}.kvzap_{kind}", module.config.hidden_size, hkv, num_layers,
                                  hidden_dim)
    common.ARTIFACT_DIR = out
    for press_name, case_params, sources, extra in PRESSES:
        params = {k: v.format(case=name) for k, v in case_params.items()}
        kv_params, seed = split_seed(press_name, params)
        for ratio in (registry_ratio(press_name, BASE_RATIO), *extra):
            press = build_press(press_name, kv_params, ratio)
            if isinstance(press, kvpress.QFilterPress):
                press.q_filters = press.q_filters.to(dtype)
            if isinstance(press, kvpress.ExpectedAttentionStatsPress):  # what press(model) does first
                with contextlib.redirect_stdout(io.StringIO()):  # its "Loading weights ..." line
                    press.post_init_from_model(types.SimpleNamespace(device=keys.device, dtype=dtype))
            # Extra ratios only for the first available source.
            srcs = [x for x in sources if x != "attentions" or has_attn]
            if ratio != registry_ratio(press_name, BASE_RATIO):
                srcs = srcs[:1]
            files: dict[str, str] = {}
            for source in srcs:
                run_name = f"{name}__{press_name}_{param_tag(params)}_r{ratio:g}_{source}"
                # kvpress's result depends only on whether it is given attentions.
                kv_run = "attentions" if source == "attentions" else "model"
                if kv_run in files:
                    file = files[kv_run]
                elif press_name in WRAPPERS:
                    file = f"{run_name}.safetensors"
                    save(run_wrapper(press, layer, source), out / file)
                    files[kv_run] = file
                elif press_name in CHANNEL_PRESSES:
                    file = f"{run_name}.safetensors"
                    save(run_channel_press(press, layer), out / file)
                    files[kv_run] = file
                elif press_name in QUERY_AWARE_PRESSES:
                    file = f"{run_name}.safetensors"
                    save(run_query_aware_press(press, layer, source), out / file)
                    files[kv_run] = file
                elif press_name in LAYER_PRESSES:
                    file = f"{run_name}.safetensors"
                    save(run_layer_press(press, layer, source), out / file)
                    files[kv_run] = file
                else:
                    scores, kept, n_kept = run_press(press, layer, source, seed)
                    file = f"{run_name}.safetensors"
                    tensors = {"scores": scores, "kept_indices": kept}
                    if press_name == "LagKVPress" and not press.cross_scoring:
                        tensors["statistic"] = lagkv_statistic(press, layer)
                    save(tensors, out / file)
                    files[kv_run] = file
                    stats["ties"] += straddling_tie(scores, n_kept)
                stats["runs"] += 1
                case["runs"].append({
                    "name": run_name,
                    "press": press_name,
                    "compression_ratio": ratio,
                    "params": dict(params),
                    "source": source,
                    "file": file,
                })
    return case, stats


# ---------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------
def real_family(out: Path, models: Path, data: Path):
    path = model_dir(models)
    tokenizer = load_tokenizer(path)
    # The first story long enough for LagKV's default lag (S >= 260), truncated to the model's
    # context (512).
    story, input_ids = first_story_with(tokenizer, load_stories(data), min_tokens=300)
    input_ids = input_ids[:, :511]
    cases, stats = [], []
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, "eager", dtype)
        layers = capture_layers(model, input_ids)
        for layer in layers:
            name = f"real_{SHORT_DTYPE[dtype]}_l{layer['module'].layer_idx}"
            description = (f"{MODEL} ({DTYPE_NAMES[dtype]}, eager attention), layer {layer['module'].layer_idx} "
                           f"of {len(layers)}, story {story} of {data.name}, {input_ids.shape[1]} tokens")
            case, st = write_case(out, name, "real", description, model.config, layer, len(layers),
                                  keep_attentions=True)
            cases.append(case)
            stats.append(st)
    return cases, stats


def random_family(out: Path):
    cases, stats = [], []
    for head_dim, dtype, seq_len in RANDOM_CASES:
        keep_attn = 1 * 8 * seq_len * seq_len * 4 <= MAX_ATTENTION_BYTES
        # Same weights for every case of a head_dim (fixed seed), cast to the case dtype.
        model = random_llama(1234 + head_dim, head_dim, num_layers=1, hidden_size=8 * head_dim,
                             intermediate_size=16 * head_dim,
                             attn_implementation="eager" if keep_attn else "sdpa").to(dtype)
        gen = torch.Generator().manual_seed(seq_len * 7 + head_dim)
        input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=gen)
        layers = capture_layers(model, input_ids)
        assert (layers[0]["attentions"] is not None) == keep_attn
        name = f"rand_d{head_dim}_{SHORT_DTYPE[dtype]}_s{seq_len}"
        description = (f"random-weight Llama, 1 layer, 8 query / 2 KV heads, head_dim {head_dim}, "
                       f"{DTYPE_NAMES[dtype]}, {seq_len} random tokens, "
                       f"{'eager' if keep_attn else 'sdpa'} attention")
        case, st = write_case(out, name, "random", description, model.config, layers[0], len(layers),
                              keep_attentions=keep_attn)
        cases.append(case)
        stats.append(st)
    return cases, stats


def main():
    def add_arguments(p):
        p.add_argument("--only", choices=("real", "random"))
        p.add_argument("--presses", default=None,
                       help="comma-separated press classes: only their runs (scripts/test_emulated_avx2_cpu.sh)")
    args = parse_args(__doc__, add_arguments)
    if args.presses:
        wanted = set(args.presses.split(","))
        unknown = wanted - {p[0] for p in PRESSES}
        if unknown:
            raise SystemExit(f"make_fixtures.py: --presses: no fixtures for {sorted(unknown)}")
        PRESSES[:] = [p for p in PRESSES if p[0] in wanted]
    start = setup(threads=2)
    # The other scripts write into sub-folders of this one: only its own files are stale.
    out = prepare_out(args.out, stale=("*.safetensors", "manifest.json"))

    cases, stats = [], []
    if args.only in (None, "real"):
        c, s = real_family(out, args.models, args.data)
        cases += c
        stats += s
    if args.only in (None, "random"):
        c, s = random_family(out)
        cases += c
        stats += s

    write_json(out / "manifest.json", {**versions(), "cases": cases})
    n_runs = sum(s["runs"] for s in stats)
    n_ties = sum(s["ties"] for s in stats)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"make_fixtures: kvpress {KVPRESS_VERSION}: {len(cases)} cases, {n_runs} runs "
          f"({n_ties} with a score tie at the threshold), {size / 2**20:.1f} MiB in {out} "
          f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
