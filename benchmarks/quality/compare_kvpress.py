#!/usr/bin/env python3
"""The quality benchmark's examples through kvpress 0.5.5's pipeline, side by side with kvpress-cli bench.

    python benchmarks/quality/compare_kvpress.py --tasks DIR --results OURS.jsonl --out CMP.jsonl
        [--model smollm2-135m-instruct|FILE.gguf] [--threads 2]

For every row of OURS.jsonl (what `kvpress-cli bench` wrote for the examples of DIR), kvpress's
KVPressTextGenerationPipeline answers the same example with the same press (rebuilt from the row's
press_name and params by tests/reference/common.py's build_press) on transformers loading the same
GGUF file: the context in the chat template's user turn, the question after it, the answer prefix,
greedy decoding (for a query-aware row: context + question as one text and an empty question, as
kvpress's evaluation does; FinchPress gets its delimiter token between them, on a second copy of the
model and tokenizer, since its update_model_and_tokenizer adds that token to both). KVzipPress loads
its tokenizer by the model's name_or_path, which for a GGUF file needs its gguf_file: it is given
the pipeline's. Each output row says whether the two answers are the same text and,
where they differ, where and by how much: the question and OUR answer tokens are teacher-forced over
kvpress's compressed cache (its prefill with the press, as the pipeline runs it), and at the first
position where kvpress's argmax is not our token, the logit gap between the two (a small gap is a
near-tie that float order decides).

Tokenizer: transformers' GGUF loader drops SmolLM2's Digits pre-tokenizer step (it splits digit runs
as one), so kvpress gets the file's tokenizer as the `tokenizers` library builds it from the GGUF
metadata (the model's own, which kvpress-cli uses; tests/reference/make_gguf_fixtures.py).

Resumable: rows already in CMP.jsonl are skipped. Prints the agreement per press and ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "reference"
sys.path.insert(0, str(REFERENCE))

import transformers  # noqa: E402
from common import build_press, setup  # noqa: E402 (pins kvpress 0.5.5)
from make_gguf_fixtures import gguf_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import pipeline as hf_pipeline  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

import kvpress  # noqa: E402,F401 (registers the kv-press-text-generation pipeline)
import kvpress.presses.kvzip_press as kvzip_module  # noqa: E402


def model_file(spec: str) -> Path:
    path = Path(spec)
    if path.suffix == ".gguf":
        return path
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    found = sorted((cache / "kvpress-cpp" / "models" / spec).glob("*.gguf"))
    if not found:
        sys.exit(f"compare_kvpress: no .gguf file for {spec} (scripts/setup.sh installs smollm2-135m-instruct)")
    return found[0]


def load(path: Path):
    """transformers' model from the GGUF file, and a fast tokenizer with the file's own BPE and chat template."""
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return model, gguf_tokenizer(path)


FINCH_DELIMITER = "<|finch_sep|>"  # FinchPress.update_model_and_tokenizer's default


def pipeline_texts(example: dict, row: dict) -> tuple[str, str]:
    """(context, question) as the pipeline gets them: a query-aware row prefills context + question
    as one text and asks an empty question (kvpress's evaluation); FinchPress's delimiter token
    separates them."""
    if row["query_aware"]:
        delimiter = FINCH_DELIMITER if row["press_name"] == "FinchPress" else ""
        return example["context"] + delimiter + example["question"], ""
    return example["context"], example["question"]


def first_divergence(pipe, press, example: dict, row: dict) -> dict:
    """Our answer tokens teacher-forced over kvpress's compressed cache: the first position where
    kvpress's argmax differs from our token, and the logit gap there."""
    model, tokenizer = pipe.model, pipe.tokenizer
    context, question = pipeline_texts(example, row)
    inputs = pipe.preprocess(context, questions=[question], answer_prefix=example["answer_prefix"],
                             max_context_length=int(1e10))
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
    cache = DynamicCache()
    with torch.no_grad():
        with press(model) if press is not None else torch.no_grad():
            model.model(input_ids=context_ids, past_key_values=cache)
        ours = torch.tensor([row["answer_tokens"]], dtype=torch.long)
        ids = torch.cat([question_ids, ours], dim=1)
        start = context_ids.shape[1]
        positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0].float()
    # Position q - 1 + j predicts our token j.
    q = question_ids.shape[1]
    for j, token in enumerate(row["answer_tokens"]):
        step = logits[q - 1 + j]
        best = int(step.argmax())
        if best != token:
            return {"first_diff_token": j, "kvpress_token": best, "our_token": token,
                    "logit_gap": float(step[best] - step[token]),
                    "kvpress_piece": tokenizer.decode([best]), "our_piece": tokenizer.decode([token])}
    return {"first_diff_token": None, "note": "kvpress's argmax follows every one of our tokens (it stops elsewhere)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True, help="kvpress-cli bench --out")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    start = setup(args.threads)
    transformers.utils.logging.set_verbosity_error()

    examples = {}
    for path in sorted(args.tasks.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            ex = json.loads(line)
            examples[ex["id"]] = ex
    ours = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["id"], r["press"], r["ratio"]))
    # Calibrated rows (bench --calibrate) chose their ratio by our search, which kvpress does not have.
    calibrated = [r for r in ours if r.get("calibration")]
    ours = [r for r in ours if not r.get("calibration")]
    todo = [r for r in ours if (r["id"], r["press"], r["ratio"]) not in done]
    print(f"compare_kvpress: {len(todo)} of {len(ours)} rows to run ({len(done)} already in {args.out}; "
          f"{len(calibrated)} calibrated rows left out: kvpress has no calibrated search)", flush=True)

    model, tokenizer = load(model_file(args.model))
    pipe = hf_pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    kvzip_module.AutoTokenizer = type("GgufTokenizer", (), {"from_pretrained": staticmethod(lambda *a, **k: tokenizer)})
    finch = {}  # FinchPress's own model, tokenizer and pipeline (it adds a token to both)

    def press_and_pipe(row: dict, ratio: float):
        press = build_press(row["press_name"], row["params"], ratio) if row["press_name"] else None
        if not isinstance(press, kvpress.FinchPress):
            return press, pipe
        if not finch:
            finch["model"], finch["tokenizer"] = load(model_file(args.model))
        torch.manual_seed(0)  # the delimiter's embedding row (never used: the press strips it)
        press.update_model_and_tokenizer(finch["model"], finch["tokenizer"], FINCH_DELIMITER)
        finch.setdefault("pipe", hf_pipeline("kv-press-text-generation", model=finch["model"],
                                             tokenizer=finch["tokenizer"], device="cpu"))
        return press, finch["pipe"]

    with args.out.open("a") as out:
        for n, row in enumerate(todo, 1):
            example = examples[row["id"]]
            ratio = row["ratio"] if row["ratio"] is not None else 0.0
            press, row_pipe = press_and_pipe(row, ratio)
            context, question = pipeline_texts(example, row)
            t0 = time.time()
            torch.manual_seed(0)
            result = {"id": row["id"], "task": row["task"], "length": row["length"], "press": row["press"],
                      "ratio": row["ratio"], "ours": row["answer"]}
            try:
                with torch.no_grad():
                    answer = row_pipe(context, question=question, answer_prefix=example["answer_prefix"], press=press,
                                      max_new_tokens=example["max_new_tokens"])["answer"]
            except RuntimeError as e:
                # kvpress cannot run it here (e.g. layers of different lengths after PyramidKVPress need
                # flash attention, which a CPU lacks): recorded, not compared.
                result.update({"kvpress": None, "same": None, "kvpress_error": str(e).splitlines()[0],
                               "seconds": time.time() - t0})
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                out.flush()
                print(f"[{n}/{len(todo)}] {row['id']} {row['press']} {row['ratio']}: kvpress FAILED: "
                      f"{result['kvpress_error']}", flush=True)
                continue
            result.update({"kvpress": answer, "same": answer == row["answer"], "seconds": time.time() - t0})
            if not result["same"]:
                torch.manual_seed(0)
                press, row_pipe = press_and_pipe(row, ratio)
                result.update(first_divergence(row_pipe, press, example, row))
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
            out.flush()
            print(f"[{n}/{len(todo)}] {row['id']} {row['press']} {row['ratio']}: "
                  f"{'same' if result['same'] else 'DIFFERENT'} ({result['seconds']:.1f} s)", flush=True)

    rows = [json.loads(line) for line in args.out.read_text().splitlines()]
    by = {}
    for r in rows:
        by.setdefault((r["press"], r["ratio"]), []).append(r["same"])
    print(f"{'press':<44} {'ratio':>5} {'same':>9} {'kvpress failed':>15}")
    for (press, ratio), same in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        compared = [s for s in same if s is not None]
        print(f"{press[:44]:<44} {ratio if ratio is not None else '-':>5} {sum(compared):>4}/{len(compared):<4} "
              f"{len(same) - len(compared):>15}")
    compared = [r for r in rows if r["same"] is not None]
    print(f"compare_kvpress: {sum(r['same'] for r in compared)}/{len(compared)} answers the same, "
          f"{len(rows) - len(compared)} rows kvpress could not run ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
