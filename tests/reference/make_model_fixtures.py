#!/usr/bin/env python3
"""Model-level fixtures for kvpress-cpp's Llama runner, produced by the pinned packages.

    python make_model_fixtures.py --out DIR [--models DIR] [--data FILE]

Runs transformers (float32, eager attention) on TinyStories-656K and kvpress's own mechanism
(`with press(model): model.model(prefix, past_key_values=cache)`, then the question and greedy
decode tokens at kvpress's pipeline positions: from the ORIGINAL context length, or from the
compressed length after KeyRerotationPress, common.pipeline_context_length) and writes:

* tokenizer_cases.json   token ids (transformers' tokenizer) of all held-out stories and of a few
                         edge-case strings, with their decodes (skip_special_tokens True/False);
* synthetic_tokenizer.json, synthetic_tokenizer_cases.json
                         a tiny tokenizer built with `tokenizers` that has byte-fallback tokens
                         (TinyStories-656K has none), a non-normalized added token and unknown
                         characters, and its encodings/decodings of a few strings;
* <prompt>.safetensors   per prompt: input ids, the prefill logits and eager attention weights of
                         every layer, and the uncompressed question/decode logits;
* <prompt>__<press>.safetensors
                         per press (ratio 0.5): the kept positions and scores of every layer after
                         prefill (KeyRerotationPress: the positions it re-rotates and its inner
                         press's scores), and the question/decode logits over the compressed cache;
* eval.json              the protocol of `kvpress-cli eval` (prefill the first half of a story,
                         with kvpress's press in the hook, teacher-force the rest at the pipeline's
                         positions) on the first EVAL_STORIES stories with a prefix of at least
                         EVAL_MIN_PREFIX tokens, for EVAL_PRESSES at EVAL_RATIO: per-story mean NLL
                         and greedy agreement with the full cache. tests/cli/test_eval_parity.py
                         compares `kvpress-cli eval --json` with it;
* manifest.json          what is where. tests/test_llama.cpp reads it.

CPU only, two threads, deterministic. Takes a few seconds.
"""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
from common import (EVAL_PREFIX_FRACTION, KVPRESS_VERSION, MODEL, PROMPTS, build_press, continuation_nll, decode_tail,
                    eval_prefix, kept_positions, load_model, load_stories, load_tokenizer, model_dir, parse_args,
                    pipeline_context_length, prepare_out, registry_ratio, save, setup, split_seed, token_ids,
                    versions, write_json)

import common
import tokenizers
import torch
from transformers import DynamicCache

import kvpress
from kvpress import KeyRerotationPress

sys.path.insert(0, str(common.REPO / "scripts"))
import make_artifact  # noqa: E402 (scripts/ is not a package)
from kvpress.presses.scorer_press import ScorerPress

# Every press of the C++ registry (kvpress class name, parameters as text, named as kvpress
# names them). "seed" on a press whose kvpress class has no seed field (its sketch comes from
# the global generator) means: the global CPU generator is reseeded with it right before each
# layer's compression, which is what the C++ press does with that seed. A wrapper names its inner
# press with "press" (common.build_press).
QFILTERS_FILE = "qfilters.safetensors"
STATS_FOLDER = "eastats"
KVZAP_FOLDER = "kvzap"
PRESSES = [
    ("RandomPress", {"seed": "42"}),
    ("KnormPress", {}),
    ("StreamingLLMPress", {}),
    ("KeyDiffPress", {}),
    ("SnapKVPress", {}),
    ("LagKVPress", {}),
    ("TOVAPress", {}),
    ("ObservedAttentionPress", {}),
    ("LeverageScorePress", {"seed": "0"}),
    ("NonCausalAttnPress", {}),
    ("CompactorPress", {"seed": "0"}),
    ("ExpectedAttentionPress", {}),
    ("CURPress", {}),
    ("CapPress", {}),
    ("ThinKPress", {}),
    # The filters and statistics scripts/make_artifact.py computes for the model over the stories (main()).
    ("QFilterPress", {"q_filters": QFILTERS_FILE}),
    ("ExpectedAttentionStatsPress", {"stats_folder": STATS_FOLDER}),
    # The MLP surrogate scripts/make_artifact.py kvzap fits to KVzip+ scores of the stories (main()).
    ("KVzapPress", {"kvzap_model": KVZAP_FOLDER}),
    # No ratio; thresholds and windows that judge the bundled model's short prompts (a lazy layer
    # keeps its first 4 and last 31 tokens).
    ("SimLayerKVPress", {"lazy_threshold": "0.5", "n_recent": "32"}),
    # The question and decode steps continue at the compressed length (kvpress's pipeline).
    ("KeyRerotationPress", {"press": "KnormPress"}),
    ("KeyRerotationPress", {"press": "SnapKVPress"}),
]
RATIO = 0.5

# The prompts: common.PROMPTS.

# kvpress-cli eval's protocol (prefix floor(0.5 * length), as its default), on a few stories. The
# prefix is at least 128 tokens so that SnapKVPress at ratio 0.5 keeps more than its observation
# window of 64: the window's scores are all equal (max + 1), and kvpress breaks such ties
# arbitrarily where kvpress-cpp keeps the lower positions (docs/PRESS_NOTES.md).
EVAL_MIN_PREFIX = 128
EVAL_STORIES = 3
# Not KnormPress: layer 0's keys of equal tokens have equal norms (RoPE keeps norms), ties again.
# (name, parameters as text); KeyRerotationPress's continuation starts at the compressed length.
EVAL_PRESSES = [("SnapKVPress", {}), ("TOVAPress", {}), ("StreamingLLMPress", {}),
                ("KeyRerotationPress", {"press": "SnapKVPress"})]
EVAL_RATIO = 0.5

# Tokenizer edge cases besides the stories.
EDGE_TEXTS = [
    "",
    " ",
    "Once upon a time",
    " leading space",
    "trailing space ",
    "double  space   and tabs\there",
    "\n\nnew\nlines\n",
    "Unicode: café — “quotes” ’ 😀 中文",
    "<|start_story|>Once upon a time<|end_story|>",
    "a <|end_story|> b<|start_story|>c",
    "<unk> and <|unknown|>",
    "Lily said, \"I'm happy!\" 123 $4.50 - ok? yes: no; <tag> a|b _x_",
]


def run_tag(name: str, params: dict[str, str]) -> str:
    return name + "".join(f"_{k}{v}" for k, v in params.items())


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def tokenizer_cases(path: Path, stories: list[str]) -> list[dict]:
    tok = load_tokenizer(path)
    raw = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    cases = []
    for kind, texts in (("story", stories), ("edge", EDGE_TEXTS)):
        for i, text in enumerate(texts):
            ids = tok(text).input_ids
            assert ids == raw.encode(text).ids, f"transformers and tokenizers disagree on {text!r}"
            cases.append({
                "name": f"{kind}{i}",
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids, skip_special_tokens=True),
                "decoded_with_special": tok.decode(ids, skip_special_tokens=False),
            })
    return cases


SYNTHETIC_TEXTS = [
    "hello world",
    "héllo wörld 😀",
    "😀é",
    "abcbc abc",
    "</s>hello<s>",
    "x[SEP]y [SEP] z",
    "",
    "\x00\x7f",
    "helloworld hello",
    "😀😀 a 😀",
]


def synthetic_tokenizer(out: Path) -> None:
    """Byte fallback with some bytes missing (-> <unk>), fuse_unk, normalized and non-normalized
    added tokens, merges with equal-rank competition; run by `tokenizers` itself."""
    from tokenizers import AddedToken, decoders, models, normalizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in [*range(0x00, 0x80), 0xC3, 0xA9, 0xB6]:
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in ["\u2581", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c"]:
        vocab[ch] = len(vocab)
    merges = [("\u2581", "h"), ("e", "l"), ("el", "l"), ("\u2581h", "ell"), ("o", "\u2581"), ("\u2581hell", "o\u2581"),
              ("w", "o"), ("r", "l"), ("rl", "d"), ("a", "b"), ("b", "c"), ("ab", "c")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, normalized=True) for t in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken("[SEP]", normalized=False)])
    tok.save(str(out / "synthetic_tokenizer.json"))
    cases = []
    for i, text in enumerate(SYNTHETIC_TEXTS):
        ids = tok.encode(text).ids
        cases.append({"name": f"synthetic{i}", "text": text, "ids": ids,
                      "decoded": tok.decode(ids, skip_special_tokens=True),
                      "decoded_with_special": tok.decode(ids, skip_special_tokens=False)})
    # Byte tokens that do not form valid UTF-8 decode to one U+FFFD each.
    ids = [1, vocab["<0xC3>"], vocab["h"], vocab["<0xC3>"], vocab["<0xA9>"], vocab["<0xA9>"]]
    cases.append({"name": "synthetic_bad_utf8", "text": None, "ids": ids,
                  "decoded": tok.decode(ids, skip_special_tokens=True),
                  "decoded_with_special": tok.decode(ids, skip_special_tokens=False)})
    write_json(out / "synthetic_tokenizer_cases.json", cases, indent=0, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# Model runs
# ---------------------------------------------------------------------------------------------
def spy_on(press, reseed: int | None):
    """Wraps press.compress (the call kvpress's forward_hook makes) to record, per layer, the
    kept positions and, for ScorerPresses, the scores of the very same call. KeyRerotationPress's
    re-rotated keys match no cached row (and layer 0's values repeat with the token): its kept
    positions are the indices it re-rotates, its scores its inner press's."""
    record: dict[int, dict[str, torch.Tensor]] = {}
    original = press.compress
    scorer = press.press if isinstance(press, KeyRerotationPress) else press
    rerotated: list[torch.Tensor] = []
    if isinstance(press, KeyRerotationPress):
        rerotate_keys = press.rerotate_keys  # a staticmethod: the instance attribute shadows it

        def spy_rerotate_keys(module, indices, keys):
            rerotated.append(indices.clone())
            return rerotate_keys(module, indices, keys)

        press.rerotate_keys = spy_rerotate_keys

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        if reseed is not None:
            torch.manual_seed(reseed)
        scores = None
        if isinstance(scorer, ScorerPress):
            state = torch.random.get_rng_state()
            scores = scorer.score(module, hidden_states, keys, values, attentions, kwargs)
            torch.random.set_rng_state(state)
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        if isinstance(press, KeyRerotationPress):
            kept = rerotated.pop()
            assert not rerotated and torch.equal(kept, kept.sort(-1).values), "one ascending selection per layer"
            assert torch.equal(values.gather(2, kept.unsqueeze(-1).expand_as(new_values)), new_values)
            entry = {"kept": kept.contiguous()}
        elif isinstance(press, kvpress.ThinKPress):  # zeroes key channels, keeps every token in place
            assert torch.equal(new_values, values) and new_keys.shape == keys.shape
            b, h, s = keys.shape[:3]
            entry = {"kept": torch.arange(s).expand(b, h, s).contiguous()}
        else:
            entry = {"kept": kept_positions(keys, values, new_keys, new_values)}
        if scores is not None:
            entry["scores"] = scores.to(torch.float32).contiguous()
        record[module.layer_idx] = entry
        return new_keys, new_values

    press.compress = compress
    return record


def prompt_fixture(out: Path, model, sdpa_model, tok, stories, prompt, presses=PRESSES) -> tuple[dict, dict]:
    name, story, prefix_len, n_question, n_decode = prompt
    ids = token_ids(tok, stories[story])
    assert ids.shape[1] >= prefix_len + n_question, (name, ids.shape)
    prefix, question = ids[:, :prefix_len], ids[:, prefix_len:prefix_len + n_question]
    num_layers = model.config.num_hidden_layers

    with torch.no_grad():
        full = model(input_ids=prefix, output_attentions=True)
        cache = DynamicCache()
        model.model(input_ids=prefix, past_key_values=cache)
        q_logits, fed, d_logits = decode_tail(model, cache, question, prefix_len, n_decode)
    tensors = {
        "input_ids": ids[:, :prefix_len + n_question].contiguous(),
        "prefill_logits": full.logits.contiguous(),
        "question_logits": q_logits,
        "decode_tokens": fed,
        "decode_logits": d_logits,
    }
    for layer, attn in enumerate(full.attentions):
        tensors[f"attentions_l{layer}"] = attn.contiguous()
    file = f"{name}.safetensors"
    save(tensors, out / file)
    entry = {"name": name, "story": story, "prefix_len": prefix_len, "question_len": n_question,
             "decode_steps": n_decode, "file": file, "runs": []}

    stats = {"runs": 0}
    for press_name, params in presses:
        if not hasattr(kvpress, press_name):
            continue
        kv_params, reseed = split_seed(press_name, params)
        press = build_press(press_name, kv_params, RATIO)
        record = spy_on(press, reseed)
        with torch.no_grad():
            cache = DynamicCache()
            with press(model):
                model.model(input_ids=prefix, past_key_values=cache)
            context_length = pipeline_context_length(press, cache, prefix_len)
            # Layers of different lengths (SimLayerKVPress's lazy ones): transformers' eager masks
            # have one length for every layer, so the question goes one token per forward through
            # the same weights with SDPA, which needs no mask for one token (the same computation).
            ragged = len({cache.get_seq_length(layer) for layer in range(num_layers)}) > 1
            q_logits, fed, d_logits = decode_tail(sdpa_model if ragged else model, cache, question, context_length,
                                                  n_decode, one_by_one=ragged)
        assert sorted(record) == list(range(num_layers)), (press_name, sorted(record))
        tensors = {"question_logits": q_logits, "decode_tokens": fed, "decode_logits": d_logits}
        for layer, rec in record.items():
            tensors[f"kept_l{layer}"] = rec["kept"]
            if "scores" in rec:
                tensors[f"scores_l{layer}"] = rec["scores"]
        run = f"{name}__{run_tag(press_name, params)}"
        save(tensors, out / f"{run}.safetensors")
        entry["runs"].append({"name": run, "press": press_name, "params": dict(params),
                              "compression_ratio": registry_ratio(press_name, RATIO), "file": f"{run}.safetensors",
                              "has_scores": "scores" in record[0], "context_length": context_length})
        stats["runs"] += 1
    return entry, stats


def eval_fixture(out: Path, model, tok, stories, path: Path, data: Path) -> str:
    """Mean NLL and greedy agreement of the teacher-forced continuation after a compressed prefix,
    as kvpress-cli eval computes them (kvpress::llama::score_continuation). The continuation starts
    where kvpress's pipeline would put a question (pipeline_context_length)."""
    chosen = []
    for index, text in enumerate(stories):
        ids = token_ids(tok, text)
        n = ids.shape[1]
        prefix = eval_prefix(n)
        if EVAL_MIN_PREFIX <= prefix <= n - 2:
            chosen.append((index, ids, prefix))
        if len(chosen) == EVAL_STORIES:
            break

    def score(ids, prefix, press):
        n = ids.shape[1]
        with torch.no_grad():
            cache = DynamicCache()
            if press is None:
                model.model(input_ids=ids[:, :prefix], past_key_values=cache)
            else:
                with press(model):
                    model.model(input_ids=ids[:, :prefix], past_key_values=cache)
            start = pipeline_context_length(press, cache, prefix)
            position_ids = torch.arange(start, start + n - 1 - prefix).unsqueeze(0)
            logits = model(input_ids=ids[:, prefix:n - 1], past_key_values=cache,
                           position_ids=position_ids).logits[0].float()
        return continuation_nll(logits, ids, prefix), logits.argmax(-1)

    full = [score(ids, prefix, None) for _, ids, prefix in chosen]
    results = []
    for name, params in EVAL_PRESSES:
        nll, agreement = [], []
        for (_, ids, prefix), (_, full_argmax) in zip(chosen, full):
            x, argmax = score(ids, prefix, build_press(name, params, EVAL_RATIO))
            nll.append(x)
            agreement.append((argmax == full_argmax).double().mean().item())
        results.append({"press": name, "params": dict(params), "ratio": EVAL_RATIO, "nll": nll,
                        "agreement": agreement, "mean_nll": sum(nll) / len(nll),
                        "greedy_agreement": sum(agreement) / len(agreement)})
    record = {
        "model": str(path), "text": str(data), "prefix_fraction": EVAL_PREFIX_FRACTION,
        "min_prefix": EVAL_MIN_PREFIX, "max_stories": EVAL_STORIES, "ratio": EVAL_RATIO,
        "stories": [{"index": i, "tokens": ids.shape[1], "prefix": p} for i, ids, p in chosen],
        "full": {"nll": [x for x, _ in full], "mean_nll": sum(x for x, _ in full) / len(full)},
        "results": results,
    }
    write_json(out / "eval.json", record)
    return "eval.json"


def main():
    args = parse_args(__doc__)
    path = model_dir(args.models)
    start = setup(threads=2)
    out = prepare_out(args.out)

    stories = load_stories(args.data)
    cases = tokenizer_cases(path, stories)
    write_json(out / "tokenizer_cases.json", cases, indent=0, ensure_ascii=False)
    synthetic_tokenizer(out)

    tok = load_tokenizer(path)
    model, sdpa_model = load_model(path, "eager"), load_model(path, "sdpa")
    filters, _ = make_artifact.qfilters(sdpa_model, tok, stories)
    save({"q_filters": filters}, out / QFILTERS_FILE)
    mean, cov, _ = make_artifact.expected_attention_stats(sdpa_model, tok, stories, sample_seq_len=1000, n_sink=4)
    make_artifact.save_stats_folder(out / STATS_FOLDER, mean, cov,
                                    {"dataset_name": str(args.data), "model_name": str(path), "num_samples": 100,
                                     "sample_seq_len": 1000, "n_sink": 4})
    surrogate, fit = make_artifact.train_kvzap(model, tok, stories, num_train=80, num_test=10, model_type="mlp")
    make_artifact.save_kvzap_folder(out / KVZAP_FOLDER, surrogate, fit)
    common.ARTIFACT_DIR = out
    prompts, n_runs = [], 0
    for prompt in PROMPTS:
        entry, stats = prompt_fixture(out, model, sdpa_model, tok, stories, prompt)
        prompts.append(entry)
        n_runs += stats["runs"]
    eval_file = eval_fixture(out, model, tok, stories, path, args.data)

    manifest = {
        **versions(),
        "tokenizers_version": tokenizers.__version__,
        "model": MODEL,
        "dtype": "float32",
        "attn_implementation": "eager",
        "stories_file": args.data.name,
        "tokenizer_cases": "tokenizer_cases.json",
        "synthetic_tokenizer": "synthetic_tokenizer.json",
        "synthetic_tokenizer_cases": "synthetic_tokenizer_cases.json",
        "prompts": prompts,
        "eval": eval_file,
        # kvpress's press classes: a registry press not among them has no run here to compare.
        "kvpress_presses": sorted(name for name, cls in vars(kvpress).items()
                                  if inspect.isclass(cls) and issubclass(cls, kvpress.BasePress)
                                  and cls not in (kvpress.BasePress, ScorerPress)),
    }
    write_json(out / "manifest.json", manifest)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"make_model_fixtures: kvpress {KVPRESS_VERSION}: {len(cases)} tokenizer cases, {len(prompts)} prompts, "
          f"{n_runs} press runs, {size / 2**20:.1f} MiB in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
