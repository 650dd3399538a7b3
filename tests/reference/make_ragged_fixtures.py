#!/usr/bin/env python3
"""Parity fixtures for the presses with head or layer budgets, produced by the pinned kvpress.

    python make_ragged_fixtures.py --out DIR [--models DIR] [--data FILE]

Presses: AdaKVPress, CriticalKVPress, CriticalAdaKVPress, PyramidKVPress,
PerLayerCompressionPress. Each run goes through kvpress's own mechanism on a model with SDPA
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

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Both check the pinned kvpress version on import.
from make_fixtures import _kvpress_version, parse_value  # noqa: E402
from make_model_fixtures import PROMPTS, load_stories  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import kvpress  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MASKED = ("AdaKVPress", "CriticalAdaKVPress")
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
    # Ratios leaving >= 64 (SnapKV's window) of the 140-token prompt: see PyramidKVPress above.
    ("PerLayerCompressionPress", {"press": "SnapKVPress", "compression_ratios": "0.25,0.5"}),
]
MODEL_RATIO = 0.5

SHORT_DTYPE = {torch.float32: "f32", torch.bfloat16: "bf16"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def build_press(name: str, params: dict[str, str], ratio: float | None):
    """A kvpress press from the C++ registry's parameter syntax."""
    inner_params = {k[len("press."):]: parse_value(v) for k, v in params.items() if k.startswith("press.")}
    rest = {k: v for k, v in params.items() if k != "press" and not k.startswith("press.")}
    if name == "PyramidKVPress":
        return kvpress.PyramidKVPress(compression_ratio=ratio, **{k: parse_value(v) for k, v in rest.items()})
    if name == "PerLayerCompressionPress":
        ratios = [float(x) for x in rest.pop("compression_ratios").split(",")]
        inner = getattr(kvpress, params["press"])(compression_ratio=0.0, **inner_params)
        return kvpress.PerLayerCompressionPress(press=inner, compression_ratios=ratios)
    inner = getattr(kvpress, params["press"])(compression_ratio=ratio, **inner_params)
    return getattr(kvpress, name)(press=inner, **{k: parse_value(v) for k, v in rest.items()})


def run_tag(name: str, params: dict[str, str], ratio) -> str:
    tag = name + "".join(f"_{k.replace('press.', '')}{v.replace(',', '+')}" for k, v in params.items() if k != "press")
    if "press" in params:
        tag += "_" + params["press"]
    return tag + ("" if ratio is None else f"_r{ratio:g}")


def random_model(head_dim: int, dtype: torch.dtype) -> LlamaForCausalLM:
    """A small hidden size (128 < Hq * D) keeps the fixtures fast and small; the attention shapes
    are what matters here."""
    torch.manual_seed(4321 + head_dim)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
        rope_theta=10000.0,
        # Peaked rather than near-uniform attention (fewer near-ties), as make_fixtures.py.
        initializer_range=0.08, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval().to(dtype)


# ---------------------------------------------------------------------------------------------
# What kvpress sees and does
# ---------------------------------------------------------------------------------------------
def capture_hooks(model, sink: dict):
    """Forward hooks (registered before the press's, so they run first) recording what kvpress's
    hook receives in every layer during prefill."""
    def hook(module, args, kwargs, output):
        hs = kwargs["hidden_states"]
        if hs.shape[1] != kwargs["past_key_values"].layers[module.layer_idx].keys.shape[2]:
            return output  # not the prefill
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        sink[module.layer_idx] = {
            "keys": layer.keys.detach().clone(), "values": layer.values.detach().clone(),
            "hidden_states": hs.detach().clone(),
            "cos": kwargs["position_embeddings"][0][0].detach().clone(),
            "sin": kwargs["position_embeddings"][1][0].detach().clone(),
        }
        return output
    return [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]


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
            new_keys = cache.layers[l].keys
            match = (new_keys.unsqueeze(3) == keys.unsqueeze(2)).all(-1)  # [B, H, n_kept, S]
            assert bool((match.sum(-1) == 1).all()), "a kept key matches no (or several) cached positions"
            kept = match.to(torch.int64).argmax(-1)
            assert torch.equal(values.gather(2, kept.unsqueeze(-1).expand_as(cache.layers[l].values)),
                               cache.layers[l].values)
            mask = torch.zeros(b, h, s, dtype=torch.bool)
            mask.scatter_(2, kept, True)
        out[l] = mask.contiguous()
    return out


def prefill(model, press, ids, sink: dict):
    cache = DynamicCache()
    hooks = capture_hooks(model, sink)
    try:
        with torch.no_grad(), press(model):
            model.model(input_ids=ids, past_key_values=cache)
    finally:
        for hk in hooks:
            hk.remove()
    return cache


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

    base: dict = {}
    prefill(model, kvpress.KnormPress(compression_ratio=0.0), prefix, base)
    tensors = {"cos": base[0]["cos"], "sin": base[0]["sin"],
               "inv_freq": model.model.rotary_emb.inv_freq.detach().to(torch.float32)}
    for l, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for key in ("keys", "values", "hidden_states"):
            tensors[f"{key}_l{l}"] = base[l][key]
        for proj in ("q_proj", "k_proj", "o_proj"):
            tensors[f"{proj}_l{l}"] = getattr(attn, proj).weight.detach()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{name}.inputs.safetensors"))
    case = {"name": name, "dtype": DTYPE_NAMES[dtype], "inputs": f"{name}.inputs.safetensors",
            "batch": batch, "num_heads": 8, "num_kv_heads": 2, "head_dim": head_dim, "seq_len": seq_len,
            "num_layers": num_layers, "new_tokens": N_NEW, "runs": []}

    for press_name, params, ratios in LAYER_RUNS:
        if press_name == "CriticalAdaKVPress" and batch > 1:
            continue
        for ratio in ratios:
            press = build_press(press_name, params, ratio)
            seen: dict = {}
            cache = prefill(model, press, prefix, seen)
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
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{run}.safetensors"))
            case["runs"].append({"name": run, "press": press_name, "params": dict(params),
                                 "compression_ratio": press.compression_ratio, "masked": press_name in MASKED,
                                 "file": f"{run}.safetensors"})
    return case


# ---------------------------------------------------------------------------------------------
# Model runs on TinyStories-656K
# ---------------------------------------------------------------------------------------------
def decode_one_by_one(model, cache, question: torch.Tensor, context_length: int, steps: int):
    """make_model_fixtures.decode_tail (kvpress's pipeline: question at the original positions,
    then greedy steps) with the question fed one token per forward, which equals one causal
    forward; transformers cannot mask a multi-token forward over layers of different lengths."""
    logits = []
    for i in range(question.shape[1]):
        out = model(input_ids=question[:, i:i + 1], past_key_values=cache,
                    position_ids=torch.tensor([[context_length + i]]))
        logits.append(out.logits[0, -1])
    question_logits = torch.stack(logits).contiguous()
    q = question.shape[1]
    fed, logits = [], []
    next_id = question_logits[-1].argmax()
    for i in range(steps):
        fed.append(next_id)
        out = model(input_ids=next_id.view(1, 1), past_key_values=cache,
                    position_ids=torch.tensor([[context_length + q + i]]))
        logits.append(out.logits[0, -1])
        next_id = out.logits[0, -1].argmax()
    return question_logits, torch.stack(fed).to(torch.int64), torch.stack(logits).contiguous()


def model_runs(out: Path, models: Path, data: Path) -> dict:
    model_dir = models / "tinystories-656k"
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"make_ragged_fixtures.py: model not found at {model_dir} (use --models or KVPRESS_MODELS)")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = LlamaForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa", dtype=torch.float32).eval()
    stories = load_stories(data)
    entry = {"model": str(model_dir), "attn_implementation": "sdpa", "prompts": []}
    for name, story, prefix_len, n_question, n_decode in PROMPTS:
        ids = tok(stories[story], return_tensors="pt").input_ids
        prefix, question = ids[:, :prefix_len], ids[:, prefix_len:prefix_len + n_question]
        prompt = {"name": name, "input_ids": f"model__{name}.safetensors", "prefix_len": prefix_len,
                  "question_len": n_question, "runs": []}
        save_file({"input_ids": ids[:, :prefix_len + n_question].contiguous()}, str(out / prompt["input_ids"]))
        for press_name, params in MODEL_RUNS:
            press = build_press(press_name, params, MODEL_RATIO)
            seen: dict = {}
            cache = prefill(model, press, prefix, seen)
            kept = kept_masks(model, press_name, seen, cache)
            with torch.no_grad():
                q_logits, fed, d_logits = decode_one_by_one(model, cache, question, prefix_len, n_decode)
            run = f"model__{name}__{run_tag(press_name, params, None)}"
            tensors = {"question_logits": q_logits, "decode_tokens": fed, "decode_logits": d_logits}
            for l, mask in kept.items():
                tensors[f"kept_l{l}"] = mask
            save_file(tensors, str(out / f"{run}.safetensors"))
            prompt["runs"].append({"name": run, "press": press_name, "params": dict(params),
                                   "compression_ratio": MODEL_RATIO, "masked": press_name in MASKED,
                                   "file": f"{run}.safetensors"})
        entry["prompts"].append(prompt)
    return entry


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--models", type=Path,
                        default=Path(os.environ.get("KVPRESS_MODELS", REPO.parent / "shared" / "models")))
    parser.add_argument("--data", type=Path, default=None,
                        help="stories file (default: <models>/../data/tinystories_valid_100.txt)")
    args = parser.parse_args()
    data = args.data or args.models.parent / "data" / "tinystories_valid_100.txt"

    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds synchronisation
    torch.manual_seed(0)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import logging
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # PerLayerCompressionPress's flash-attention warning
    start = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / "manifest.json"]:
        if stale.exists():
            stale.unlink()

    recorder = AttentionRecorder()
    try:
        cases = [layer_case(out, recorder, *c) for c in LAYER_CASES]
    finally:
        recorder.restore()
    model = model_runs(out, args.models, data)
    manifest = {"kvpress_version": _kvpress_version,
                "torch_version": torch.__version__, "transformers_version": transformers.__version__,
                "layer_cases": cases, "model": model}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    n_runs = sum(len(c["runs"]) for c in cases) + sum(len(p["runs"]) for p in model["prompts"])
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"make_ragged_fixtures: {n_runs} runs, {size / 2**20:.1f} MiB in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
