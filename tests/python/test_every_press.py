"""Every registry press through kvpress-cli and torch.ops.kvpress.press_compress*, each given exactly the
LayerInputs fields the registry says it needs.

Usage: python test_every_press.py /path/to/kvpress-cli /path/to/libkvpress.so

The table is the registry itself (`kvpress-cli list --json`): for every press, the first of its input
alternatives plus its required fields (and QSMPress/CTRPress's optional input_ids) are written to a
safetensors file and passed to the CLI and, by name, to the ops. Both must succeed (a press that needs
the engine's second pass must refuse, naming it) and agree on the kept positions; the ScorerPresses'
scores must agree with press_scores. Then each of those fields is left out in turn: the ops must
refuse, unless what is left still satisfies another of the press's alternatives, so that the
registry's lists are exact.
"""
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

cli, library = sys.argv[1], sys.argv[2]
torch.ops.load_library(library)
ops = torch.ops.kvpress

B, HKV, HQ, S, D, HIDDEN = 2, 2, 4, 100, 8, 32
RATIO = 0.5


def full_inputs():
    """Every tensor field of LayerInputs, of consistent shapes (B=2, Hkv=2, Hq=4, S=100, D=8)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    keys, values, queries = randn(B, HKV, S, D), randn(B, HKV, S, D), randn(B, HQ, S, D)
    logits = queries @ keys.repeat_interleave(HQ // HKV, dim=1).transpose(-1, -2) / math.sqrt(D)
    attentions = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.outer(torch.arange(S).float(), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return {
        "keys": keys, "values": values, "queries": queries, "attentions": attentions,
        "hidden_states": randn(B, S, HIDDEN),
        "q_proj": randn(HQ * D, HIDDEN) / math.sqrt(HIDDEN), "k_proj": randn(HKV * D, HIDDEN) / math.sqrt(HIDDEN),
        "o_proj": randn(HIDDEN, HQ * D) / math.sqrt(HQ * D),
        "q_norm": 1 + 0.1 * randn(D), "k_norm": 1 + 0.1 * randn(D),
        "cos": emb.cos(), "sin": emb.sin(), "inv_freq": inv_freq,
        "input_ids": torch.randint(0, 500, (B, S), generator=g),
    }


registry = json.loads(subprocess.run([cli, "list", "--json"], check=True, capture_output=True, text=True).stdout)
tensor_fields = {f["name"] for f in registry["layer_inputs"] if f["shape"] and f["name"] not in ("keys", "values")}
scalars = {"layer_idx": 1, "num_layers": 2}  # layer-aware budgets see the last of two layers
# Scalar fields a press may require, at a value that runs it (0 is their "not given").
REQUIRED_SCALARS = {"question_length": 8}  # FinchPress: the last 8 positions are the question
everything = full_inputs()
failures, checks = [], 0


def fail(message):
    failures.append(message)
    print("FAIL " + message)


def params_of(press):
    # Presses that draw random numbers get a seed, so that the CLI and the ops agree.
    params = ["seed=1"] if any(p["name"] == "seed" for p in press["params"]) else []
    # Files a press reads (QFilterPress's filters, ExpectedAttentionStatsPress's statistics, KVzapPress's
    # surrogate, LUKVPress's budget curves, DuoAttentionPress's pattern, FastKVzipPress's gates, RestoreKVPress's
    # restore folder, TriAttentionPress's query statistics): random ones.
    params += [f"{p['name']}={ARTIFACTS[p['name']]}" for p in press["params"] if p["type"] == "path"]
    if press["name"] == "SimLayerKVPress":  # it reads its inputs only where it judges a layer
        params += ["lazy_threshold=0.5", "n_recent=16"]
    if press["name"] == "DuoAttentionPress":  # streaming heads only with a head ratio
        params += ["head_compression_ratio=0.5"]
    if press["name"] == "DMSPress":  # its default threshold None cannot compress; Knorm scores -||k||
        params += [f"threshold={-D ** 0.5}", "sliding_window_size=4"]
    return params


def given_fields(press):
    """The first alternative, the required fields, and the optional tensors a press reads."""
    inputs = press["inputs"]
    chosen = list(inputs["alternatives"][0]["fields"]) if inputs["alternatives"] else []
    chosen += inputs["required"]
    return chosen, [f for f in inputs["optional"] if f in tensor_fields]


def ratio_of(press):
    return 0.0 if press["no_ratio"] else RATIO  # e.g. a DecodingPress's budget is its target_size


with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    # Random artifacts of this model's shape (num_layers for scalars' layer_idx 1 of 2).
    g = torch.Generator().manual_seed(5)
    ARTIFACTS = {"q_filters": tmp / "qfilters.safetensors", "stats_folder": tmp / "eastats",
                 "kvzap_model": tmp / "kvzap", "budget_curves": tmp / "lukv_curves.safetensors",
                 "attention_pattern": tmp / "duo_pattern", "gates": tmp / "fastkvzip_gates.safetensors",
                 "restore": tmp / "restore", "stats_file": tmp / "triattention_stats.safetensors"}
    save_file({"q_filters": torch.randn(scalars["num_layers"], HKV, D, generator=g)}, str(ARTIFACTS["q_filters"]))
    ARTIFACTS["stats_folder"].mkdir()
    a = torch.randn(scalars["num_layers"], HQ, D, D, generator=g)
    save_file({"query_mean": torch.randn(scalars["num_layers"], HQ, D, generator=g),
               "query_cov": (a @ a.transpose(-1, -2) / D).contiguous()}, str(ARTIFACTS["stats_folder"] / "model.safetensors"))
    save_file({"budget_curves": torch.rand(99, scalars["num_layers"], HKV, generator=g)}, str(ARTIFACTS["budget_curves"]))
    ARTIFACTS["attention_pattern"].mkdir()  # DuoAttention: sink 4, recent 16, scores [num_layers, Hkv]
    (ARTIFACTS["attention_pattern"] / "config.json").write_text('{"sink_size": 4, "recent_size": 16}')
    (ARTIFACTS["attention_pattern"] / "full_attention_heads.tsv").write_text("\n".join(
        "\t".join(str(float(x)) for x in row) for row in torch.rand(scalars["num_layers"], HKV, generator=g)) + "\n")
    ARTIFACTS["kvzap_model"].mkdir()  # an MLP surrogate hidden -> 8 -> Hkv per layer
    save_file({f"layers.{i}.{j}.{w}": torch.randn(*shape, generator=g) for i in range(scalars["num_layers"])
               for j, w, shape in ((0, "weight", (8, HIDDEN)), (0, "bias", (8,)), (2, "weight", (HKV, 8)),
                                   (2, "bias", (HKV,)))}, str(ARTIFACTS["kvzap_model"] / "model.safetensors"))
    gate_shapes = {"q_proj.weight": (HKV * (HQ // HKV) * 16, HIDDEN), "q_proj.bias": (HKV * (HQ // HKV) * 16,),
                   "k_proj.weight": (HKV * 16, HIDDEN), "q_norm.weight": (16,), "k_norm.weight": (16,),
                   "k_base": (HKV, 1, 4, 16), "b": (HKV, 1, HQ // HKV)}  # FastKVzipPress: 4 sink keys per gate
    save_file({f"layers.{i}.{k}": torch.randn(*shape, generator=g) for i in range(scalars["num_layers"])
               for k, shape in gate_shapes.items()}, str(ARTIFACTS["gates"]))
    pairs = (scalars["num_layers"], HQ, D // 2)  # TriAttentionPress: the queries' complex mean and mean modulus
    q_re, q_im = torch.randn(*pairs, generator=g), torch.randn(*pairs, generator=g)
    save_file({"q_mean_real": q_re, "q_mean_imag": q_im,
               "q_abs_mean": torch.hypot(q_re, q_im) + torch.rand(*pairs, generator=g)}, str(ARTIFACTS["stats_file"]))
    ARTIFACTS["restore"].mkdir()  # RestoreKVPress: 8 restore embeddings, a rank-2 LoRA on layer 0's q_proj
    save_file({"restore_embeddings": torch.randn(8, HIDDEN, generator=g)},
              str(ARTIFACTS["restore"] / "restore_embeddings.safetensors"))
    (ARTIFACTS["restore"] / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 4}')
    lora = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    save_file({lora + "A.weight": torch.randn(2, HIDDEN, generator=g),
               lora + "B.weight": torch.randn(HQ * D, 2, generator=g)}, str(ARTIFACTS["restore"] / "adapter_model.safetensors"))
    for press in registry["presses"]:
        name = press["name"]
        chosen, optional = given_fields(press)
        fields = chosen + optional
        press_scalars = {**scalars, **{f: REQUIRED_SCALARS[f] for f in fields if f in REQUIRED_SCALARS}}
        fields = [f for f in fields if f not in REQUIRED_SCALARS]
        for field in fields:
            if field not in tensor_fields:
                fail(f"{name}: declares '{field}', which is no LayerInputs tensor field")
        tensors = {"keys": everything["keys"], "values": everything["values"]}
        tensors.update({f: everything[f] for f in fields})
        path, out = tmp / f"{name}.safetensors", tmp / f"{name}.out.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
                  metadata={k: str(v) for k, v in press_scalars.items()})
        cmd = [cli, "compress", "--press", name, "--ratio", str(ratio_of(press)), "--input", str(path),
               "--output", str(out), "--quiet"]
        for p in params_of(press):
            cmd += ["--param", p]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        checks += 1
        args = (name, ratio_of(press), params_of(press), everything["keys"], everything["values"])
        kwargs = {**{f: everything[f] for f in fields}, **press_scalars}

        if press["kind"] == "second_pass":
            # It cannot compress a layer on its own: both entry points refuse, pointing to the second pass.
            if proc.returncode != 2 or "second pass" not in proc.stderr:
                fail(f"{name}: the CLI should refuse with the second pass named, got {proc.returncode}: {proc.stderr}")
            try:
                ops.press_compress(*args, **kwargs)
                fail(f"{name}: press_compress should refuse")
            except RuntimeError as error:
                if "second pass" not in str(error):
                    fail(f"{name}: press_compress refused without naming the second pass: {error}")
            continue
        if proc.returncode != 0:
            fail(f"{name} with {fields or 'keys/values only'}: the CLI failed ({proc.returncode}): {proc.stderr.strip()}")
            continue
        cli_out = load_file(str(out))

        # The same press through the ops, given the same fields by name.
        try:
            packed_keys, packed_values, packed_positions, lengths = ops.press_compress_ragged(*args, **kwargs)
        except RuntimeError as error:
            fail(f"{name} with {fields}: press_compress_ragged raised: {str(error).splitlines()[0]}")
            continue
        if "lengths" in cli_out:  # head-ragged: the CLI writes the same packed layout
            same = torch.equal(cli_out["kept_indices"], packed_positions) and torch.equal(cli_out["lengths"], lengths)
            if not same:
                fail(f"{name}: CLI and press_compress_ragged keep different positions")
        else:
            keys_out, values_out, kept = ops.press_compress(*args, **kwargs)
            if not torch.equal(cli_out["kept_indices"], kept):
                fail(f"{name}: CLI and press_compress keep different positions")
            if not (torch.equal(cli_out["keys"], keys_out) and torch.equal(cli_out["values"], values_out)):
                fail(f"{name}: CLI and press_compress return different keys/values")
            if not torch.equal(packed_positions, kept.flatten()):
                fail(f"{name}: press_compress_ragged and press_compress disagree")
            if "scores" in cli_out and not torch.allclose(cli_out["scores"], ops.press_scores(*args, **kwargs)):
                fail(f"{name}: CLI scores differ from press_scores")

        # Exactly these fields: without any one of them the press must refuse, unless the rest still
        # covers another alternative.
        alternatives = [set(a["fields"]) | set(press["inputs"]["required"]) for a in press["inputs"]["alternatives"]]
        for field in chosen:
            checks += 1
            rest = set(fields) - {field}
            still_enough = any(alternative <= rest | set(press_scalars) - {field} for alternative in alternatives)
            try:
                left = {k: v for k, v in press_scalars.items() if k != field}
                ops.press_compress_ragged(*args, **{f: everything[f] for f in rest if f in everything}, **left)
                if not still_enough:
                    fail(f"{name}: runs without '{field}', so the registry should not list it as needed")
            except RuntimeError as error:
                if still_enough:
                    fail(f"{name}: refuses without '{field}' though {sorted(rest)} cover an alternative: {error}")
        print(f"ok   {name} ({press['kind']}) with {' + '.join(fields) or 'keys/values only'}")

if failures:
    print(f"{len(failures)} of {checks} checks failed", file=sys.stderr)
    sys.exit(1)
print(f"test_every_press.py: {len(registry['presses'])} presses, {checks} checks passed")
