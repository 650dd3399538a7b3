#!/usr/bin/env python3
"""Model-loop fixtures for kvpress-cpp's decoding presses and wrapper presses, from the pinned kvpress.

    python make_decoding_fixtures.py --out DIR [--models DIR] [--data FILE]

On TinyStories-656K (float32, CPU) with kvpress 0.5.5's own mechanism, following its pipeline
(KVPressTextGenerationPipeline._forward + generate_answer, without the tokenizer templating):

* decoding runs (DECODING_RUNS): prefill the context (with the press only when it is not a
  DecodingPress, i.e. a PrefillDecodingPress's prefilling part), then, inside `with press(model)`,
  the question in one forward at the original positions and greedy tokens one at a time. Recorded:
  the generated tokens, the logits of every step, every decoding compression (the forward it
  happened in, the layer, the cache length before it, the kept ORIGINAL positions: kvpress leaves a
  compressed cache in topk's score order, kvpress-cpp in position order, so slots differ) and the
  final per-layer cache lengths. The model is loaded with sdpa attention (kvpress's default: the
  inner press gets no attention weights) unless the run says "eager";
* wrapper runs (WRAPPER_RUNS): prefill with the wrapper at ratio 0.5 (sdpa model: ChunkKVPress and
  ChunkPress refuse attention weights; the inner presses recompute what they need), then the
  question and teacher-forced decode steps over the compressed cache: per-layer kept positions and
  the logits. KeyRerotationPress continues at the compressed length, as kvpress's pipeline does;
* eval runs (EVAL_RUNS): kvpress-cli eval's protocol with a decoding press: prefill the first half
  of a story, then feed the rest ONE TOKEN PER FORWARD inside `with press(model)` at the original
  positions; per-story mean NLL and argmax of the scored positions;
* decoding_manifest.json: what is where. tests/test_decoding.cpp reads it.

CPU only, one thread, deterministic. Takes about 15 s.
"""

from __future__ import annotations

import time
from pathlib import Path

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (KVPRESS_VERSION, MODEL, continuation_nll, decode_tail, eval_prefix, kept_positions, load_model,
                    load_stories, load_tokenizer, model_dir, parse_args, pipeline_context_length, prepare_out, save,
                    setup, token_ids, versions, write_json)

import torch
from transformers import DynamicCache

from kvpress.utils import compute_n_kept
from kvpress import (
    BlockPress, ChunkKVPress, ChunkPress, ComposedPress, CompressionRatioDecodingPress, DecodingPress,
    EntropyGatedChunkKVPress, KeyDiffPress, KeyRerotationPress, MergingPress, PrefillDecodingPress, SnapKVPress, TOVAPress)

# (name, story, context tokens incl. BOS, question tokens, max new tokens). The question is the
# story's next tokens after the context.
PROMPT = ("story3", 3, 100, 8, 24)

# Decoding runs: (name, C++ registry name, C++ params, Python press factory, attention
# implementation). Small intervals and targets so that every layer compresses several times.
DECODING_RUNS = [
    # SnapKV on the buffered queries (window 4 < the 5 forwards buffered between compressions).
    # Inner scorers here are ORDER-FREE: kvpress leaves a compressed cache in topk's score order and
    # kvpress-cpp in position order, so scorers that look at slot neighbours or slot ranges (SnapKV's
    # pooling with kernel_size > 1, StreamingLLM, LagKV, ChunkKV) differ after the first
    # compression by design (docs/PRESS_NOTES.md). SnapKV with kernel_size=1 has no pooling.
    ("decoding_snapkv", "DecodingPress",
     {"press": "SnapKVPress", "press.window_size": "4", "press.kernel_size": "1", "compression_interval": "5",
      "target_size": "64", "hidden_states_buffer_size": "8"},
     lambda: DecodingPress(base_press=SnapKVPress(window_size=4, kernel_size=1), compression_interval=5,
                           target_size=64, hidden_states_buffer_size=8), "sdpa"),
    # The budget follows the tokens seen; no hidden-state buffer (TOVA reads the current token only).
    ("ratio_tova", "CompressionRatioDecodingPress",
     {"press": "TOVAPress", "compression_interval": "6", "hidden_states_buffer_size": "0"},
     lambda: CompressionRatioDecodingPress(base_press=TOVAPress(), target_compression_ratio=0.5,
                                           compression_interval=6, hidden_states_buffer_size=0), "sdpa"),
    # The same on an eager model: TOVA reads the current forward's attention weights.
    ("ratio_tova_eager", "CompressionRatioDecodingPress",
     {"press": "TOVAPress", "compression_interval": "6", "hidden_states_buffer_size": "0"},
     lambda: CompressionRatioDecodingPress(base_press=TOVAPress(), target_compression_ratio=0.5,
                                           compression_interval=6, hidden_states_buffer_size=0), "eager"),
    # Prefill with SnapKV (window 16, ratio 0.5), then decode with KeyDiff every 4 steps to 40 tokens.
    ("prefill_snapkv_decoding_keydiff", "PrefillDecodingPress",
     {"prefilling_press": "SnapKVPress", "prefilling_press.window_size": "16", "decoding_press": "DecodingPress",
      "decoding_press.press": "KeyDiffPress", "decoding_press.compression_interval": "4",
      "decoding_press.target_size": "40"},
     lambda: PrefillDecodingPress(
         prefilling_press=SnapKVPress(compression_ratio=0.5, window_size=16),
         decoding_press=DecodingPress(base_press=KeyDiffPress(), compression_interval=4, target_size=40)), "sdpa"),
    # The first compression happens in the question's forward (8 tokens >= target 8).
    ("decoding_tova_question", "DecodingPress",
     {"press": "TOVAPress", "compression_interval": "3", "target_size": "8"},
     lambda: DecodingPress(base_press=TOVAPress(), compression_interval=3, target_size=8), "sdpa"),
]
DECODING_RATIO = 0.5  # the registry ratio of the runs (CompressionRatioDecodingPress's target ratio,
                      # the prefilling press's ratio; DecodingPress takes none)

# Wrapper runs at ratio 0.5: (name, C++ registry name, C++ params, Python press factory).
WRAPPER_RATIO = 0.5
WRAPPER_RUNS = [
    ("keyrerotation_snapkv", "KeyRerotationPress", {"press": "SnapKVPress", "press.window_size": "16"},
     lambda r: KeyRerotationPress(press=SnapKVPress(compression_ratio=r, window_size=16))),
    ("chunkkv_snapkv", "ChunkKVPress", {"press": "SnapKVPress", "press.window_size": "16", "chunk_length": "20"},
     lambda r: ChunkKVPress(press=SnapKVPress(compression_ratio=r, window_size=16), chunk_length=20)),
    # KeyDiff, not SnapKV: SnapKV's window tokens tie (each scores the maximum), and a chunk of them
    # is cut to its low_entropy_chunk_length tokens in torch.topk's order among ties.
    ("entropy_gated_keydiff", "EntropyGatedChunkKVPress", {"press": "KeyDiffPress"},
     lambda r: EntropyGatedChunkKVPress(press=KeyDiffPress(compression_ratio=r))),
    ("chunk_keydiff", "ChunkPress", {"press": "KeyDiffPress", "chunk_length": "64"},
     lambda r: ChunkPress(press=KeyDiffPress(compression_ratio=r), chunk_length=64)),
    ("block_keydiff", "BlockPress", {"press": "KeyDiffPress", "block_size": "32"},
     lambda r: BlockPress(press=KeyDiffPress(compression_ratio=r), block_size=32)),
    ("composed_snapkv_keydiff", "ComposedPress",
     {"presses": "SnapKVPress,KeyDiffPress", "presses.0.window_size": "16"},
     lambda r: ComposedPress(presses=[SnapKVPress(compression_ratio=r, window_size=16),
                                      KeyDiffPress(compression_ratio=r)])),
    # The question and decode steps attend over the merged values.
    ("merging_keydiff", "MergingPress", {"press": "KeyDiffPress"},
     lambda r: MergingPress(press=KeyDiffPress(compression_ratio=r))),
]
# (name, story, prefix tokens incl. BOS, question tokens, decode steps)
WRAPPER_PROMPT = ("story1", 1, 140, 8, 8)

# Eval runs: kvpress-cli eval's protocol with a decoding press, on EVAL_STORIES stories.
EVAL_STORIES = [3]
EVAL_RUNS = [
    ("eval_decoding_snapkv", "DecodingPress",
     {"press": "SnapKVPress", "press.window_size": "4", "press.kernel_size": "1", "compression_interval": "8",
      "target_size": "48"},
     lambda: DecodingPress(base_press=SnapKVPress(window_size=4, kernel_size=1), compression_interval=8,
                           target_size=48)),
    ("eval_ratio_keydiff", "CompressionRatioDecodingPress",
     {"press": "KeyDiffPress", "compression_interval": "10"},
     lambda: CompressionRatioDecodingPress(base_press=KeyDiffPress(), target_compression_ratio=0.5,
                                           compression_interval=10)),
]


def registry_ratio(cpp_name: str) -> float:
    """The ratio the C++ registry takes for a decoding run (a DecodingPress takes none)."""
    return 0.0 if cpp_name == "DecodingPress" else DECODING_RATIO


class PositionTracker:
    """The original position of every cache slot, per layer. kvpress leaves a compressed cache in
    topk's score order (kvpress-cpp: position order), so kept SLOTS of later compressions differ
    between the two while the kept POSITIONS must not: events record positions."""

    def __init__(self, num_layers: int):
        self.slots = [torch.zeros(1, 0, dtype=torch.int64) for _ in range(num_layers)]  # [H or 1, S]
        self.current = torch.zeros(0, dtype=torch.int64)  # positions of the forward being run

    def sync(self, layer: int, length: int):
        """Appends the positions of the tokens cached since the last call: consecutive positions
        ending with the current forward's last one."""
        s = self.slots[layer]
        if s.shape[-1] < length:
            last = int(self.current[-1])
            new = torch.arange(last - (length - s.shape[-1]) + 1, last + 1).view(1, -1).expand(s.shape[0], -1)
            self.slots[layer] = torch.cat([s, new], -1)
        assert self.slots[layer].shape[-1] == length

    def keep(self, layer: int, kept: torch.Tensor) -> torch.Tensor:
        """kept: [1, H, n] slots in kvpress's order; returns the kept positions [1, H, n], sorted."""
        s = self.slots[layer].expand(kept.shape[1], -1) if self.slots[layer].shape[0] == 1 else self.slots[layer]
        positions = s.gather(-1, kept[0])
        self.slots[layer] = positions
        return positions.sort(-1).values.unsqueeze(0).contiguous()


def spy_on_compress(press, tracker: PositionTracker, events: list | None, forward_index: list):
    """Records every compression press.compress makes (kvpress's forward hook calls it): the kept
    ORIGINAL positions; events (decoding) also get the forward, layer, cache length and buffer."""
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        tracker.sync(module.layer_idx, keys.shape[2])
        kept = tracker.keep(module.layer_idx, kept_positions(keys, values, new_keys, new_values, sort=False))
        if events is not None:
            events.append({"forward": forward_index[0], "layer": module.layer_idx, "length": keys.shape[2],
                           "buffered": hidden_states.shape[1], "kept": kept})
        return new_keys, new_values

    press.compress = compress


def decoding_run(out: Path, models: dict, tok, stories, run) -> dict:
    name, cpp_name, cpp_params, factory, attn = run
    model = models[attn]
    _, story, context_len, question_len, max_new = PROMPT
    ids = token_ids(tok, stories[story])
    assert ids.shape[1] >= context_len + question_len
    context, question = ids[:, :context_len], ids[:, context_len:context_len + question_len]
    press = factory()
    decoding = press if isinstance(press, DecodingPress) else press.decoding_press
    events: list = []
    forward_index = [0]
    tracker = PositionTracker(model.config.num_hidden_layers)
    tracker.current = torch.arange(context_len)
    spy_on_compress(decoding, tracker, events, forward_index)
    if isinstance(press, PrefillDecodingPress) and press.prefilling_press is not None:
        spy_on_compress(press.prefilling_press, tracker, None, forward_index)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        cache = DynamicCache()
        # kvpress's pipeline: prefill compression only for presses that are not DecodingPresses.
        if not isinstance(press, DecodingPress):
            with press(model):
                model.model(input_ids=context, past_key_values=cache)
        else:
            model.model(input_ids=context, past_key_values=cache)
        prefill_lengths = [cache.get_seq_length(l) for l in range(len(cache))]
        for layer, length in enumerate(prefill_lengths):
            tracker.sync(layer, length)
        with press(model):
            position_ids = torch.arange(context_len, context_len + question_len).unsqueeze(0)
            tracker.current = position_ids[0]
            out_q = model(input_ids=question, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
            logits = [out_q.logits[0, -1]]
            generated = [out_q.logits[0, -1].argmax()]
            position_ids = position_ids[:, -1:] + 1
            for i in range(max_new - 1):
                forward_index[0] = i + 1
                tracker.current = (position_ids + i)[0]
                step = model(input_ids=generated[-1].view(1, 1), past_key_values=cache, position_ids=position_ids + i)
                logits.append(step.logits[0, -1])
                generated.append(step.logits[0, -1].argmax())
                if generated[-1].item() == eos:
                    break
        final_lengths = [cache.get_seq_length(l) for l in range(len(cache))]
    assert events, f"{name}: no decoding compression happened"
    tensors = {"context_ids": context.contiguous(), "question_ids": question.contiguous(),
               "tokens": torch.stack(generated).to(torch.int64), "logits": torch.stack(logits).contiguous()}
    meta = []
    for i, e in enumerate(events):
        tensors[f"kept_{i}"] = e["kept"]
        meta.append({"forward": e["forward"], "layer": e["layer"], "length": e["length"], "buffered": e["buffered"],
                     "kept": f"kept_{i}"})
    file = f"{name}.safetensors"
    save(tensors, out / file)
    return {"name": name, "press": cpp_name, "params": cpp_params, "compression_ratio": registry_ratio(cpp_name),
            "attn_implementation": attn, "file": file, "max_new_tokens": max_new, "eos_token_id": eos,
            "prefill_lengths": prefill_lengths, "final_lengths": final_lengths, "events": meta}


def wrapper_run(out: Path, model, tok, stories, run) -> dict:
    name, cpp_name, cpp_params, factory = run
    _, story, prefix_len, question_len, steps = WRAPPER_PROMPT
    ids = token_ids(tok, stories[story])
    prefix, question = ids[:, :prefix_len], ids[:, prefix_len:prefix_len + question_len]
    press = factory(WRAPPER_RATIO)
    record: dict[int, torch.Tensor] = {}
    original = press.compress
    inner_scores: list = []
    if isinstance(press, KeyRerotationPress):
        # Re-rotated keys match no cached row (and layer 0's values repeat with the token): take the
        # kept positions from the inner scores, as KeyRerotationPress.compress does.
        original_score = press.press.score

        def score(*a, **kw):
            inner_scores.append(original_score(*a, **kw))
            return inner_scores[-1]

        press.press.score = score

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        if isinstance(press, KeyRerotationPress):
            n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
            kept = inner_scores[-1].topk(n_kept, dim=-1).indices.sort(-1).values
            assert torch.equal(values.gather(2, kept.unsqueeze(-1).expand_as(new_values)), new_values)
            record[module.layer_idx] = kept.contiguous()
        elif isinstance(press, MergingPress):  # values blended: the rows found by their unchanged keys
            record[module.layer_idx] = kept_positions(keys, None, new_keys, None)
        else:
            record[module.layer_idx] = kept_positions(keys, values, new_keys, new_values)
        return new_keys, new_values

    if isinstance(press, ComposedPress):
        # ComposedPress's hook runs each press's own hook: record each step, compose to positions.
        sub_kept: dict[int, list] = {}
        for sub in press.presses:
            def sub_compress(module, hidden_states, keys, values, attentions, kwargs, _orig=sub.compress):
                new_keys, new_values = _orig(module, hidden_states, keys, values, attentions, kwargs)
                sub_kept.setdefault(module.layer_idx, []).append(
                    kept_positions(keys, values, new_keys, new_values, sort=False))
                return new_keys, new_values
            sub.compress = sub_compress
    else:
        press.compress = compress
    with torch.no_grad():
        cache = DynamicCache()
        with press(model):
            model.model(input_ids=prefix, past_key_values=cache)
    if isinstance(press, ComposedPress):
        for layer, kept_list in sub_kept.items():
            kept = kept_list[0]
            for nxt in kept_list[1:]:
                kept = kept.gather(-1, nxt)  # slots of the previous press's output, in its (score) order
            record[layer] = kept.sort(-1).values.contiguous()
    assert sorted(record) == list(range(model.config.num_hidden_layers)), (name, sorted(record))
    with torch.no_grad():
        # kvpress's pipeline restarts the positions at the compressed length after KeyRerotationPress.
        start = pipeline_context_length(press, cache, prefix_len)
        q_logits, fed, d_logits = decode_tail(model, cache, question, start, steps)
    tensors = {"input_ids": ids[:, :prefix_len + question_len].contiguous(), "question_logits": q_logits,
               "decode_tokens": fed, "decode_logits": d_logits}
    for layer, kept in record.items():
        tensors[f"kept_l{layer}"] = kept
    file = f"{name}.safetensors"
    save(tensors, out / file)
    return {"name": name, "press": cpp_name, "params": cpp_params, "compression_ratio": WRAPPER_RATIO, "file": file,
            "prefix_len": prefix_len, "question_len": question_len, "decode_steps": steps,
            "position_after_prefill": start}


def eval_run(model, tok, stories, run) -> dict:
    """Mean NLL / argmax of the continuation fed one token per forward with the decoding press."""
    name, cpp_name, cpp_params, factory = run
    results = []
    for index in EVAL_STORIES:
        ids = token_ids(tok, stories[index])
        n = ids.shape[1]
        prefix = eval_prefix(n)
        press = factory()
        with torch.no_grad():
            cache = DynamicCache()
            model.model(input_ids=ids[:, :prefix], past_key_values=cache)
            logits = []
            with press(model):
                for p in range(prefix, n - 1):
                    logits.append(model(input_ids=ids[:, p:p + 1], past_key_values=cache,
                                        position_ids=torch.tensor([[p]])).logits[0, -1].float())
            logits = torch.stack(logits)
        nll = continuation_nll(logits, ids, prefix)
        results.append({"story": index, "ids": ids[0].tolist(), "tokens": n, "prefix": prefix, "nll": nll,
                        "argmax": logits.argmax(-1).tolist(),
                        "final_lengths": [cache.get_seq_length(l) for l in range(len(cache))]})
    return {"name": name, "press": cpp_name, "params": cpp_params, "compression_ratio": registry_ratio(cpp_name),
            "stories": results}


def main():
    args = parse_args(__doc__)
    path = model_dir(args.models)
    start = setup(threads=1)  # the model is tiny: a second thread only waits (12 ms per matmul on a busy machine)
    out = prepare_out(args.out)

    stories = load_stories(args.data)
    tok = load_tokenizer(path)
    models = {impl: load_model(path, impl) for impl in ("sdpa", "eager")}
    decoding = [decoding_run(out, models, tok, stories, run) for run in DECODING_RUNS]
    wrappers = [wrapper_run(out, models["sdpa"], tok, stories, run) for run in WRAPPER_RUNS]
    evals = [eval_run(models["sdpa"], tok, stories, run) for run in EVAL_RUNS]
    manifest = {
        **versions(),
        "model": MODEL,
        "dtype": "float32",
        "stories_file": args.data.name,
        "decoding_runs": decoding,
        "wrapper_runs": wrappers,
        "eval_runs": evals,
    }
    write_json(out / "decoding_manifest.json", manifest)
    n_events = sum(len(r["events"]) for r in decoding)
    print(f"make_decoding_fixtures: kvpress {KVPRESS_VERSION}: {len(decoding)} decoding runs ({n_events} "
          f"compressions), {len(wrappers)} wrapper runs, {len(evals)} eval runs in {out} "
          f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
