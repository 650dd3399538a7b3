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

import argparse
import json
import math
import os
import sys
from pathlib import Path

from pinned import PINNED_KVPRESS, require_pinned_kvpress  # noqa: E402

REFERENCE_COMMIT = "2f6ff3b"
_kvpress_version = require_pinned_kvpress("make_ctr_fixtures.py")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, rotate_half  # noqa: E402

import kvpress.presses  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def import_reference(ctr_src: Path):
    presses = ctr_src / "kvpress" / "presses"
    for sub in ("qsm_press", "ctr_press"):
        if not (presses / sub / "__init__.py").exists():
            sys.exit(f"make_ctr_fixtures.py: {presses / sub} not found; --ctr-src must be a CTRPress checkout")
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
        keys = (k * cos[:, None] + rotate_half(k) * sin[:, None]).contiguous()
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
        kwargs = {}
        for key, text in params.items():
            if key in ("query_length", "entropy"):
                continue  # runtime state / C++-only option
            if key == "merge_weighting":
                kwargs[key] = text
            elif text in ("true", "false"):
                kwargs[key] = text == "true"
            elif "." in text or key in ("qa_alpha", "merge_count_power", "merge_min_score_ratio",
                                        "merge_score_power", "rescue_ratio"):
                kwargs[key] = float(text)
            else:
                kwargs[key] = int(text)
        press = cls(compression_ratio=ratio, **kwargs)
        scores, base, kept, new_values = run_press(press, module, hidden, keys, values, (cos, sin), input_ids, tok,
                                                    query_length)
        tensors.update({f"mqa.{name}.scores": scores, f"mqa.{name}.base_scores": base,
                        f"mqa.{name}.kept_indices": kept, f"mqa.{name}.values": new_values})
        runs.append({"case": "mqa", "name": name, "press": cls_name, "compression_ratio": ratio, "params": params,
                     "n_kept": int(kept.shape[-1])})


def tiny_cases(refs, tok, model_dir: Path, stories: list[str], tensors: dict, runs: list):
    QSMPress, CTRPress, _, compute_score_entropy = refs
    model = LlamaForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", torch_dtype=torch.float32)
    model.eval()
    text = next(s for s in stories if len(tok(s).input_ids) >= 160)
    ids = tok(text, return_tensors="pt").input_ids[:, :160]
    tensors["tiny.input_ids"] = ids.contiguous()
    captured = {}

    def hook(module, args, kwargs, output):
        captured[module.layer_idx] = (kwargs["hidden_states"].detach(), kwargs["position_embeddings"])

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache)
    for h in handles:
        h.remove()
    for layer_idx, attn in enumerate(model.model.layers):
        hidden, position_embeddings = captured[layer_idx]
        keys, values = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
        module = attn.self_attn
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctr-src", type=Path, default=os.environ.get("CTRPRESS_SRC"))
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "ctr")
    parser.add_argument("--models", type=Path, default=None)
    parser.add_argument("--data", type=Path, default=None)
    args = parser.parse_args()
    if args.ctr_src is None:
        sys.exit("make_ctr_fixtures.py: give --ctr-src (a checkout of xiyuanyang-code/CTRPress) or set CTRPRESS_SRC")
    torch.set_num_threads(2)
    transformers.utils.logging.disable_progress_bar()
    refs = import_reference(args.ctr_src.resolve())
    models = args.models or Path(os.environ.get("KVPRESS_MODELS", REPO.parent / "shared" / "models"))
    model_dir = models / "tinystories-656k"
    data = args.data or models.parent / "data" / "tinystories_valid_100.txt"
    stories = [s.strip() for s in data.read_text(encoding="utf-8").split("<|endoftext|>") if s.strip()]
    tok = AutoTokenizer.from_pretrained(str(model_dir))

    tensors: dict[str, torch.Tensor] = {}
    runs: list[dict] = []
    vocab = torch.arange(len(tok))[None]
    tensors["semantic_weights"] = refs[2](vocab, tok)[0].contiguous()
    mqa_case(refs, tok, tensors, runs)
    tiny_cases(refs, tok, model_dir, stories, tensors, runs)

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "ctr_reference.safetensors"))
    manifest = {"reference": f"xiyuanyang-code/CTRPress@{REFERENCE_COMMIT}", "kvpress_version": PINNED_KVPRESS,
                "torch_version": torch.__version__, "file": "ctr_reference.safetensors", "runs": runs}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {len(runs)} runs, {len(tensors)} tensors to {args.out}")


if __name__ == "__main__":
    main()
