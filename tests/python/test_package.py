"""The installed Python package (pip install ./python): kvpress_cpp.ops, the press classes and
kvpress_cpp.accelerate().

Usage: python test_package.py [WHEEL]   (run from any directory but the repository's python/ folder;
WHEEL: also check that the wheel scripts/build_wheel.sh made holds the library and the modules)
"""
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile
import warnings
import zipfile

import torch

import kvpress
import kvpress_cpp
from checklist import Checklist
from kvpress_cpp import ops, presses
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

check = Checklist()

# ---- ops --------------------------------------------------------------------------------------
registered = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kvpress::"))
wrapped = sorted(n for n, f in vars(ops).items() if inspect.isfunction(f) and f.__module__ == ops.__name__
                 and not n.startswith("_") and n != "params_list")
check("every torch.ops.kvpress op has a kvpress_cpp.ops wrapper, and only those", registered == wrapped,
      f"missing {sorted(set(registered) - set(wrapped))}, extra {sorted(set(wrapped) - set(registered))}")
check("every wrapper has a docstring and type hints",
      all(getattr(ops, n).__doc__ and getattr(ops, n).__annotations__.get("return") for n in wrapped))
torch.manual_seed(0)
keys, values = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
check("ops.key_norm_scores", torch.equal(ops.key_norm_scores(keys), torch.ops.kvpress.key_norm_scores(keys)))
try:
    ops.topk_indices(torch.zeros(2, 3), 1)
    check("a refused input raises the library's error", False)
except RuntimeError as e:
    check("a refused input raises the library's error", "topk_indices: scores must be" in str(e), str(e))

# ---- press classes ----------------------------------------------------------------------------
catalog = json.loads(ops.registry_json())
check("a class per registry press", sorted(presses.PRESSES) == sorted(p["name"] for p in catalog["presses"]))
# kvpress's own defaults for every parameter both sides have (file paths and inner presses aside).
mismatches = []
for name, cls in presses.PRESSES.items():
    theirs = getattr(kvpress, name, None)
    if theirs is None or not dataclasses.is_dataclass(theirs):
        continue
    their_defaults = {f.name: f.default for f in dataclasses.fields(theirs) if f.default is not dataclasses.MISSING}
    for f in dataclasses.fields(cls):
        if f.name in their_defaults and not isinstance(their_defaults[f.name], (str, type(None))) \
                and f.default != their_defaults[f.name] and f.name != "compression_ratio":
            mismatches.append(f"{name}.{f.name}: ours {f.default!r}, kvpress {their_defaults[f.name]!r}")
check("parameter defaults equal kvpress's", not mismatches, "; ".join(mismatches))
snap = presses.SnapKVPress(0.5, window_size=8)
q = torch.randn(1, 4, 8, 16)
k, v, kept = snap.compress(keys, values, queries=q)
ref = ops.press_compress("SnapKVPress", 0.5, {"window_size": 8}, keys, values, queries=q)
check("SnapKVPress(0.5, window_size=8).compress = ops.press_compress",
      all(torch.equal(a, b) for a, b in zip((k, v, kept), ref)))
check("score() of a scorer", torch.equal(presses.KnormPress(0.5).score(keys, values), -keys.norm(dim=-1))
      or torch.allclose(presses.KnormPress(0.5).score(keys, values), -keys.norm(dim=-1), atol=1e-6))
ada = presses.AdaKVPress(presses.SnapKVPress(0.5, window_size=8))
check("a wrapper takes its inner press and that press's ratio",
      ada.ratio() == 0.5 and ada.params() == {"press": "SnapKVPress", "press.window_size": "8",
                                              "press.kernel_size": "5", "alpha_safeguard": "0.2"}, str(ada.params()))
pk, pv, positions, lengths = ada.compress_ragged(keys, values, queries=q)
check("AdaKVPress.compress_ragged keeps n_kept tokens in all", int(lengths.sum()) == 2 * ops.n_kept(40, 0.5))
try:
    presses.AdaKVPress(presses.SnapKVPress(0.5)).score(keys, values)
    check("score() of a wrapper raises", False)
except TypeError as e:
    check("score() of a wrapper raises", "only scorer presses" in str(e), str(e))

# ---- accelerate() -----------------------------------------------------------------------------
torch.manual_seed(1)
config = LlamaConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256,
                     num_hidden_layers=2, vocab_size=300, head_dim=16)
config._attn_implementation = "sdpa"  # no attention weights: the presses compute their queries
model = LlamaForCausalLM(config).eval()
eager_config = LlamaConfig.from_dict(config.to_dict())
eager_config._attn_implementation = "eager"  # ObservedAttentionPress reads the weights
eager = LlamaForCausalLM(eager_config).eval()
eager.load_state_dict(model.state_dict())
ids = torch.randint(0, 300, (1, 600))


def kept_rows(m, press):
    """Each layer's and head's kept key rows as a set. The global seed first: RandomPress,
    LeverageScorePress, CompactorPress and CURPress draw from the default generator on both sides."""
    torch.manual_seed(7)
    with torch.no_grad(), press(m):
        cache = m(ids, use_cache=True).past_key_values
    return [[{tuple(r) for r in layer.keys[0, h].round(decimals=5).tolist()} for h in range(layer.keys.shape[1])]
            for layer in cache.layers]


check("accelerated_presses() lists presses kvpress has",
      all(hasattr(kvpress, n) for n in kvpress_cpp.accelerated_presses()) and len(kvpress_cpp.accelerated_presses()) >= 13)
for name in kvpress_cpp.accelerated_presses():
    kw = {"window_size": 16} if name == "SnapKVPress" else {}
    m = eager if name == "ObservedAttentionPress" else model
    expected = kept_rows(m, getattr(kvpress, name)(compression_ratio=0.5, **kw))
    with kvpress_cpp.accelerate() as handle:
        got = kept_rows(m, getattr(kvpress, name)(compression_ratio=0.5, **kw))
    check(f"accelerated {name}: kvpress's kept sets, every call through kvpress-cpp",
          got == expected and handle.calls == 2 and handle.fallbacks == 0,
          f"calls {handle.calls}, fallbacks {handle.fallback_reasons}, same sets {got == expected}")

# A decoding press's steps: its inner SnapKV/TOVA scores the buffered hidden states' last queries
# (rotated, as kvpress does, by the new token's RoPE row); the cache must end as kvpress's.
def decoded_cache(press):
    torch.manual_seed(7)
    with torch.no_grad(), press(model):
        cache = DynamicCache()
        out = model.generate(ids[:, :100], max_new_tokens=24, do_sample=False, past_key_values=cache)
    return out, [[{tuple(r) for r in layer.keys[0, h].round(decimals=5).tolist()} for h in range(layer.keys.shape[1])]
                 for layer in cache.layers]


for inner in (kvpress.SnapKVPress(window_size=4), kvpress.TOVAPress()):
    def make():
        return kvpress.DecodingPress(base_press=type(inner)(**dataclasses.asdict(inner)), compression_interval=8,
                                     target_size=96, hidden_states_buffer_size=16)
    expected = decoded_cache(make())
    with kvpress_cpp.accelerate() as handle:
        got = decoded_cache(make())
    check(f"DecodingPress({type(inner).__name__}) steps through kvpress-cpp end with kvpress's cache and tokens",
          torch.equal(got[0], expected[0]) and got[1] == expected[1] and handle.calls > 0 and handle.fallbacks == 0,
          f"calls {handle.calls}, fallbacks {handle.fallback_reasons}, tokens equal {torch.equal(got[0], expected[0])}")

original = kvpress.KnormPress.compress
with kvpress_cpp.accelerate():
    check("is_accelerated() inside the block", kvpress_cpp.is_accelerated() and kvpress.KnormPress.compress is not original)
check("the block's end restores kvpress's methods",
      not kvpress_cpp.is_accelerated() and kvpress.KnormPress.compress is original)

# Fallbacks: float64 keys, a press subclass, and the loud flag.
module = type("M", (), {"head_dim": 16})()
with kvpress_cpp.accelerate(warn=True) as handle:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s64 = kvpress.KnormPress(0.5).score(module, None, keys.double(), values.double(), None, {})
    check("float64 keys fall back to kvpress, loudly with warn=True",
          s64.dtype == torch.float64 and handle.fallbacks == 1 and any("float64" in str(w.message) for w in caught),
          str(handle.fallback_reasons))
    s32 = kvpress.KnormPress(0.5).score(module, None, keys, values, None, {})
    check("float32 keys go through kvpress-cpp", handle.calls == 1 and torch.allclose(s32, -keys.norm(dim=-1)))

    class PlainSubclass(kvpress.KnormPress):
        pass

    PlainSubclass(0.5).score(module, None, keys, values, None, {})
    check("a subclass overriding nothing goes through kvpress-cpp", handle.calls == 2, str(handle.fallback_reasons))

    class OwnWindow(kvpress.SnapKVPress):
        @staticmethod
        def compute_window_attention(module, hidden_states, keys, window_size, position_embeddings):
            raise AssertionError("kvpress's method is the one called")

    try:  # kvpress's own score then fails on this bare module: only the recorded reason matters
        OwnWindow(0.5, window_size=4).score(module, None, keys, values, None, {})
    except Exception:
        pass
    check("a subclass overriding a helper of the scores falls back to kvpress's method",
          any("overrides SnapKVPress's compute_window_attention" in r for r in handle.fallback_reasons),
          str(handle.fallback_reasons))

# ---- the wheel -------------------------------------------------------------------------------
if len(sys.argv) > 1:
    names = zipfile.ZipFile(sys.argv[1]).namelist()
    needed = {"kvpress_cpp/libkvpress.so", "kvpress_cpp/__init__.py", "kvpress_cpp/ops.py", "kvpress_cpp/presses.py",
              "kvpress_cpp/accelerate.py", "kvpress_cpp/_library.py", "kvpress_cpp/_build_info.py"}
    check("the wheel holds the library and the modules", needed <= set(names), str(sorted(names)))
    with tempfile.TemporaryDirectory() as unpacked:  # the wheel's own files, ahead of the installed package
        zipfile.ZipFile(sys.argv[1]).extractall(unpacked)
        probe = ("import kvpress_cpp, torch; assert kvpress_cpp.__file__.startswith(%r), kvpress_cpp.__file__; "
                 "k = torch.randn(1, 2, 8, 16); print(torch.equal(kvpress_cpp.ops.key_norm_scores(k), "
                 "kvpress_cpp.presses.KnormPress(0.5).score(k, k)))" % unpacked)
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=unpacked))
        check("the wheel's package imports and computes on its own", run.returncode == 0 and run.stdout.strip() == "True",
              run.stderr[-500:])
check.finish()
