#!/usr/bin/env python3
"""Answers of kvpress's own question-answering pipeline, for kvpress::llama::answer_questions.

    python make_pipeline_fixtures.py --out DIR [--models DIR] [--data FILE]

Runs kvpress 0.5.5's KVPressTextGenerationPipeline ("kv-press-text-generation") on TinyStories-656K
(float32, sdpa attention, as the pipeline loads a model by default) over a held-out story as the
context, for the presses of CASES:

* several questions answered from one compressed cache (the pipeline's `questions=[...]`);
* query-aware (the question inside the compressed prefill), as kvpress's evaluation does it:
  the context text + the question, then an empty question;
* FinchPress, as its documentation says: update_model_and_tokenizer (adds the delimiter token),
  the context + delimiter + question, then an empty question;
* RestoreKVPress with restore artifacts made here (common.make_restore_artifacts, folder `restore`;
  kvpress reads them instead of its download): the pipeline continues after the restore tokens.

Writes pipeline.json: the context, and per case the press (C++ registry syntax), ratio,
query_aware, questions, max_new_tokens and kvpress's answers. tests/test_pipeline.cpp and
tests/cli/test_cli.sh compare kvpress-cpp's answers with them. CPU only, deterministic, seconds.
"""

from __future__ import annotations

from pathlib import Path

# First: importing common checks the pinned kvpress version before torch and kvpress are imported.
import common
from common import (KVPRESS_VERSION, build_press, first_story_with, load_model, load_stories, load_tokenizer,
                    make_restore_artifacts, model_dir, parse_args, prepare_out, setup, versions, write_json)

import torch
from transformers import pipeline as hf_pipeline

import kvpress  # noqa: F401 (registers "kv-press-text-generation")

MAX_NEW_TOKENS = 24
# At least 160 tokens: SnapKVPress at ratio 0.5 then keeps more than its 64-token window (whose
# equal max + 1 scores kvpress would break arbitrarily; docs/PRESS_NOTES.md).
MIN_CONTEXT_TOKENS = 160
QUESTIONS = ["Who is the story about?", "What did they find in the park?", ""]

# (press name or None, parameters in the C++ registry's syntax, ratio, query_aware, questions)
CASES = [
    (None, {}, 0.0, False, QUESTIONS),
    ("SnapKVPress", {}, 0.5, False, QUESTIONS),
    ("StreamingLLMPress", {}, 0.6, False, QUESTIONS),
    ("ExpectedAttentionPress", {}, 0.5, False, QUESTIONS),
    # The questions continue at the compressed length (the pipeline's rule for it).
    ("KeyRerotationPress", {"press": "SnapKVPress"}, 0.5, False, QUESTIONS),
    # Heads keep different counts: kvpress masks, kvpress-cpp stores each head's tokens.
    ("AdaKVPress", {"press": "SnapKVPress"}, 0.5, False, QUESTIONS),
    ("SnapKVPress", {}, 0.5, True, QUESTIONS[:2]),
    ("KnormPress", {}, 0.3, True, QUESTIONS[:1]),
    ("FinchPress", {}, 0.5, True, QUESTIONS[:2]),
    # chunk_length: a third of the prefill (main() sets it), so that the last chunk keeps more
    # than the question's max + 1 scores, which a short last chunk would split (a tie kvpress's
    # torch.topk breaks arbitrarily).
    ("FinchPress", {"chunk_length": "third"}, 0.5, True, QUESTIONS[:1]),
    ("FinchPress", {"normalize_scores": "False"}, 0.6, True, QUESTIONS[:1]),
    # The context replayed after the repeat prompt (one chunk; then three, with layerwise budgets).
    ("KVzipPress", {}, 0.5, False, QUESTIONS),
    ("KVzipPress", {"chunk_size": "64", "layerwise": "true"}, 0.6, False, QUESTIONS[:2]),
    # KVzip + restore tokens (artifacts we make, RESTORE_FOLDER): the questions continue after them.
    ("RestoreKVPress", {"restore": "restore"}, 0.5, False, QUESTIONS),
]
RESTORE_FOLDER = "restore"



def answer(model, tok, context: str, name, params, ratio, query_aware, questions) -> list[str]:
    press = build_press(name, params, ratio) if name else None
    if name == "FinchPress":
        torch.manual_seed(0)  # the delimiter's new embedding row (never used: the press strips it)
        tok = press.update_model_and_tokenizer(model, tok)
    pipe = hf_pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    if not query_aware:
        return pipe(context, questions=questions, press=press, max_new_tokens=MAX_NEW_TOKENS)["answers"]
    answers = []
    for q in questions:
        text = context + (press.delimiter_token if name == "FinchPress" else "") + q
        answers.append(pipe(text, question="", press=press, max_new_tokens=MAX_NEW_TOKENS)["answer"])
    return answers


def main() -> None:
    args = parse_args(__doc__)
    start = setup(threads=2)
    out = prepare_out(args.out)
    path = model_dir(args.models)
    tok = load_tokenizer(path)
    index, ids = first_story_with(tok, load_stories(args.data), MIN_CONTEXT_TOKENS)
    context = load_stories(args.data)[index]
    common.ARTIFACT_DIR = out  # RestoreKVPress's folder, named relative to it
    make_restore_artifacts(load_model(path, "sdpa"), out / RESTORE_FOLDER, seed=13)
    cases = []
    with torch.no_grad():
        for name, params, ratio, query_aware, questions in CASES:
            if params.get("chunk_length") == "third":
                prefill = len(tok.encode(tok.bos_token + context, add_special_tokens=False)) + len(
                    tok.encode(questions[0], add_special_tokens=False))
                params = {**params, "chunk_length": str(-(-prefill // 3))}
            # A fresh model and tokenizer per case: FinchPress adds a token to both.
            model, case_tok = load_model(path, "sdpa"), load_tokenizer(path)
            answers = answer(model, case_tok, context, name, params, ratio, query_aware, questions)
            cases.append({"press": name, "params": params, "compression_ratio": ratio, "query_aware": query_aware,
                          "questions": questions, "answers": answers})
            print(f"  {name or 'no press'} {params} ratio {ratio}{' query-aware' if query_aware else ''}: {answers}")
    write_json(out / "pipeline.json", {"kvpress_version": KVPRESS_VERSION, "versions": versions(), "model": path.name,
                                        "context_story": index, "context_tokens": int(ids.shape[1]),
                                        "context": context, "max_new_tokens": MAX_NEW_TOKENS, "cases": cases},
               ensure_ascii=False)
    print(f"wrote {len(cases)} pipeline cases to {out} in {__import__('time').time() - start:.1f} s")


if __name__ == "__main__":
    main()
