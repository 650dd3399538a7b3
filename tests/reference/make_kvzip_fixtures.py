#!/usr/bin/env python3
"""KVzipPress and FastKVzipPress fixtures: the pinned kvpress's KVzip family on TinyStories-656K.

    python make_kvzip_fixtures.py --out DIR [--models DIR] [--data FILE]

For each run kvpress's own mechanism runs, as its pipeline does: `with press(model):
model.model(context, past_key_values=cache)` (the prefill; on leaving the block kvpress replays the
context after its repeat prompt, chunk by chunk, then sets each attention module's
masked_key_indices). We record:

* scores       [L, Hkv, N] float32  kvpress's score_val, before compress_post gives the sinks max + 1
* keep_mask    [L, Hkv, N] bool     the complement of every module's masked_key_indices
* decode_tokens, decode_logits      the story's next token at position N, then greedy tokens, one
                                    per forward, over kvpress's masked cache (its attention patch)

The runs cover the defaults (one replay chunk), other ratios, layerwise budgets, KVzip+
normalization, and several replay chunks (chunk_size below N, with and without sinks); two
KVgradPress runs (its replay with a backward pass per chunk; one chunk, and three with layerwise
budgets).

RestoreKVPress runs (plain and KVzip+, several chunks with layerwise budgets, and a ratio whose
budget-matched eviction reaches 1: every context token goes) read restore artifacts we make, as the
authors' hub folders lay them out: 8 restore embeddings (embedding rows of random tokens plus noise)
and a PEFT LoRA adapter on every projection with random A and B (peft's get_peft_model and
save_pretrained; the KVzip+ one with rsLoRA and a rank_pattern), seeded. kvpress reads them instead
of its download (post_init_from_model replaced by the same steps on the local folder). For them we
also record the restore tokens' keys/values, and the decoding starts at position N + 8, as kvpress's
pipeline continues after the restore tokens. One more RestoreKVPress run reads artifacts trained by
scripts/make_artifact.py's restorekv recipe (20 steps on 4 stories: enough to exercise the folder it
writes).

FastKVzipPress runs (global and layerwise, other sinks and window) read gates that
scripts/make_artifact.py's fastkvzip recipe trains on the first 40 stories (300 steps: enough to
give the scores a realistic spread; parity needs only that both sides read the same gates), saved
as `fastkvzip_gates.safetensors` for the C++ side and handed to kvpress as its FastKVzipGate
modules (instead of its download). For them `scores` is kvpress's stacked score_val.
CPU only, two threads, float32. Takes a few seconds.
"""

from __future__ import annotations

import sys
import time

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (KVPRESS_VERSION, MODEL, REPO, RESTORE_TOKENS, greedy_steps, load_model, load_stories,
                    load_tokenizer, make_restore_artifacts, model_dir, parse_args, parse_value, prepare_out, save,
                    setup, token_ids, use_local_restore, versions, write_json)

import torch
from transformers import DynamicCache

from kvpress import FastKVzipPress, KVgradPress, KVzipPress, RestoreKVPress
from kvpress.presses.fastkvzip_press import FastKVzipGate

sys.path.insert(0, str(REPO / "scripts"))
import make_artifact  # noqa: E402 (scripts/ is not a package)

STORY = 2          # held-out story index
CONTEXT_LEN = 240  # N, BOS included
DECODE_STEPS = 4   # the story's next token, then 3 greedy tokens

GATES_FILE = "fastkvzip_gates.safetensors"
# Restore artifacts (folders as the authors' hub repositories): (folder, seed, LoraConfig extras).
TRAINED_RESTORE = "restore_trained"  # make_artifact.py's restorekv recipe, briefly
RESTORE = {"restore_plain": (11, {}),
           "restore_plus": (12, {"use_rslora": True, "rank_pattern": {"q_proj": 2}})}

# (name, press, parameters as text, kvpress names)
RUNS = [
    ("default_r0.5", "KVzipPress", {"compression_ratio": "0.5"}),
    ("default_r0.25", "KVzipPress", {"compression_ratio": "0.25"}),
    ("default_r0.8", "KVzipPress", {"compression_ratio": "0.8"}),
    ("layerwise_r0.5", "KVzipPress", {"compression_ratio": "0.5", "layerwise": "true"}),
    ("plus_r0.5", "KVzipPress", {"compression_ratio": "0.5", "kvzip_plus_normalization": "true"}),
    ("chunks_r0.5", "KVzipPress", {"compression_ratio": "0.5", "chunk_size": "96"}),
    ("chunks_nosink_r0.6", "KVzipPress", {"compression_ratio": "0.6", "chunk_size": "100", "n_sink": "0"}),
    ("chunks_plus_layerwise_r0.4", "KVzipPress", {"compression_ratio": "0.4", "chunk_size": "64",
                                                  "layerwise": "true", "kvzip_plus_normalization": "true",
                                                  "n_sink": "8"}),
    ("grad_r0.5", "KVgradPress", {"compression_ratio": "0.5"}),
    ("grad_chunks_layerwise_r0.6", "KVgradPress", {"compression_ratio": "0.6", "chunk_size": "80",
                                                   "layerwise": "true", "n_sink": "2"}),
    ("restore_r0.5", "RestoreKVPress", {"compression_ratio": "0.5", "restore": "restore_plain"}),
    ("restore_plus_r0.4", "RestoreKVPress", {"compression_ratio": "0.4", "kvzip_plus_normalization": "true",
                                             "restore": "restore_plus"}),
    ("restore_chunks_layerwise_r0.6", "RestoreKVPress", {"compression_ratio": "0.6", "chunk_size": "100",
                                                         "layerwise": "true", "restore": "restore_plain"}),
    ("restore_all_evicted_r0.97", "RestoreKVPress", {"compression_ratio": "0.97", "restore": "restore_plain"}),
    ("restore_trained_r0.5", "RestoreKVPress", {"compression_ratio": "0.5", "restore": TRAINED_RESTORE}),
    ("fast_r0.5", "FastKVzipPress", {"compression_ratio": "0.5"}),
    ("fast_r0.75", "FastKVzipPress", {"compression_ratio": "0.75"}),
    ("fast_layerwise_r0.5", "FastKVzipPress", {"compression_ratio": "0.5", "layerwise": "true"}),
    ("fast_window_r0.6", "FastKVzipPress", {"compression_ratio": "0.6", "n_sink": "0", "window_ratio": "0.1"}),
]


def kvpress_gates(state_dicts: list[dict], model) -> list[FastKVzipGate]:
    """kvpress's gate modules holding the given weights (what its download would give)."""
    config = model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    gates = []
    for i, sd in enumerate(state_dicts):
        sink, dim = sd["k_base"].shape[2], sd["k_base"].shape[3]
        gate = FastKVzipGate(i, config.hidden_size, config.num_key_value_heads, groups, torch.float32, dim, sink)
        gate.load_state_dict(sd)
        gates.append(gate.eval())
    return gates


def run_press(model, context, first_token, name: str, params: dict, gates, out):
    kwargs = {k: parse_value(v) for k, v in params.items() if k != "restore"}
    press = {"KVzipPress": KVzipPress, "KVgradPress": KVgradPress, "FastKVzipPress": FastKVzipPress,
             "RestoreKVPress": RestoreKVPress}[name](**kwargs)
    if name == "FastKVzipPress":
        press.gates = gates
    if name == "RestoreKVPress":
        use_local_restore(press, out / params["restore"])
    n = context.shape[1]
    record = {}
    compress_post = press.compress_post

    def spy(m):
        if name != "FastKVzipPress":  # before compress_post gives the sinks max + 1
            record["scores"] = press.score_val[:, 0].detach().to(torch.float32).clone().contiguous()
        compress_post(m)
        if name == "FastKVzipPress":  # stacked by compress_post
            record["scores"] = press.score_val[:, 0].detach().to(torch.float32).clone().contiguous()

    press.compress_post = spy
    for layer in model.model.layers:  # an earlier run's masks
        layer.self_attn.masked_key_indices = None
    with torch.no_grad():
        cache = DynamicCache()
        with press(model):
            model.model(input_ids=context, past_key_values=cache)
        n_restore = RESTORE_TOKENS if name == "RestoreKVPress" else 0
        assert [layer.keys.shape[2] for layer in cache.layers] == [n + n_restore] * len(cache.layers)
        restore = {}
        if n_restore:  # the restore tokens' keys/values, after the context in every layer
            restore = {"restore_keys": torch.stack([layer.keys[0, :, n:] for layer in cache.layers]).contiguous(),
                       "restore_values": torch.stack([layer.values[0, :, n:] for layer in cache.layers]).contiguous()}
        masks = []
        for layer in model.model.layers:
            b, h, s = layer.self_attn.masked_key_indices
            assert bool((b == 0).all()) and bool((s < n).all())
            mask = torch.ones(model.config.num_key_value_heads, n, dtype=torch.bool)
            mask[h, s] = False
            masks.append(mask)
        tokens, logits = greedy_steps(model, cache, first_token, n + n_restore, DECODE_STEPS)
    return {"scores": record["scores"], "keep_mask": torch.stack(masks).contiguous(), "decode_tokens": tokens,
            "decode_logits": logits, **restore}


def main():
    args = parse_args(__doc__)
    path = model_dir(args.models)
    start = setup(threads=2)
    out = prepare_out(args.out)

    stories = load_stories(args.data)
    tok = load_tokenizer(path)
    # sdpa: kvpress's attention patch (which applies masked_key_indices) wraps the non-eager
    # attention functions, and KVzipPress refuses an eager model.
    model = load_model(path, "sdpa")
    ids = token_ids(tok, stories[STORY])
    assert ids.shape[1] > CONTEXT_LEN, ids.shape
    context, first_token = ids[:, :CONTEXT_LEN].contiguous(), ids[0, CONTEXT_LEN]
    save({"context_ids": context}, out / "inputs.safetensors")

    trained, _ = make_artifact.train_fastkvzip(model, tok, stories, num_train=40, num_test=1, steps=300)
    state_dicts = [{k: v.detach().clone() for k, v in gate.state_dict().items()} for gate in trained]
    make_artifact.save_fastkvzip_gates(out / GATES_FILE, state_dicts, {"recipe": "make_artifact.py fastkvzip, 300 steps"})
    gates = kvpress_gates(state_dicts, model)

    for folder, (seed, extras) in RESTORE.items():
        make_restore_artifacts(load_model(path, "sdpa"), out / folder, seed, extras)
    adapted, embeddings, fit = make_artifact.train_restorekv(
        load_model(path, "sdpa"), tok, stories, num_train=4, num_test=1, ratio=0.5, num_tokens=RESTORE_TOKENS, rank=4,
        steps=20, context_len=96, continuation_len=32, lr=1e-2, seed=0)
    make_artifact.save_restore_folder(out / TRAINED_RESTORE, adapted, embeddings, fit)

    runs = []
    for name, press, params in RUNS:
        save(run_press(model, context, first_token, press, params, gates, out), out / f"{name}.safetensors")
        if press == "FastKVzipPress":
            params = {**params, "gates": GATES_FILE}
        runs.append({"name": name, "press": press, "file": f"{name}.safetensors",
                     "params": {k: v for k, v in params.items() if k != "compression_ratio"},
                     "compression_ratio": float(params["compression_ratio"])})

    write_json(out / "manifest.json", {**versions(), "model": MODEL, "dtype": "float32", "story": STORY,
                                       "context_len": CONTEXT_LEN, "decode_steps": DECODE_STEPS,
                                       "inputs": "inputs.safetensors", "runs": runs})
    print(f"make_kvzip_fixtures: kvpress {KVPRESS_VERSION}: {len(runs)} runs in {out} "
          f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
