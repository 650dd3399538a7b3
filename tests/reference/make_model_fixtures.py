#!/usr/bin/env python3
"""Model-level fixtures for kvpress-cpp's Llama runner, produced by the pinned packages.

    python make_model_fixtures.py --out DIR [--models DIR] [--data FILE]

Runs transformers (float32, eager attention) on TinyStories-656K and kvpress's own mechanism
(`with press(model): model.model(prefix, past_key_values=cache)`, then the question and greedy
decode tokens at the ORIGINAL position ids, as kvpress's pipeline does) and writes:

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
                         prefill, and the question/decode logits over the compressed cache;
* eval.json              the protocol of `kvpress-cli eval` (prefill the first half of a story,
                         with kvpress's press in the hook, teacher-force the rest at the original
                         positions) on the first EVAL_STORIES stories with a prefix of at least
                         EVAL_MIN_PREFIX tokens, for EVAL_PRESSES at EVAL_RATIO: per-story mean NLL
                         and greedy agreement with the full cache. tests/cli/test_eval_parity.py
                         compares `kvpress-cli eval --json` with it;
* manifest.json          what is where. tests/test_llama.cpp reads it.

CPU only, two threads, deterministic. Takes a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from pinned import require_pinned_kvpress  # noqa: E402

_kvpress_version = require_pinned_kvpress("make_model_fixtures.py")

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM  # noqa: E402

import kvpress  # noqa: E402
from kvpress.presses.scorer_press import ScorerPress  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "tinystories-656k"

# Every press of the C++ registry (kvpress class name, parameters as text, named as kvpress
# names them). "seed" on a press whose kvpress class has no seed field (its sketch comes from
# the global generator) means: the global CPU generator is reseeded with it right before each
# layer's compression, which is what the C++ press does with that seed.
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
]
RATIO = 0.5

# (name, story index in the stories file, prefix length incl. BOS, question tokens, decode steps).
# The question is the story's next tokens after the prefix. "long": 400 tokens take LagKV's
# partitioned path (tie-free at ratio 0.5) and NonCausalAttn's padded last chunk; "short": 140
# tokens take LagKV's short-input ramp (and keep 70 >= SnapKV's window of 64, so the window's
# equal max + 1 scores do not straddle the threshold).
PROMPTS = [
    ("long", 2, 400, 8, 8),
    ("short", 1, 140, 8, 8),
]

# kvpress-cli eval's protocol (prefix floor(0.5 * length), as its default), on a few stories. The
# prefix is at least 128 tokens so that SnapKVPress at ratio 0.5 keeps more than its observation
# window of 64: the window's scores are all equal (max + 1), and kvpress breaks such ties
# arbitrarily where kvpress-cpp keeps the lower positions (docs/PRESS_NOTES.md).
EVAL_PREFIX_FRACTION = 0.5
EVAL_MIN_PREFIX = 128
EVAL_STORIES = 3
# Not KnormPress: layer 0's keys of equal tokens have equal norms (RoPE keeps norms), ties again.
EVAL_PRESSES = ["SnapKVPress", "TOVAPress", "StreamingLLMPress"]
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


def parse_value(text: str):
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return float(text)


def run_tag(name: str, params: dict[str, str]) -> str:
    return name + "".join(f"_{k}{v}" for k, v in params.items())


def load_stories(data: Path) -> list[str]:
    text = data.read_text(encoding="utf-8")
    return [s.strip() for s in text.split("<|endoftext|>") if s.strip()]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def tokenizer_cases(model_dir: Path, stories: list[str]) -> list[dict]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    raw = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
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
    (out / "synthetic_tokenizer_cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=0) + "\n",
                                                        encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Model runs
# ---------------------------------------------------------------------------------------------
def decode_tail(model, cache, question: torch.Tensor, context_length: int, steps: int):
    """kvpress's generate_answer with teacher-forced bookkeeping: the question in one forward at
    positions context_length.., then `steps` greedy tokens one at a time. Returns the question
    logits [q, V], the tokens fed during decoding [steps] and their logits [steps, V]."""
    q = question.shape[1]
    position_ids = torch.arange(context_length, context_length + q).unsqueeze(0)
    out = model(input_ids=question, past_key_values=cache, position_ids=position_ids)
    question_logits = out.logits[0]
    fed, logits = [], []
    next_id = question_logits[-1].argmax()
    for i in range(steps):
        fed.append(next_id)
        out = model(input_ids=next_id.view(1, 1), past_key_values=cache,
                    position_ids=torch.tensor([[context_length + q + i]]))
        logits.append(out.logits[0, -1])
        next_id = out.logits[0, -1].argmax()
    return question_logits.contiguous(), torch.stack(fed).to(torch.int64), torch.stack(logits).contiguous()


def spy_on(press, reseed: int | None):
    """Wraps press.compress (the call kvpress's forward_hook makes) to record, per layer, the
    kept positions and, for ScorerPresses, the scores of the very same call."""
    record: dict[int, dict[str, torch.Tensor]] = {}
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        if reseed is not None:
            torch.manual_seed(reseed)
        scores = None
        if isinstance(press, ScorerPress):
            state = torch.random.get_rng_state()
            scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
            torch.random.set_rng_state(state)
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        # Kept positions: where each kept key row sits in the full cache (keys are post-RoPE, so
        # rows of different positions differ).
        match = (new_keys.unsqueeze(3) == keys.unsqueeze(2)).all(-1)  # [B, H, n_kept, S]
        assert bool((match.sum(-1) == 1).all()), "a kept key matches no (or several) cached positions"
        kept = match.to(torch.int64).argmax(-1)
        assert torch.equal(values.gather(2, kept.unsqueeze(-1).expand_as(new_values)), new_values)
        entry = {"kept": kept.sort(-1).values.contiguous()}
        if scores is not None:
            entry["scores"] = scores.to(torch.float32).contiguous()
        record[module.layer_idx] = entry
        return new_keys, new_values

    press.compress = compress
    return record


def prompt_fixture(out: Path, model, tok, stories, prompt) -> tuple[dict, dict]:
    name, story, prefix_len, n_question, n_decode = prompt
    ids = tok(stories[story], return_tensors="pt").input_ids
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
    save_file(tensors, str(out / file))
    entry = {"name": name, "story": story, "prefix_len": prefix_len, "question_len": n_question,
             "decode_steps": n_decode, "file": file, "runs": []}

    stats = {"runs": 0}
    for press_name, params in PRESSES:
        if not hasattr(kvpress, press_name):
            continue
        cls = getattr(kvpress, press_name)
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: parse_value(v) for k, v in params.items() if k in fields}
        reseed = int(params["seed"]) if "seed" in params and "seed" not in fields else None
        press = cls(compression_ratio=RATIO, **kwargs)
        record = spy_on(press, reseed)
        with torch.no_grad():
            cache = DynamicCache()
            with press(model):
                model.model(input_ids=prefix, past_key_values=cache)
            q_logits, fed, d_logits = decode_tail(model, cache, question, prefix_len, n_decode)
        assert sorted(record) == list(range(num_layers)), (press_name, sorted(record))
        tensors = {"question_logits": q_logits, "decode_tokens": fed, "decode_logits": d_logits}
        for layer, rec in record.items():
            tensors[f"kept_l{layer}"] = rec["kept"]
            if "scores" in rec:
                tensors[f"scores_l{layer}"] = rec["scores"]
        run = f"{name}__{run_tag(press_name, params)}"
        save_file(tensors, str(out / f"{run}.safetensors"))
        entry["runs"].append({"name": run, "press": press_name, "params": dict(params),
                              "compression_ratio": RATIO, "file": f"{run}.safetensors",
                              "has_scores": "scores" in record[0]})
        stats["runs"] += 1
    return entry, stats


def eval_fixture(out: Path, model, tok, stories, model_dir: Path, data: Path) -> str:
    """Mean NLL and greedy agreement of the teacher-forced continuation after a compressed prefix,
    as kvpress-cli eval computes them (kvpress::llama::score_continuation)."""
    chosen = []
    for index, text in enumerate(stories):
        ids = tok(text, return_tensors="pt").input_ids
        n = ids.shape[1]
        prefix = int(math.floor(EVAL_PREFIX_FRACTION * n))
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
            position_ids = torch.arange(prefix, n - 1).unsqueeze(0)
            logits = model(input_ids=ids[:, prefix:n - 1], past_key_values=cache,
                           position_ids=position_ids).logits[0].float()
        targets = ids[0, prefix + 1:]
        nll = -logits.log_softmax(-1).gather(1, targets[:, None]).mean().item()
        return nll, logits.argmax(-1)

    full = [score(ids, prefix, None) for _, ids, prefix in chosen]
    results = []
    for name in EVAL_PRESSES:
        nll, agreement = [], []
        for (_, ids, prefix), (_, full_argmax) in zip(chosen, full):
            x, argmax = score(ids, prefix, getattr(kvpress, name)(compression_ratio=EVAL_RATIO))
            nll.append(x)
            agreement.append((argmax == full_argmax).double().mean().item())
        results.append({"press": name, "ratio": EVAL_RATIO, "nll": nll, "agreement": agreement,
                        "mean_nll": sum(nll) / len(nll), "greedy_agreement": sum(agreement) / len(agreement)})
    record = {
        "model": str(model_dir), "text": str(data), "prefix_fraction": EVAL_PREFIX_FRACTION,
        "min_prefix": EVAL_MIN_PREFIX, "max_stories": EVAL_STORIES, "ratio": EVAL_RATIO,
        "stories": [{"index": i, "tokens": ids.shape[1], "prefix": p} for i, ids, p in chosen],
        "full": {"nll": [x for x, _ in full], "mean_nll": sum(x for x, _ in full) / len(full)},
        "results": results,
    }
    (out / "eval.json").write_text(json.dumps(record, indent=1) + "\n")
    return "eval.json"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--models", type=Path,
                        default=Path(os.environ.get("KVPRESS_MODELS", REPO.parent / "shared" / "models")))
    parser.add_argument("--data", type=Path, default=None,
                        help="stories file (default: <models>/../data/tinystories_valid_100.txt)")
    args = parser.parse_args()
    data = args.data or args.models.parent / "data" / "tinystories_valid_100.txt"
    model_dir = args.models / MODEL
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"make_model_fixtures.py: model not found at {model_dir} (use --models or KVPRESS_MODELS)")

    torch.set_num_threads(2)
    torch.manual_seed(0)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    start = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.json")]:
        if stale.exists():
            stale.unlink()

    stories = load_stories(data)
    cases = tokenizer_cases(model_dir, stories)
    (out / "tokenizer_cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=0) + "\n",
                                              encoding="utf-8")
    synthetic_tokenizer(out)

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = LlamaForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32)
    model.eval()
    prompts, n_runs = [], 0
    for prompt in PROMPTS:
        entry, stats = prompt_fixture(out, model, tok, stories, prompt)
        prompts.append(entry)
        n_runs += stats["runs"]
    eval_file = eval_fixture(out, model, tok, stories, model_dir, data)

    manifest = {
        "kvpress_version": _kvpress_version,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "model": MODEL,
        "dtype": "float32",
        "attn_implementation": "eager",
        "stories_file": data.name,
        "tokenizer_cases": "tokenizer_cases.json",
        "synthetic_tokenizer": "synthetic_tokenizer.json",
        "synthetic_tokenizer_cases": "synthetic_tokenizer_cases.json",
        "prompts": prompts,
        "eval": eval_file,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"make_model_fixtures: kvpress {_kvpress_version}: {len(cases)} tokenizer cases, {len(prompts)} prompts, "
          f"{n_runs} press runs, {size / 2**20:.1f} MiB in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
