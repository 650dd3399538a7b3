"""The installed Python package (pip install ./python): kvpress_cpp.ops, the press classes and
kvpress_cpp.accelerate().

Usage: python test_package.py [WHEEL]   (run from any directory but the repository's python/ folder;
WHEEL: also check that the wheel scripts/build_wheel.sh made holds the library and the modules)
"""
import copy
import dataclasses
import importlib
import inspect
import io
import json
import os
import pickle
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
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

check = Checklist()
accelerate = importlib.import_module("kvpress_cpp.accelerate")  # the module (kvpress_cpp.accelerate is the function)
os.environ.pop("KVPRESS_CPP_STRICT", None)  # these checks provoke fallbacks; the strict ones ask for it

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
# kvpress's own defaults for every parameter both sides have: numbers, flags, choices and unset
# optionals, as each press declares them (its Params struct); file paths (kvpress downloads by
# model name) and inner presses (kvpress requires one, the registry defaults it) aside.
param_types = {p["name"]: {q["name"]: q["type"] for q in p["params"]} for p in catalog["presses"]}
inner_press_params = {"press", "presses", "prefilling_press", "decoding_press"}
mismatches, compared = [], 0
for name, cls in presses.PRESSES.items():
    theirs = getattr(kvpress, name, None)
    if theirs is None or not dataclasses.is_dataclass(theirs):
        continue
    their_defaults = {f.name: f.default for f in dataclasses.fields(theirs) if f.default is not dataclasses.MISSING}
    for f in dataclasses.fields(cls):
        if f.name not in their_defaults or f.name == "compression_ratio" or f.name in inner_press_params \
                or param_types[name].get(f.name) == "path":
            continue
        compared += 1
        if f.default != their_defaults[f.name]:
            mismatches.append(f"{name}.{f.name}: ours {f.default!r}, kvpress {their_defaults[f.name]!r}")
check(f"parameter defaults equal kvpress's ({compared} compared)", compared > 80 and not mismatches,
      "; ".join(mismatches))
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

# ChunkPress hands each chunk the whole forward's RoPE table: NonCausalAttnPress gets the table's last
# rows, as kvpress's code takes them; ExpectedAttentionPress falls back for "inputs".
expected = kept_rows(model, kvpress.ChunkPress(kvpress.NonCausalAttnPress(0.5, chunk_size=64), chunk_length=128))
with kvpress_cpp.accelerate() as handle:
    got = kept_rows(model, kvpress.ChunkPress(kvpress.NonCausalAttnPress(0.5, chunk_size=64), chunk_length=128))
check("ChunkPress(NonCausalAttnPress): kvpress's kept sets, every chunk through kvpress-cpp",
      got == expected and handle.counts() == {"NonCausalAttnPress": {"calls": 10, "fallbacks": 0, "reasons": {}}},
      f"{handle.counts()}, same sets {got == expected}")
with kvpress_cpp.accelerate() as handle:
    kept_rows(model, kvpress.ChunkPress(kvpress.ExpectedAttentionPress(0.5), chunk_length=256))
check("ChunkPress(ExpectedAttentionPress) falls back for 'inputs', naming the chunk's RoPE table",
      handle.calls == 0 and handle.counts()["ExpectedAttentionPress"]["reasons"] == {"inputs": 6}
      and all("RoPE table" in r for r in handle.fallback_reasons), str(handle.fallback_reasons))

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
    check("counts() per press and reason",
          handle.counts() == {"KnormPress": {"calls": 1, "fallbacks": 1, "reasons": {"dtype": 1}}}, str(handle.counts()))
    printed = io.StringIO()
    table = handle.report(file=printed)
    check("report() returns and prints a table of calls and fallbacks per press and reason",
          table == printed.getvalue() and "KnormPress" in table and "dtype 1" in table and "float64" in table
          and handle.report(quiet=True) == table, table)

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
          any("variant: OwnWindow overrides SnapKVPress's compute_window_attention" in r
              for r in handle.fallback_reasons) and handle.counts()["OwnWindow"]["reasons"] == {"variant": 1},
          str(handle.fallback_reasons))

# Only named reasons fall back: the library's other errors reach the caller.
with kvpress_cpp.accelerate() as handle:
    try:
        kvpress.KnormPress(0.5).score(module, None, keys, values[:, :, :20], None, {})  # kvpress ignores values
        check("an input the library refuses for no named reason raises its error, no fallback", False)
    except RuntimeError as e:
        check("an input the library refuses for no named reason raises its error, no fallback",
              "values must have the shape of keys" in str(e) and handle.fallbacks == 0, str(e))
try:
    kvpress_cpp.Unsupported("KnormPress", "it felt like it")
    check("Unsupported takes only the reasons REASONS names", False)
except ValueError as e:
    check("Unsupported takes only the reasons REASONS names", "reason must be one of" in str(e), str(e))
error = pickle.loads(pickle.dumps(kvpress_cpp.Unsupported(kvpress.KnormPress(), "dtype", "float64")))
check("Unsupported keeps the press, reason and detail (pickled too)",
      (error.press, error.reason, error.detail, str(error)) == ("KnormPress", "dtype", "float64",
                                                                 "KnormPress: dtype: float64"), str(error))

# strict=True and KVPRESS_CPP_STRICT raise Unsupported instead of falling back.
with kvpress_cpp.accelerate(strict=True) as handle:
    try:
        kvpress.KnormPress(0.5).score(module, None, keys.double(), values.double(), None, {})
        check("strict=True raises Unsupported on a fallback", False)
    except kvpress_cpp.Unsupported as e:
        check("strict=True raises Unsupported on a fallback", e.press == "KnormPress" and e.reason == "dtype"
              and handle.counts()["KnormPress"]["reasons"] == {"dtype": 1}, str(e))
for value, expected in (("1", True), ("0", False), ("", False), (None, False)):
    if value is None:
        os.environ.pop("KVPRESS_CPP_STRICT", None)
    else:
        os.environ["KVPRESS_CPP_STRICT"] = value
    with kvpress_cpp.accelerate() as handle, kvpress_cpp.accelerate(strict=False) as explicit:
        check(f"KVPRESS_CPP_STRICT={value!r}: strict is {expected}, an explicit strict= wins",
              handle.strict is expected and explicit.strict is False)
os.environ["KVPRESS_CPP_STRICT"] = "yes"
try:
    kvpress_cpp.accelerate()
    check("KVPRESS_CPP_STRICT=yes is an error naming the variable", False)
except ValueError as e:
    check("KVPRESS_CPP_STRICT=yes is an error naming the variable",
          "KVPRESS_CPP_STRICT" in str(e) and not kvpress_cpp.is_accelerated(), str(e))
os.environ.pop("KVPRESS_CPP_STRICT")

# Nesting: the inner block's options apply inside it only; kvpress's methods return at the outermost exit.
original_score = kvpress.KnormPress.score
with kvpress_cpp.accelerate(warn=True) as outer:
    with kvpress_cpp.accelerate(strict=True) as inner:
        check("nested: a second accelerate() is a handle of its own", inner is not outer and outer.active)
        try:
            kvpress.KnormPress(0.5).score(module, None, keys.double(), values.double(), None, {})
            check("nested: the inner strict=True applies inside the inner block", False)
        except kvpress_cpp.Unsupported:
            check("nested: the inner strict=True applies inside the inner block", True)
        kvpress.KnormPress(0.5).score(module, None, keys, values, None, {})
    check("nested: the inner exit keeps acceleration on",
          kvpress_cpp.is_accelerated() and kvpress.KnormPress.score is not original_score and not inner.active)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s64 = kvpress.KnormPress(0.5).score(module, None, keys.double(), values.double(), None, {})
    check("nested: after the inner exit the outer's options (warn, not strict) apply again",
          s64.dtype == torch.float64 and any("float64" in str(w.message) for w in caught))
    check("nested: each handle counts the calls made while it is open",
          (outer.calls, outer.fallbacks, inner.calls, inner.fallbacks) == (1, 2, 1, 1),
          f"outer {outer.counts()}, inner {inner.counts()}")
check("nested: the outermost exit restores kvpress's methods",
      not kvpress_cpp.is_accelerated() and kvpress.KnormPress.score is original_score)
first, second = kvpress_cpp.accelerate(), kvpress_cpp.accelerate()
first.close()
on_after_first = kvpress_cpp.is_accelerated()
second.close()
second.close()  # idempotent
check("handles closed out of order: acceleration ends with the last one",
      on_after_first and not kvpress_cpp.is_accelerated() and kvpress.KnormPress.score is original_score)

# Every field of every accelerated kvpress class is handed to the library or decides a fallback.
unhandled, unknown, extra = [], [], []
for name in kvpress_cpp.accelerated_presses():
    theirs = [f.name for f in dataclasses.fields(getattr(kvpress, name))]
    mapped, fallback = accelerate.mapped_fields(name), accelerate.fallback_fields(name)
    unhandled += [f"{name}.{f}" for f in theirs if f not in mapped and f not in fallback]
    ours = {f.name for f in dataclasses.fields(presses.PRESSES[name])}
    unknown += [f"{name}.{f} -> {p}" for f, p in mapped.items() if p not in ours]
    extra += [f"{name}.{p}" for p in sorted(ours - set(mapped.values())) if p not in accelerate.CPP_ONLY.get(name, ())]
check("every kvpress field of an accelerated press is mapped or a declared fallback", not unhandled,
      "neither: " + ", ".join(unhandled))
check("every mapped field is a parameter of the registry press", not unknown, ", ".join(unknown))
check("the registry's parameters kvpress lacks are declared C++-only (left at defaults)", not extra, ", ".join(extra))

hs = torch.randn(1, 40, 128)
with kvpress_cpp.accelerate() as handle:
    for press, field in ((kvpress.SnapKVPress(0.5, window_size=4, kernel_size=4), "kernel_size"),
                         (kvpress.RandomPress(0.5, seed=-1), "seed"),
                         (kvpress.StreamingLLMPress(0.5, n_sink=True), "n_sink")):
        try:
            press.score(model.model.layers[0].self_attn, hs, keys, values, None, {})
        except Exception:  # kvpress's own method may refuse the value: only the recorded reason matters
            pass
        check(f"{type(press).__name__}: a {field} value the library cannot honour falls back naming it",
              any(r.startswith(f"{type(press).__name__}: parameter: {field}=") for r in handle.fallback_reasons),
              str(handle.fallback_reasons))
    compactor = kvpress.CompactorPress(0.5)
    object.__setattr__(compactor, "_leverage_press", kvpress.LeverageScorePress(0.5, sketch_dimension=8))
    try:
        compactor.score(model.model.layers[0].self_attn, hs, keys, values, None, {})
    except Exception:
        pass
    check("CompactorPress: an inner press unlike the one its fields build falls back naming the field",
          any("parameter: _leverage_press=" in r and "sketch_dimension" in r for r in handle.fallback_reasons),
          str(handle.fallback_reasons))
    # A field this version does not know (as a newer kvpress may add): its default goes through, any
    # other value falls back naming it.
    saved = accelerate._FIELDS["StreamingLLMPress"].pop("n_sink")
    try:
        calls = handle.calls
        kvpress.StreamingLLMPress(0.5).score(module, None, keys, values, None, {})
        kvpress.StreamingLLMPress(0.5, n_sink=8).score(module, None, keys, values, None, {})
    finally:
        accelerate._FIELDS["StreamingLLMPress"]["n_sink"] = saved
    check("an unmapped field at its default goes through, at another value falls back naming it",
          handle.calls == calls + 1 and any("parameter: n_sink=8 (a field kvpress-cpp does not map)" in r
                                            for r in handle.fallback_reasons), str(handle.fallback_reasons))

# An attention module that is not Llama-like: only presses that need its projections fall back.
odd = copy.deepcopy(model.model.layers[0].self_attn)
odd.q_proj = torch.nn.Sequential(odd.q_proj)  # computes the same, but has no weight of its own
cos, sin = model.model.rotary_emb(hs, torch.arange(40)[None])
with kvpress_cpp.accelerate() as handle, torch.no_grad():
    kvpress.KnormPress(0.5).score(odd, hs, keys, values, None, {"position_embeddings": (cos, sin)})
    kvpress.SnapKVPress(0.5, window_size=4).score(odd, hs, keys, values, None, {"position_embeddings": (cos, sin)})
check("a q_proj without a weight: KnormPress goes through, SnapKVPress falls back for 'module'",
      handle.counts() == {"KnormPress": {"calls": 1, "fallbacks": 0, "reasons": {}},
                          "SnapKVPress": {"calls": 0, "fallbacks": 1, "reasons": {"module": 1}}}, str(handle.counts()))

# Qwen2's attention biases and Qwen3's q/k norms: every accelerated press keeps kvpress's sets.
for family_config, family_model in ((Qwen2Config, Qwen2ForCausalLM), (Qwen3Config, Qwen3ForCausalLM)):
    torch.manual_seed(3)
    family = family_model(family_config(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256, num_hidden_layers=2,
        vocab_size=300, head_dim=16, attn_implementation="sdpa")).eval()
    # transformers initialises biases to 0 and norm weights to 1, which would hide a dropped bias and
    # (with RMS-normed keys of equal norms) make KnormPress's scores all ties.
    with torch.no_grad():
        for name, tensor in family.named_parameters():
            if name.endswith(".bias"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.uniform_(0.5, 1.5)
    for name in kvpress_cpp.accelerated_presses():
        if name == "ObservedAttentionPress":  # needs an eager model; its inputs do not depend on the family
            continue
        kw = {"window_size": 16} if name == "SnapKVPress" else {}
        expected = kept_rows(family, getattr(kvpress, name)(compression_ratio=0.5, **kw))
        with kvpress_cpp.accelerate() as handle:
            got = kept_rows(family, getattr(kvpress, name)(compression_ratio=0.5, **kw))
        check(f"accelerated {name} on {family_model.__name__}: kvpress's kept sets, every call through kvpress-cpp",
              got == expected and handle.calls == 2 and handle.fallbacks == 0,
              f"calls {handle.calls}, fallbacks {handle.fallback_reasons}, same sets {got == expected}")

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
