#!/usr/bin/env python3
"""Reference fixtures for QSMPress / CTRPress, produced by the CTR-Press reference code.

    python make_ctr_fixtures.py --ctr-src DIR [--out DIR] [--models DIR] [--data FILE]

The reference is a kvpress fork (github.com/xiyuanyang-code/CTRPress, commit 2f6ff3b). Its
`kvpress/presses/{qsm_press,ctr_press}` packages are imported from a checkout (--ctr-src, or
$CTRPRESS_SRC) on top of the pinned kvpress 0.5.5 of the project's venv; nothing of it is copied
into this repository. CI has no GitHub access, so the small outputs are committed under
tests/data/ctr/ (see tests/reference/README.md) and tests/test_ctr.cpp reads them from there.

Cases (CPU, float32, fixed seeds):

* `mqa`: a random attention layer with ONE KV head (4 query heads, head_dim 16, 80 tokens). With
  one KV head every head keeps the same positions, the only setting in which the reference's
  merge helpers (written for head-shared kept indices) and kvpress-cpp's per-head merge coincide,
  so kept positions AND merged values are compared. The reference's stage-I merge helper indexes
  kept positions as [batch, n_kept]; the press passes [batch, heads, n_kept], which it cannot
  index, so `merge_removed_values` is called with head 0's row after checking that every head's
  row is equal (`head_shared_merge` below).
* `tiny_l{0,1}`: both layers of TinyStories-656K (8 query / 4 KV heads) on the first 160 tokens
  of a held-out story: stage-I scores and kept positions (no merge: pseudo-query), and CTRPress's
  kept positions (the reference's entropy over forced fp32-max scores overflows to NaN with 4 KV
  heads, so its budget is round(0.8 n)). The C++ test rebuilds the layer inputs with its own
  Llama runner on the stored ids.
* `semantic_weights`: the reference's weight of every vocabulary id of TinyStories-656K's
  tokenizer (decoded alone by transformers' tokenizer).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (PINNED_KVPRESS, REPO, SCRIPT, apply_rope, capture, first_story_with, load_model, load_stories,
                    load_tokenizer, model_dir, parse_args, parse_value, save, setup, write_json)

import torch
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

import kvpress.presses

REFERENCE_COMMIT = "2f6ff3b"
# Float parameters of the reference presses (their text may have no ".").
FLOAT_PARAMS = ("qa_alpha", "merge_count_power", "merge_min_score_ratio", "merge_score_power", "rescue_ratio")


def import_reference(ctr_src: Path):
    presses = ctr_src / "kvpress" / "presses"
    for sub in ("qsm_press", "ctr_press"):
        if not (presses / sub / "__init__.py").exists():
            sys.exit(f"{SCRIPT}: {presses / sub} not found; --ctr-src must be a CTRPress checkout")
    # Only the two missing subpackages resolve to the checkout; every other module stays kvpress 0.5.5's.
    kvpress.presses.__path__.append(str(presses))
    import kvpress.presses.ctr_press.ctr_press as ctr_module
    import kvpress.presses.qsm_press.qsm_press as qsm_module
    from kvpress.presses.ctr_press import CTRPress
    from kvpress.presses.ctr_press.rescue import compute_score_entropy
    from kvpress.presses.qsm_press import QSMPress
    from kvpress.presses.qsm_press.semantic_score import compute_semantic_weights

    original = qsm_module.merge_removed_values

    def head_shared_merge(values, kept_indices, removed_indices, **kwargs):
        if kept_indices.dim() == 3:
            assert bool((kept_indices == kept_indices[:, :1]).all()), "heads keep different positions"
            kept_indices = kept_indices[:, 0]
        return original(values=values, kept_indices=kept_indices, removed_indices=removed_indices, **kwargs)

    qsm_module.merge_removed_values = head_shared_merge
    ctr_module.merge_removed_values = head_shared_merge
    return QSMPress, CTRPress, compute_semantic_weights, compute_score_entropy


class FakeModule:
    """What the reference presses read from an attention module."""

    def __init__(self, attention: LlamaAttention, layer_idx: int):
        self._attention = attention
        self.q_proj = attention.q_proj
        self.config = attention.config
        self.head_dim = attention.head_dim
        self.layer_idx = layer_idx


def run_press(press, module, hidden, keys, values, position_embeddings, input_ids, tok, query_length):
    press.set_runtime_state(input_ids=input_ids, query_length=query_length, tokenizer=tok)
    kwargs = {"position_embeddings": position_embeddings}
    with torch.no_grad():
        scores = press.score(module, hidden, keys, values, None, kwargs)
        base = press.last_merge_scores_by_layer[module.layer_idx]
        new_keys, new_values = press.compress(module, hidden, keys, values, None, kwargs)
    kept = press.retained_indices_by_layer[module.layer_idx]
    assert torch.equal(keys.gather(2, kept[..., None].expand(-1, -1, -1, keys.shape[-1])), new_keys)
    return (scores.float().clone().contiguous(), base.float().clone().contiguous(), kept.clone().contiguous(),
            new_values.clone().contiguous())


def mqa_case(refs, tok, tensors: dict, runs: list):
    QSMPress, CTRPress, _, _ = refs
    torch.manual_seed(1234)
    hidden_size, heads, kv_heads, head_dim, seq = 32, 4, 1, 16, 80
    config = LlamaConfig(hidden_size=hidden_size, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, intermediate_size=64, num_hidden_layers=1, vocab_size=2048)
    attention = LlamaAttention(config, layer_idx=0)
    with torch.no_grad():
        for proj in (attention.q_proj, attention.k_proj):
            proj.weight.normal_(0.0, 0.35)  # peaked attention
    module = FakeModule(attention, 0)
    hidden = torch.randn(1, seq, hidden_size)
    position_ids = torch.arange(seq)[None]
    cos, sin = LlamaRotaryEmbedding(config)(hidden, position_ids)
    with torch.no_grad():
        k = attention.k_proj(hidden).view(1, seq, kv_heads, head_dim).transpose(1, 2)
        keys = apply_rope(k, cos, sin).contiguous()
    values = torch.randn(1, kv_heads, seq, head_dim)
    input_ids = torch.randint(3, 2048, (1, seq))
    tensors.update({"mqa.keys": keys, "mqa.values": values, "mqa.hidden_states": hidden.contiguous(),
                    "mqa.q_proj": attention.q_proj.weight.detach().contiguous(), "mqa.cos": cos[0].contiguous(),
                    "mqa.sin": sin[0].contiguous(), "mqa.input_ids": input_ids})

    small = {"sink_tokens": "2", "recent_tokens": "8", "pseudo_query_len": "6"}
    configs = [
        # (name, class, ratio, params as text (C++ registry names), explicit query length)
        ("qsm_default", "QSMPress", 0.5, {}, 0),
        ("qsm_small", "QSMPress", 0.6, dict(small), 0),
        ("qsm_small_nosem", "QSMPress", 0.6, {**small, "use_semantic": "false", "qa_alpha": "0.25",
                                                "score_normalization": "false"}, 0),
        ("qsm_query_merge", "QSMPress", 0.6, {**small, "query_length": "12"}, 12),
        ("qsm_query_merge_uniform", "QSMPress", 0.5, {**small, "query_length": "12", "merge_weighting": "uniform",
                                                        "merge_count_power": "0"}, 12),
        ("qsm_pseudo_merge", "QSMPress", 0.7, {**small, "merge_in_pseudo_query": "true",
                                                 "merge_min_score_ratio": "0.2", "merge_score_power": "2"}, 0),
        ("ctr_default", "CTRPress", 0.3, {"entropy": "reference"}, 0),
        ("ctr_small", "CTRPress", 0.6, {**small, "entropy": "reference"}, 0),
        ("ctr_query_merge", "CTRPress", 0.6, {**small, "query_length": "12", "entropy": "reference"}, 12),
        ("ctr_no_adapt", "CTRPress", 0.5, {**small, "use_layer_adaptive": "false", "rescue_ratio": "0.3",
                                            "merge_in_pseudo_query": "true"}, 0),
    ]
    for name, cls_name, ratio, params, query_length in configs:
        cls = QSMPress if cls_name == "QSMPress" else CTRPress
        kwargs = {key: float(text) if key in FLOAT_PARAMS else parse_value(text) for key, text in params.items()
                  if key not in ("query_length", "entropy")}  # runtime state / C++-only option
        press = cls(compression_ratio=ratio, **kwargs)
        scores, base, kept, new_values = run_press(press, module, hidden, keys, values, (cos, sin), input_ids, tok,
                                                    query_length)
        tensors.update({f"mqa.{name}.scores": scores, f"mqa.{name}.base_scores": base,
                        f"mqa.{name}.kept_indices": kept, f"mqa.{name}.values": new_values})
        runs.append({"case": "mqa", "name": name, "press": cls_name, "compression_ratio": ratio, "params": params,
                     "n_kept": int(kept.shape[-1])})


def tiny_cases(refs, tok, path: Path, stories: list[str], tensors: dict, runs: list):
    QSMPress, CTRPress, _, compute_score_entropy = refs
    model = load_model(path, "eager")
    _, ids = first_story_with(tok, stories, min_tokens=160)
    ids = ids[:, :160]
    tensors["tiny.input_ids"] = ids.contiguous()
    with capture(model) as captured, torch.no_grad():
        model.model(input_ids=ids, past_key_values=DynamicCache())
    for layer_idx in range(len(model.model.layers)):
        layer = captured[layer_idx]
        hidden, position_embeddings = layer["hidden_states"], layer["position_embeddings"]
        keys, values, module = layer["keys"], layer["values"], layer["module"]
        for name, cls, ratio in (("qsm", QSMPress, 0.5), ("ctr", CTRPress, 0.5), ("ctr", CTRPress, 0.25)):
            press = cls(compression_ratio=ratio)
            scores, base, kept, _ = run_press(press, module, hidden, keys, values, position_embeddings, ids, tok, 0)
            tag = f"tiny_l{layer_idx}.{name}_r{ratio}"
            tensors[f"{tag}.kept_indices"] = kept
            if name == "qsm":
                tensors[f"{tag}.scores"] = scores
                tensors[f"{tag}.base_scores"] = base
            entropy = float(compute_score_entropy(scores).mean())
            runs.append({"case": f"tiny_l{layer_idx}", "name": f"{name}_r{ratio}", "press": cls.__name__,
                         "compression_ratio": ratio, "params": {"entropy": "reference"} if name == "ctr" else {},
                         "n_kept": int(kept.shape[-1]), "reference_entropy": None if math.isnan(entropy) else entropy})


def main():
    args = parse_args(__doc__, lambda p: p.add_argument("--ctr-src", type=Path, default=os.environ.get("CTRPRESS_SRC")),
                      out_default=REPO / "tests" / "data" / "ctr")
    if args.ctr_src is None:
        sys.exit(f"{SCRIPT}: give --ctr-src (a checkout of xiyuanyang-code/CTRPress) or set CTRPRESS_SRC")
    setup(threads=2)
    refs = import_reference(args.ctr_src.resolve())
    path = model_dir(args.models)
    stories = load_stories(args.data)
    tok = load_tokenizer(path)

    tensors: dict[str, torch.Tensor] = {}
    runs: list[dict] = []
    vocab = torch.arange(len(tok))[None]
    tensors["semantic_weights"] = refs[2](vocab, tok)[0].contiguous()
    mqa_case(refs, tok, tensors, runs)
    tiny_cases(refs, tok, path, stories, tensors, runs)

    args.out.mkdir(parents=True, exist_ok=True)
    save(tensors, args.out / "ctr_reference.safetensors")
    manifest = {"reference": f"xiyuanyang-code/CTRPress@{REFERENCE_COMMIT}", "kvpress_version": PINNED_KVPRESS,
                "torch_version": torch.__version__, "file": "ctr_reference.safetensors", "runs": runs}
    write_json(args.out / "manifest.json", manifest)
    print(f"wrote {len(runs)} runs, {len(tensors)} tensors to {args.out}")


if __name__ == "__main__":
    main()
