#!/usr/bin/env python3
"""GGUF fixtures: the `gguf` package's dequantisation, and transformers' logits on GGUF files.

    python make_gguf_fixtures.py --out DIR --smollm2 FILE [--models DIR] [--data FILE]

(FILE: `scripts/setup.sh --smollm2-path` prints where setup installed it.)

* types.gguf, types.safetensors: a tensor of every type kvpress::io::GgufFile dequantises (F32, F16,
  BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 quantised from random values by the gguf package; Q4_K, Q5_K,
  Q6_K as random blocks with finite float16 scales), 3 x 512 values each, and the package's
  dequantize() of each (float32): must be equal bit for bit.
* <family>.gguf, <family>.safetensors for llama, qwen2 and qwen3: a random-weight 2-layer model
  written as llama.cpp's converter writes it (llama: q/k rows permuted; norms F32, embeddings F16,
  projections Q8_0 / Q4_1 / Q4_K), with a byte-level vocabulary of 1000 tokens, and transformers'
  float32 logits of 1 and 100 random ids after loading the file (`from_pretrained(gguf_file=...)`).
  Qwen3's head_dim is 128 (transformers reads no head_dim for qwen3 and takes Qwen3Config's).
* smollm2/: SmolLM2-135M-Instruct's Q4_1 GGUF (scripts/setup.sh installs it): per tensor, a checksum
  of the gguf package's float32 dequantisation (the uint64 sum of bits_i * (2654435761 * (i + 1) mod
  2^32), wrapping), transformers' logits at a few positions of a 300-token prompt, and the ids of
  2,000 strings (make_tokenizer_fixtures.py's kinds) from a `tokenizers` BPE built from the file's
  vocabulary with the pre-tokenizer llama.cpp runs for tokenizer.ggml.pre "smollm" (Digits one by
  one, then ByteLevel with GPT-2's regex: SmolLM2's own tokenizer.json), and from transformers'
  GGUF tokenizer (which drops the Digits step), for the count of strings where the two differ;
  conversations rendered through the file's chat template by transformers' apply_chat_template
  (text, and ids from the tokenizer above); kvpress's KVPressTextGenerationPipeline answers (with
  the chat template) about a story without digits, with no press, SnapKVPress and KnormPress at 0.5.

Takes about a minute (the SmolLM2 forward and checksums).
"""

from __future__ import annotations

import copy
import os
import random
import time
from pathlib import Path

os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF loading draws progress bars (read when tqdm loads)

# First: importing common checks the pinned kvpress version (the reference stack's pin).
from common import (build_press, load_stories, parse_args, perturb_biases_and_norms, prepare_out, save, setup,
                    versions, write_json)

import gguf
import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers import pipeline as hf_pipeline

import kvpress  # noqa: F401 (registers the "kv-press-text-generation" pipeline)
import kvpress.presses.kvzip_press as kvzip_module

import make_tokenizer_fixtures

SMOLLM2_POSITIONS = (0, 1, 50, 150, 299)
TOKENIZER_STRINGS = 2000
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a story about 3 cats.\nMake it short."}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  spaces and <|im_start|> inside  "}],
    [{"role": "assistant", "content": "I start."}, {"role": "system", "content": "late system"}],
]
# kvpress's pipeline on SmolLM2 with its chat template: no press, two presses at ratio 0.5, KVzipPress
# (the context replayed inside the template's user turn) and query-aware FinchPress (the question
# after the context in the user's message). (name, ratio, query-aware); FinchPress last: it adds a
# token to the model's embeddings.
PIPELINE_QUESTIONS = ["Who is the story about?", "What happened at the end?"]
PIPELINE_PRESSES = [(None, 0.0, False), ("SnapKVPress", 0.5, False), ("KnormPress", 0.5, False),
                    ("KVzipPress", 0.5, False), ("FinchPress", 0.5, True)]
PIPELINE_NEW_TOKENS = 24


def byte_level_tokens(n: int) -> list[str]:
    """GPT-2's 256 byte characters, then filler tokens up to n."""
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(0xA1, 0xAD)]
    chars += [chr(c) for c in range(0xAE, 0x100)]
    chars += [chr(0x100 + i) for i in range(256 - len(chars))]
    return chars + [f"w{i}" for i in range(n - len(chars))]


def add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: Q) -> None:
    """values (float32) stored as qtype: F32 and F16 as arrays, the others as the package's blocks."""
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, np.ascontiguousarray(values.astype(np.float32 if qtype == Q.F32 else np.float16)))
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


# ---- every tensor type ----------------------------------------------------------------------------
def types_fixture(out: Path) -> list[str]:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(out / "types.gguf"), arch="types")
    names = []
    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        values = rng.standard_normal((3, 512)).astype(np.float32)
        add_tensor(writer, qtype.name, values, qtype)
        names.append(qtype.name)
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # no quantizer in the package: random blocks
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(3 * 512 // block_values, block_bytes), dtype=np.uint8)
        scale_at = [block_bytes - 2] if qtype == Q.Q6_K else [0, 2]  # d (and dmin) as finite halves
        for at in scale_at:
            blocks[:, at:at + 2] = rng.uniform(-0.1, 0.1, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
        writer.add_tensor(qtype.name, blocks.reshape(3, -1), raw_dtype=qtype)
        names.append(qtype.name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(out / "types.gguf"))
    expected = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(3, 512).copy())
                for t in reader.tensors}
    save(expected, out / "types.safetensors")
    return names


# ---- small models of each family, as llama.cpp's converter writes them -----------------------------
FAMILIES = {  # name -> (config class, model class, head_dim)
    "llama": (LlamaConfig, LlamaForCausalLM, 16),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, 16),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, 128),
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: each head's RoPE halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def family_fixture(out: Path, family: str, seed: int) -> None:
    config_class, model_class, head_dim = FAMILIES[family]
    torch.manual_seed(seed)
    extra = {"head_dim": head_dim} if family != "qwen2" else {}
    config = config_class(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                          rope_theta=100000.0, rms_norm_eps=1e-5, initializer_range=0.08, tie_word_embeddings=False,
                          **extra)
    model = model_class(config).eval()
    perturb_biases_and_norms(model)
    path = out / f"{family}.gguf"
    writer = gguf.GGUFWriter(str(path), arch=family)
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(128)
    writer.add_feed_forward_length(256)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(1000)
    if family == "llama":
        writer.add_rope_dimension_count(head_dim)
    if family == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(byte_level_tokens(1000))
    writer.add_token_types([1] * 1000)
    writer.add_token_merges([])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                   "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                   "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                   "mlp.down_proj.weight": "ffn_down.weight"}
    for proj, short in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        for kind in ("weight", "bias"):
            layer_names[f"self_attn.{proj}.{kind}"] = f"{short}.{kind}"
    # Types per role, as a mixed quantisation does: projections in three block formats.
    qtypes = {"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q4_1, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q4_0,
              "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q8_0, "ffn_down.weight": Q.Q5_1,
              "token_embd.weight": Q.F16, "output.weight": Q.Q8_0}
    for hf_name, tensor in model.state_dict().items():
        parts = hf_name.split(".")
        if hf_name in names:
            name = names[hf_name]
        else:
            name = f"blk.{parts[2]}." + layer_names[".".join(parts[3:])]
        data = tensor.float().numpy()
        if family == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = permute(data, 8 if ".attn_q." in name else 2)
        qtype = qtypes.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, Q.F32)
        if qtype == Q.Q4_K:  # no quantizer in the package; Q8_0 then (the reader's Q4_K is checked above)
            qtype = Q.Q8_0
        add_tensor(writer, name, data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    loaded = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=path.name, dtype=torch.float32).eval()
    assert loaded.model.layers[0].self_attn.head_dim == head_dim, family
    generator = torch.Generator().manual_seed(100 + seed)
    tensors = {}
    for n in (1, 100):
        ids = torch.randint(0, 1000, (1, n), generator=generator)
        with torch.no_grad():
            tensors[f"ids_{n}"] = ids
            tensors[f"logits_{n}"] = loaded(input_ids=ids).logits.float()
    save(tensors, out / f"{family}.safetensors")


# ---- SmolLM2-135M-Instruct ---------------------------------------------------------------------------
def checksum(values: np.ndarray) -> int:
    """uint64 sum of bits_i * (2654435761 * (i + 1) mod 2^32), wrapping: equal bits, equal sums."""
    bits = values.astype(np.float32, copy=False).reshape(-1).view(np.uint32).astype(np.uint64)
    weights = (np.arange(1, bits.size + 1, dtype=np.uint64) * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)
    with np.errstate(over="ignore"):
        return int(np.sum(bits * weights, dtype=np.uint64))


def smollm2_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """`tokenizers` BPE from the file's vocabulary, laid out as SmolLM2's tokenizer.json."""
    field = reader.fields
    tokens = [bytes(field["tokenizer.ggml.tokens"].parts[i]).decode() for i in field["tokenizer.ggml.tokens"].data]
    merges = [bytes(field["tokenizer.ggml.merges"].parts[i]).decode() for i in field["tokenizer.ggml.merges"].data]
    types = [int(field["tokenizer.ggml.token_type"].parts[i][0]) for i in field["tokenizer.ggml.token_type"].data]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges],
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i, t in enumerate(types) if t == 3])
    return tok


def gguf_tokenizer(path: Path):
    """transformers' tokenizer with the GGUF file's own BPE (smollm2_tokenizer: transformers' GGUF loader
    drops SmolLM2's Digits pre-tokenizer step), BOS / EOS and chat template."""
    from transformers import PreTrainedTokenizerFast
    reader = gguf.GGUFReader(str(path))
    field = reader.fields
    tokens = [bytes(field["tokenizer.ggml.tokens"].parts[i]).decode() for i in field["tokenizer.ggml.tokens"].data]
    special = {name: tokens[int(field[f"tokenizer.ggml.{name}_token_id"].parts[-1][0])] for name in ("bos", "eos")}
    template = bytes(field["tokenizer.chat_template"].parts[field["tokenizer.chat_template"].data[0]]).decode()
    return PreTrainedTokenizerFast(tokenizer_object=smollm2_tokenizer(reader), bos_token=special["bos"],
                                   eos_token=special["eos"], chat_template=template)


def smollm2_fixture(out: Path, path: Path, stories: list[str]) -> dict:
    folder = prepare_out(out / "smollm2")
    reader = gguf.GGUFReader(str(path))
    sums = {t.name: str(checksum(gguf.quants.dequantize(t.data, t.tensor_type))) for t in reader.tensors}
    tok = smollm2_tokenizer(reader)
    rng = random.Random(5)
    strings = make_tokenizer_fixtures.make_strings(rng, stories, TOKENIZER_STRINGS, ["<|im_start|>", "<|im_end|>"])
    texts = [s.decode("utf-8", "replace") for s in strings]
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cases, differ = [], 0
    for s, text in zip(strings, texts):
        ids = tok.encode(text).ids
        theirs = hf_tok(text, add_special_tokens=False).input_ids
        differ += ids != theirs
        cases.append({"hex": s.hex(), "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    write_json(folder / "tokenizer_cases.json", cases, indent=0)

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompt = torch.tensor([tok.encode(" ".join(stories)[:4000]).ids[:SMOLLM2_POSITIONS[-1] + 1]])
    with torch.no_grad():
        logits = model(input_ids=prompt).logits[0].float()
    save({"ids": prompt, "positions": torch.tensor(SMOLLM2_POSITIONS),
          "logits": logits[list(SMOLLM2_POSITIONS)].contiguous()}, folder / "logits.safetensors")

    # Conversations through the file's chat template, rendered by transformers (jinja2).
    assert hf_tok.chat_template, "transformers found no chat template in the GGUF file"
    chats = []
    for messages in CONVERSATIONS:
        for generation_prompt in (False, True):
            text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            chats.append({"messages": messages, "add_generation_prompt": generation_prompt, "text": text,
                          "ids": tok.encode(text).ids})
    write_json(folder / "chat_cases.json", chats, indent=0, ensure_ascii=False)

    # kvpress's pipeline with the chat template on a story without digits (transformers' GGUF
    # tokenizer splits digits differently from the model's own; elsewhere the two agree).
    context = next(s for s in stories if not any(c.isdigit() for c in s) and 250 <= len(tok.encode(s).ids) <= 500)
    for text in [context] + PIPELINE_QUESTIONS:
        assert tok.encode(text).ids == hf_tok(text, add_special_tokens=False).input_ids, text
    # KVzipPress loads the tokenizer from the model's name_or_path, which for a GGUF file needs its
    # gguf_file: give it this one, the pipeline's.
    kvzip_module.AutoTokenizer = type("GgufTokenizer", (), {"from_pretrained": staticmethod(lambda *a, **k: hf_tok)})
    pipeline_cases = []
    for name, ratio, query_aware in PIPELINE_PRESSES:
        press = build_press(name, {}, ratio) if name else None
        case_tok = hf_tok
        if name == "FinchPress":
            torch.manual_seed(0)  # the delimiter's new embedding row (never used: the press strips it)
            case_tok = press.update_model_and_tokenizer(model, copy.deepcopy(hf_tok))
        pipe = hf_pipeline("kv-press-text-generation", model=model, tokenizer=case_tok, device="cpu")
        with torch.no_grad():
            if query_aware:  # kvpress's query-aware form: context + delimiter + question, an empty question
                answers = [pipe(context + press.delimiter_token + q, question="", press=press,
                                max_new_tokens=PIPELINE_NEW_TOKENS)["answer"] for q in PIPELINE_QUESTIONS]
            else:
                answers = pipe(context, questions=PIPELINE_QUESTIONS, press=press,
                               max_new_tokens=PIPELINE_NEW_TOKENS)["answers"]
        pipeline_cases.append({"press": name, "compression_ratio": ratio, "query_aware": query_aware,
                               "answers": answers})
        print(f"  SmolLM2 pipeline, {name or 'no press'}{' query-aware' if query_aware else ''}: {answers}")
    write_json(folder / "pipeline.json", {"context": context, "questions": PIPELINE_QUESTIONS,
                                          "max_new_tokens": PIPELINE_NEW_TOKENS, "cases": pipeline_cases},
               ensure_ascii=False)
    return {"file": str(path), "checksums": sums, "tokenizer_strings": len(cases),
            "transformers_tokenizer_differs": differ}


def main() -> None:
    parser_args = parse_args(__doc__, lambda p: p.add_argument("--smollm2", type=Path, required=True))
    start = setup(threads=2)
    out = prepare_out(parser_args.out)
    manifest = {**versions(), "gguf_version": gguf.__version__ if hasattr(gguf, "__version__") else "0.19.0",
                "tokenizers_version": tokenizers.__version__, "types": types_fixture(out), "families": list(FAMILIES)}
    for seed, family in enumerate(FAMILIES):
        family_fixture(out, family, seed)
    path = parser_args.smollm2
    assert path.is_file(), f"--smollm2 {path}: no such file (scripts/setup.sh installs it)"
    manifest["smollm2"] = smollm2_fixture(out, path, load_stories(parser_args.data))
    write_json(out / "manifest.json", manifest)
    print(f"make_gguf_fixtures: {len(manifest['types'])} types, {len(FAMILIES)} families, SmolLM2 "
          f"({manifest['smollm2']['transformers_tokenizer_differs']} of {TOKENIZER_STRINGS} strings tokenized "
          f"differently by transformers' GGUF tokenizer) in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
