#!/usr/bin/env python3
"""What each quantized page format does to a real model's answers, and why fp8 costs the most.

    python benchmarks/quality/kv_format_error.py --tasks DIR [--length 2048] [--examples 2] [--first 0]
        [--model smollm2-135m-instruct|FILE.gguf] [--press none,CompactorPress] [--ratio 0.5]
        [--threads 1] [--json OUT]

For each example of the quality benchmark's tasks (DIR as make_tasks.py writes it; every task but cwe,
whose answers the benchmark leaves out), transformers loads the GGUF model as compare_kvpress.py does,
prefills the context (with kvpress 0.5.5's press at --ratio, or none), and then every page format
replaces the context's cache by its round trip: the library's own torch.ops.kvpress.kv_quantize /
kv_dequantize on pages of 16 tokens per head, the last length % 16 tokens of each head left in full
precision (the paged cache's residual rows), as `kvpress-cli bench --kv-dtype F` stores them. The
question, the answer prefix and the reference answer are then teacher-forced over that cache.

Besides the library's formats (int8, fp8, int4), variants that separate the causes:
  bf16          the cache rounded to bfloat16 (7 mantissa bits; a reference point),
  fp8:keys      fp8 keys, full-precision values (and fp8:values the other way round),
  int8:keys     int8 keys, full-precision values,
  fp8/channel   fp8 codes with KIVI's scales (keys one scale per page and channel, values per token),
  int8+fp8      int8 keys, fp8 values.
The variants are simulated here (plain torch), not library formats.

Per format, printed and written to --json: the relative error of keys and values (Frobenius, over the
quantized pages, mean over layers), the error of the attention logits of the question's queries
relative to their spread (q . (k^ - k) / sqrt(D) over the std of q . k / sqrt(D), from the layer's
own queries, mean over layers and query heads), the mean KL divergence (nats) of the next-token
distribution from the full-precision cache's over the question and answer, the change of the answer's
mean NLL, the fraction of answer positions whose argmax is the full cache's, and then the greedy
answer over the format's cache (the example's max_new_tokens, stopping at the end-of-sequence
token): whether it is the full cache's answer ("same_answer") and its score as `kvpress-cli bench`
scores it (RULER's string match).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_kvpress import build_press, hf_pipeline, load, model_file, setup  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

import kvpress_cpp  # noqa: E402,F401 (registers torch.ops.kvpress)

PAGE = 16  # PagedKVCache::Options::kDefaultPageSize, the benchmark's pages
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def library_roundtrip(fmt: str):
    """rows [pages, PAGE, D] through the library's page codec."""

    def run(rows: torch.Tensor, keys: bool) -> torch.Tensor:
        codes, scales = torch.ops.kvpress.kv_quantize(rows, fmt, keys)
        return torch.ops.kvpress.kv_dequantize(codes, scales, fmt, keys, rows.shape[-1])

    return run


def fp8_channel(rows: torch.Tensor, keys: bool) -> torch.Tensor:
    """fp8 e4m3 codes, scales as KIVI's int4 split: keys per page and channel, values per token."""
    over = 1 if keys else 2
    scale = (rows.abs().amax(over, keepdim=True) / FP8_MAX).clamp_min(1e-30)
    return (rows / scale).to(torch.float8_e4m3fn).float() * scale


def bf16(rows: torch.Tensor, keys: bool) -> torch.Tensor:
    return rows.to(torch.bfloat16).float()


def identity(rows: torch.Tensor, keys: bool) -> torch.Tensor:
    return rows


def both(key_codec, value_codec):
    return lambda rows, keys: (key_codec if keys else value_codec)(rows, keys)


FORMATS = {
    "int8": library_roundtrip("int8"),
    "fp8": library_roundtrip("fp8"),
    "int4": library_roundtrip("int4"),
    "bf16": bf16,
    "fp8:keys": both(library_roundtrip("fp8"), identity),
    "fp8:values": both(identity, library_roundtrip("fp8")),
    "int8:keys": both(library_roundtrip("int8"), identity),
    "fp8/channel": fp8_channel,
    "int8+fp8": both(library_roundtrip("int8"), library_roundtrip("fp8")),
}


def paged_roundtrip(x: torch.Tensor, codec, keys: bool) -> torch.Tensor:
    """x [1, H, S, D]: each head's full pages through the codec, its last S % PAGE rows as they are."""
    _, heads, length, dim = x.shape
    full = length // PAGE * PAGE
    out = x.clone()
    if full:
        rows = x[0, :, :full].reshape(heads * full // PAGE, PAGE, dim)
        out[0, :, :full] = codec(rows, keys).reshape(heads, full, dim)
    return out


class QueryRecorder:
    """The post-RoPE queries of each layer's attention, recorded by a hook on q_proj's output and
    rotated by transformers' own Llama RoPE."""

    def __init__(self, model) -> None:
        self.model, self.queries, self.handles = model, {}, []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.self_attn.q_proj.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(module, inputs, output):
            self.queries[i] = output.detach()

        return hook

    def rotated(self, i: int, position_ids: torch.Tensor) -> torch.Tensor:
        """[Hq, n, D] queries of layer i at position_ids [1, n]."""
        dim = self.model.model.layers[i].self_attn.head_dim
        q = self.queries[i].view(1, -1, self.model.config.num_attention_heads, dim).transpose(1, 2)
        cos, sin = self.model.model.rotary_emb(q, position_ids)
        rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
        return rotated[0]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def logit_error(queries: torch.Tensor, keys: torch.Tensor, approx: torch.Tensor) -> float:
    """queries [Hq, n, D], keys / approx [1, Hkv, S, D]: mean over query heads of
    rms(q . (k^ - k)) / std(q . k), both over the head's queries and cached tokens."""
    group = queries.shape[0] // keys.shape[1]
    k = keys[0].repeat_interleave(group, 0)
    delta = (approx - keys)[0].repeat_interleave(group, 0)
    exact = queries @ k.transpose(1, 2)
    err = queries @ delta.transpose(1, 2)
    return float((err.pow(2).mean((1, 2)).sqrt() / exact.std((1, 2))).mean())


def cache_of(cache_tensors) -> DynamicCache:
    """A fresh cache holding cache_tensors [(keys, values)] per layer."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(cache_tensors):
        cache.update(k, v, i)
    return cache


def forward(model, cache: DynamicCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits [n, V] of ids [1, n] at positions start .. start + n - 1, appended to cache."""
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0].float()


def greedy_answer(model, tokenizer, cache_tensors, question_ids: torch.Tensor, start: int, max_new_tokens: int) -> str:
    """The greedy answer after the question (the pipeline's decoding), over cache_tensors."""
    cache = cache_of(cache_tensors)
    logits = forward(model, cache, question_ids, start)
    position, tokens = start + question_ids.shape[1], []
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        if token in stop:
            break
        tokens.append(token)
        logits = forward(model, cache, torch.tensor([[token]]), position)
        position += 1
    return tokenizer.decode(tokens, skip_special_tokens=True)


def score(metric: str, answer: str, expected: list[str]) -> float:
    """RULER's string match, as `kvpress-cli bench` scores (tools/bench.cpp): "all" the fraction of
    the expected strings in the answer, "part" 1 when any is; case folded."""
    found = sum(e.lower() in answer.lower() for e in expected)
    return float(found > 0) if metric == "part" else found / len(expected)


def run_example(pipe, model, recorder, example: dict, press) -> dict:
    inputs = pipe.preprocess(example["context"], questions=[example["question"]],
                             answer_prefix=example["answer_prefix"], max_context_length=int(1e10))
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
    answer_ids = pipe.tokenizer(" " + example["answers"][0], add_special_tokens=False,
                                return_tensors="pt")["input_ids"]
    ids = torch.cat([question_ids, answer_ids], dim=1)
    start, q, a = context_ids.shape[1], question_ids.shape[1], answer_ids.shape[1]
    cache = DynamicCache()
    with torch.no_grad(), (press(model) if press is not None else torch.no_grad()):
        model.model(input_ids=context_ids, past_key_values=cache)
    exact = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    reference = forward(model, cache_of(exact), ids, start)
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    queries = [recorder.rotated(i, positions) for i in range(len(exact))]
    ref_logp = reference.log_softmax(-1)
    answer_rows = torch.arange(q - 1, q - 1 + a)
    ref_nll = -ref_logp[answer_rows, answer_ids[0]].mean()
    full_answer = greedy_answer(model, pipe.tokenizer, exact, question_ids, start, example["max_new_tokens"])
    out = {"id": example["id"], "task": example["task"], "context_tokens": start,
           "kept_tokens": int(exact[0][0].shape[2]), "answer": full_answer,
           "score": score(example["metric"], full_answer, example["answers"]), "formats": {}}
    for name, codec in FORMATS.items():
        approx = [(paged_roundtrip(k, codec, True), paged_roundtrip(v, codec, False)) for k, v in exact]
        key_err = [float((ka - k).norm() / k.norm()) for (k, _), (ka, _) in zip(exact, approx)]
        value_err = [float((va - v).norm() / v.norm()) for (_, v), (_, va) in zip(exact, approx)]
        logit_err = [logit_error(qs, k, ka) for qs, (k, _), (ka, _) in zip(queries, exact, approx)]
        logp = forward(model, cache_of(approx), ids, start).log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()
        nll = -logp[answer_rows, answer_ids[0]].mean()
        agree = (logp[answer_rows].argmax(-1) == ref_logp[answer_rows].argmax(-1)).float().mean()
        out["formats"][name] = {"key_error": sum(key_err) / len(key_err),
                                "value_error": sum(value_err) / len(value_err),
                                "logit_error": sum(logit_err) / len(logit_err),
                                "kl": float(kl), "dnll": float(nll - ref_nll), "agree": float(agree)}
        answer = greedy_answer(model, pipe.tokenizer, approx, question_ids, start, example["max_new_tokens"])
        out["formats"][name].update(answer=answer, same_answer=float(answer == full_answer),
                                    score=score(example["metric"], answer, example["answers"]))
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=Path, required=True, help="make_tasks.py's output folder")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--examples", type=int, default=2, help="examples per task")
    p.add_argument("--first", type=int, default=0, help="each task's first example (0-based), to extend a run")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--press", default="none,CompactorPress", help="kvpress presses, comma-separated; none: no press")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="write every example's figures here")
    return p.parse_args()


def summary(rows: list[dict], label: str) -> None:
    keys = ["key_error", "value_error", "logit_error", "kl", "dnll", "agree", "same_answer", "score"]
    full_score = sum(r["score"] for r in rows) / len(rows)
    print(f"\n{label}: mean over {len(rows)} examples (the full-precision cache's score: {full_score:.4f})")
    print(f"| format | {' | '.join(keys)} |\n|---|{'---|' * len(keys)}")
    for name in FORMATS:
        means = [sum(r["formats"][name][k] for r in rows) / len(rows) for k in keys]
        print(f"| {name} | " + " | ".join(f"{m:.4f}" for m in means) + " |")


def main() -> None:
    args = parse_args()
    setup(args.threads)
    examples = []
    for path in sorted(args.tasks.glob(f"*_{args.length}.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()[args.first : args.first + args.examples]]
        examples += [e for e in lines if e["task"] != "cwe"]
    if not examples:
        sys.exit(f"kv_format_error: no *_{args.length}.jsonl examples in {args.tasks}")
    model, tokenizer = load(model_file(args.model))
    pipe = hf_pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    recorder = QueryRecorder(model)
    results = {}
    begin = time.time()
    for press_name in args.press.split(","):
        press = None if press_name == "none" else build_press(press_name, {}, args.ratio)
        label = press_name if press is None else f"{press_name} at {args.ratio}"
        rows = []
        for n, example in enumerate(examples, 1):
            rows.append(run_example(pipe, model, recorder, example, press))
            print(f"{label}: {n}/{len(examples)} {example['id']} ({time.time() - begin:.0f} s)", flush=True)
        results[label] = rows
        summary(rows, label)
    recorder.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    assert all(math.isfinite(f["kl"]) for rows in results.values() for r in rows for f in r["formats"].values())


if __name__ == "__main__":
    main()
