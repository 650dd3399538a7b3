#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (committed; rerun after changing this script).

    python3 tests/fuzz/make_seeds.py [MODEL_DIR]    (default: ../shared/models/tinystories-656k)

Hand-made inputs that reach every supported feature, plus small pieces of the real TinyStories-656K
files: its config.json, its tokenizer.json cut to the first 200 ids, two of its weight tensors.
Standard library only. make_press seeds: hand-made nested ones, and with --cli every registry
press with its parameters at their defaults (from `kvpress-cli list --json`).
"""
import argparse
import json
import os
import struct
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    os.makedirs(os.path.join(HERE, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(HERE, target, name), "wb") as f:
        f.write(data)


# ---- safetensors ---------------------------------------------------------------------------------

def safetensors_bytes(tensors, metadata=None):
    """tensors: name -> (dtype, shape, raw bytes); laid out in the given order."""
    header, body = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + body


def read_safetensors(path, names):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start = 8 + n
        out = {}
        for name in names:
            e = header[name]
            f.seek(start + e["data_offsets"][0])
            out[name] = (e["dtype"], e["shape"], f.read(e["data_offsets"][1] - e["data_offsets"][0]))
        return out, header.get("__metadata__")


def safetensors_seeds(model_dir):
    real, meta = read_safetensors(os.path.join(model_dir, "model.safetensors"),
                                  ["model.norm.weight", "model.layers.0.input_layernorm.weight"])
    write("safetensors", "tinystories_norms.safetensors", safetensors_bytes(real, meta))
    every_dtype = {
        "f64": ("F64", [2], struct.pack("<2d", 1.5, -2.0)),
        "f32": ("F32", [2, 2], struct.pack("<4f", 0.0, 1.0, float("inf"), float("nan"))),
        "f16": ("F16", [3], struct.pack("<3H", 0x3C00, 0x8000, 0x7C00)),
        "bf16": ("BF16", [1, 2], struct.pack("<2H", 0x3F80, 0xFF80)),
        "i64": ("I64", [], struct.pack("<q", -(2**63))),
        "i32": ("I32", [2], struct.pack("<2i", 7, -7)),
        "i16": ("I16", [1], struct.pack("<h", -1)),
        "i8": ("I8", [2], struct.pack("<2b", 127, -128)),
        "u8": ("U8", [0, 3], b""),
        "bool": ("BOOL", [3], bytes([0, 1, 1])),
    }
    write("safetensors", "every_dtype.safetensors", safetensors_bytes(every_dtype, {"format": "pt", "note": "x"}))
    write("safetensors", "empty.safetensors", safetensors_bytes({}))
    write("safetensors", "metadata_only.safetensors", safetensors_bytes({}, {"ratio": "0.5", "layer_idx": "3"}))


# ---- tokenizer.json ------------------------------------------------------------------------------

SP = "\u2581"  # SentencePiece's word boundary


def tiny_tokenizer():
    """Every supported component: Prepend/Replace normalizer, BPE with merges, byte fallback and a
    fused <unk>, added tokens (normalized or not, special or not), BOS/EOS template, decoder chain."""
    chars = [SP, "a", "b", "c", "e", "h", "n", "o", "t", "u", "O", ",", "."]
    merged = ["th", "the", SP + "the", "on", "On", "ce", SP + "a", "un", "On" + "ce"]
    byte_tokens = ["<0x%02X>" % b for b in (0x0A, 0x20, 0xC3, 0xA9, 0xE2, 0x96, 0x81)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + chars + merged
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = ["t h", "th e", SP + " the", "o n", "O n", "c e", SP + " a", "u n", "On ce"]
    added = [
        {"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True},
        {"id": 1, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True},
        {"id": 2, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True},
        {"id": len(tokens), "content": "<|story|>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False},
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SP},
            {"type": "Replace", "pattern": {"String": " "}, "content": SP}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                               "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SP}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def byte_level_tokenizer():
    """The byte-level components: NFC, a Sequence of a Split regex (Llama 3's), Digits and ByteLevel
    (GPT-2's regex and prefix space), the 256 byte characters and a few merges, the ByteLevel
    decoder, a Sequence post-processor (ByteLevel and a BOS template)."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 0xA1 <= b <= 0xAC or b >= 0xAE]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tokens = ["<|bos|>"] + [char[b] for b in range(256)] + ["Ġt", "he", "Ġthe"]
    return {
        "version": "1.0",
        "added_tokens": [{"id": 0, "content": "<|bos|>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
                                                   "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
                                                   "|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": False},
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                                                      {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [], "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": ["Ġ t", "h e", "Ġt he"]},
    }


def tokenizer_seeds(model_dir):
    text = "The cafe\u0301's 12345 \U0001F600\n\t<|bos|> ".encode() + b"\xff\xc3"  # ends in invalid UTF-8
    write("tokenizer", "byte_level.json", json.dumps(byte_level_tokenizer(), ensure_ascii=False).encode() + b"\0" + text)
    tiny = tiny_tokenizer()
    text = "Once upon a time, the <|story|> \u00e9t\u00e9\n<s>x</s> \xff"
    write("tokenizer", "tiny.json", json.dumps(tiny, ensure_ascii=False).encode() + b"\0" + text.encode())
    # Merges as pairs, no normalizer, ignore_merges, no fusing of <unk>, one decoder.
    pairs = json.loads(json.dumps(tiny))
    model = pairs["model"]
    model["merges"] = [m.split(" ") for m in model["merges"]]
    model.update(ignore_merges=True, fuse_unk=False, byte_fallback=False)
    del pairs["normalizer"], pairs["post_processor"]
    pairs["decoder"] = {"type": "Fuse"}
    write("tokenizer", "merge_pairs.json", json.dumps(pairs, ensure_ascii=False).encode() + b"\0the once xyz")
    # The real tokenizer, cut to its first 200 ids (and the merges among them).
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        real = json.load(f)
    keep = {t: i for t, i in real["model"]["vocab"].items() if i < 200}
    real["model"]["vocab"] = keep
    real["model"]["merges"] = [m for m in real["model"]["merges"]
                               if all(p in keep for p in m.split(" ")) and m.replace(" ", "") in keep]
    write("tokenizer", "tinystories_200.json",
          json.dumps(real, ensure_ascii=False).encode() + b"\0Once upon a time, there was a little girl.")


# ---- config.json ---------------------------------------------------------------------------------

def config_seeds(model_dir):
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        write("config", "tinystories.json", f.read())
    write("config", "transformers5.json", json.dumps({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rms_norm_eps": 1e-5,
        "eos_token_id": [2, 3], "tie_word_embeddings": False}, indent=1))
    write("config", "minimal.json", '{"model_type": "llama", "vocab_size": 2, "hidden_size": 2, '
          '"intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1}')


# ---- make_press ----------------------------------------------------------------------------------

NESTED = {
    "composed": "ComposedPress\n0.3\npresses=SnapKVPress,KnormPress,StreamingLLMPress\npresses.0.window_size=8\n"
                "presses.1.compression_ratio=0.2\npresses.2.n_sink=2\n",
    "prefill_decoding": "PrefillDecodingPress\n0.5\nprefilling_press=ExpectedAttentionPress\n"
                        "prefilling_press.n_sink=2\ndecoding_press=DecodingPress\ndecoding_press.press=KnormPress\n"
                        "decoding_press.target_size=64\ndecoding_press.compression_interval=4\n",
    "prefill_ratio_decoding": "PrefillDecodingPress\n0.25\ndecoding_press=CompressionRatioDecodingPress\n"
                              "decoding_press.press=SnapKVPress\ndecoding_press.press.window_size=4\n",
    "adakv_expected": "AdaKVPress\n0.5\npress=ExpectedAttentionPress\npress.n_sink=2\npress.use_covariance=false\n"
                      "alpha_safeguard=0.2\n",
    "chunkkv_rerotation": "ChunkKVPress\n0.5\npress=KeyRerotationPress\npress.press=SnapKVPress\n"
                          "press.press.window_size=16\nchunk_length=8\n",
    "per_layer": "PerLayerCompressionPress\n0\npress=LagKVPress\npress.lag_size=16\ncompression_ratios=0.1,0.5,0.9\n",
    "critical_adakv": "CriticalAdaKVPress\n0.75\npress=TOVAPress\nfirst_stage_ratio=0.5\nepsilon=1e-4\n",
    "bad_ratio": "SnapKVPress\nnan\n",
    "unknown": "SnapKV\n0.5\nwindow=8\n",
}


def make_press_seeds(cli):
    # One seed per registry press with its parameters at their defaults (only with --cli; the
    # committed ones are kept otherwise).
    if cli:
        listing = json.loads(subprocess.check_output([cli, "list", "--json"]))
        words = set()
        for p in listing["presses"]:
            lines = [p["name"], "0.5"] + ["%s=%s" % (q["name"], q["default"]) for q in p["params"]]
            write("make_press", p["name"] + ".txt", "\n".join(lines) + "\n")
            words.add(p["name"])
            words.update(q["name"] + "=" for q in p["params"])
        # The dictionary: names, parameters, nesting prefixes and edge values.
        words.update(["press.", "presses.0.", "presses.1.", "prefilling_press.", "decoding_press.",
                      "compression_ratio=", "\n", ",", "None", "none", "true", "False", "nan", "-inf", "-1", "0",
                      "1", "0.999999", "1e308", "-0", "9223372036854775807", "-9223372036854775808", "0x1p-3"])
        with open(os.path.join(HERE, "make_press.dict"), "w") as f:
            f.write("# libFuzzer dictionary of the make_press target (tests/fuzz/make_seeds.py --cli).\n")
            for w in sorted(words):
                f.write('"%s"\n' % w.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\x0a"))
    for name, text in NESTED.items():
        write("make_press", "nested_" + name + ".txt", text)


# ---- gguf ----------------------------------------------------------------------------------------

GGUF_VALUE = {"u8": (0, "<B"), "i8": (1, "<b"), "u16": (2, "<H"), "i16": (3, "<h"), "u32": (4, "<I"),
              "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<?"), "u64": (10, "<Q"), "i64": (11, "<q"),
              "f64": (12, "<d")}
# ggml type: (code, values per block, bytes per block)
GGML_TYPES = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
              "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
              "Q6_K": (14, 256, 210), "BF16": (30, 1, 2), "IQ2_XXS": (16, 256, 66)}


def gguf_string(text):
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_value(kind, value):
    """(type code, bytes) of a metadata value: kind is a GGUF_VALUE key, "str", or ("arr", kind)."""
    if kind == "str":
        return 8, gguf_string(value)
    if isinstance(kind, tuple):
        element = kind[1]
        code = 8 if element == "str" else 9 if isinstance(element, tuple) else GGUF_VALUE[element][0]
        return 9, struct.pack("<IQ", code, len(value)) + b"".join(gguf_value(element, v)[1] for v in value)
    code, fmt = GGUF_VALUE[kind]
    return code, struct.pack(fmt, value)


def gguf_bytes(metadata, tensors, alignment=32):
    """metadata: [(key, kind, value)]; tensors: [(name, dims (GGUF order: contiguous first), type name)],
    each filled with a deterministic byte pattern whose float16 scales stay finite."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, kind, value in metadata:
        code, data = gguf_value(kind, value)
        out += gguf_string(key) + struct.pack("<I", code) + data
    offset, payloads = 0, []
    for name, dims, type_name in tensors:
        code, block, block_bytes = GGML_TYPES[type_name]
        count = 1
        for d in dims:
            count *= d
        size = count // block * block_bytes
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", code, offset)
        payload = bytes((i * 37 + 11) % 251 & 0x3B for i in range(size))  # exponent bits cleared: finite halves
        payloads.append(payload + b"\0" * (-size % alignment))
        offset += len(payloads[-1])
    out += b"\0" * (-len(out) % alignment)
    return out + b"".join(payloads)


def gguf_seeds():
    tiny_llama = [
        ("general.architecture", "str", "llama"), ("general.alignment", "u32", 32),
        ("llama.block_count", "u32", 1), ("llama.embedding_length", "u32", 64), ("llama.feed_forward_length", "u32", 128),
        ("llama.attention.head_count", "u32", 2), ("llama.attention.head_count_kv", "u32", 1),
        ("llama.rope.freq_base", "f32", 10000.0), ("llama.attention.layer_norm_rms_epsilon", "f32", 1e-5),
        ("tokenizer.ggml.model", "str", "gpt2"), ("tokenizer.ggml.pre", "str", "smollm"),
        ("tokenizer.ggml.tokens", ("arr", "str"), ["a", "b", "ab", "<|endoftext|>"]),
        ("tokenizer.ggml.token_type", ("arr", "i32"), [1, 1, 1, 3]),
        ("tokenizer.ggml.merges", ("arr", "str"), ["a b"]), ("tokenizer.ggml.bos_token_id", "u32", 3),
        ("tokenizer.ggml.add_bos_token", "bool", False), ("tokenizer.chat_template", "str", "{{ messages }}"),
    ]
    write("gguf", "tiny_llama.gguf", gguf_bytes(tiny_llama, [
        ("token_embd.weight", [64, 4], "Q8_0"), ("blk.0.attn_q.weight", [64, 64], "Q4_1"),
        ("blk.0.attn_norm.weight", [64], "F32"), ("output_norm.weight", [64], "F16")]))
    write("gguf", "every_type.gguf", gguf_bytes([], [(name, [256, 2], name) for name in GGML_TYPES]))
    every_value = [("k." + kind, kind, 1) for kind in GGUF_VALUE if kind not in ("f32", "f64", "bool")]
    every_value += [("k.f32", "f32", 0.5), ("k.f64", "f64", -2.0), ("k.bool", "bool", True), ("k.str", "str", "x"),
                    ("k.nested", ("arr", ("arr", "u8")), [[1, 2], [3]]), ("k.empty", ("arr", "str"), [])]
    write("gguf", "every_value.gguf", gguf_bytes(every_value, []))
    write("gguf", "aligned_64.gguf", gguf_bytes([("general.alignment", "u32", 64)], [("t", [32, 3], "Q4_0")], 64))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", nargs="?",
                        default=os.path.join(HERE, "..", "..", "..", "shared", "models", "tinystories-656k"))
    parser.add_argument("--cli", help="kvpress-cli, to list the registry's presses and parameters")
    args = parser.parse_args()
    safetensors_seeds(args.model_dir)
    tokenizer_seeds(args.model_dir)
    config_seeds(args.model_dir)
    gguf_seeds()
    make_press_seeds(args.cli)
