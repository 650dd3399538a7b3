#!/usr/bin/env python3
"""Byte-level BPE tokenizer fixtures: the Python `tokenizers` library's ids and decoded text.

    python make_tokenizer_fixtures.py --out DIR [--models DIR] [--data FILE] [--strings N]

Five byte-level tokenizers, each laid out as its model family's tokenizer.json is, with a BPE
vocabulary trained here by `tokenizers` itself (2,000 tokens on the stories file and on the
multilingual text below, the 256 byte characters included, so every input encodes):

* gpt2      ByteLevel(add_prefix_space=false) with GPT-2's split regex; ByteLevel decoder and
            post-processor (GPT-2, Mistral-Nemo's layout);
* smollm2   Digits(individual) then ByteLevel with GPT-2's regex (SmolLM2's tokenizer.json);
* llama3    Split(Llama 3's regex, Isolated) then ByteLevel(use_regex=false), ignore_merges, a
            Sequence post-processor of ByteLevel and a BOS template (Llama 3.x's);
* qwen2     NFC, then Split(Qwen2's regex: digits one by one) and ByteLevel(use_regex=false)
            (Qwen2 / Qwen2.5 / Qwen3's);
* prefixed  ByteLevel(add_prefix_space=true) after Split(String "\\n") and Digits in runs: the
            remaining pre-tokenizer options.

Each has the family's special tokens as added tokens (and one normalized, non-special added token).
The same N strings (default 10,000; seeded), and six long ones (the whole stories file; runs of
100,000 spaces, newlines, letters, digits, emoji), go through every tokenizer: stories, multilingual text
(Latin with composed and decomposed accents, Cyrillic, Greek, Arabic, Hebrew, Devanagari, Thai,
CJK, Hangul and its jamo), emoji (ZWJ sequences, skin tones, flags), digits of every kind, whitespace
runs (tabs, CR LF, no-break and ideographic spaces, U+0085, U+2028), code, contractions in any case
(the long s and the Kelvin sign fold to s and k), the added tokens, random code points, and byte
strings that are not valid UTF-8 (encoded as `tokenizers` encodes text.decode("utf-8", "replace")).

Written: <name>/tokenizer.json per tokenizer, strings.json (each string's bytes in hex) and
<name>/expected.json: per string the ids with and without the post-processor's special tokens, and
decode(ids) with and without skip_special_tokens. Takes a few seconds.
"""

from __future__ import annotations

import random
import time

# First: importing common checks the pinned kvpress version (the reference stack's pin).
from common import load_stories, parse_args, prepare_out, versions, write_json

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The split regexes of the families' tokenizer.json files.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB_SIZE = 2000

# Text pools for the strings (and the training corpus).
WORDS = {
    "latin": ["café", "cafe\u0301", "naïve", "Ångström", "A\u030angstro\u0308m", "señor", "Straße", "øre", "Łódź",
              "ﬁne", "Œuvre", "İstanbul", "ǅemal", "ÉCOLE", "garçon", "smørrebrød"],
    "cyrillic": ["Привет", "мир", "Ёлка", "ещё", "ЗДРАВСТВУЙТЕ", "й", "и\u0306"],
    "greek": ["Καλημέρα", "κόσμε", "ΣΟΦΙΑ", "ς", "ά", "α\u0301"],
    "arabic": ["مرحبا", "بالعالم", "السَّلَامُ", "عليكم"],
    "hebrew": ["שָׁלוֹם", "עולם"],
    "devanagari": ["नमस्ते", "दुनिया", "क़"],
    "thai": ["สวัสดี", "ชาวโลก"],
    "cjk": ["你好", "世界", "漢字", "こんにちは", "カタカナ", "ｶﾀｶﾅ", "日本語のテキスト"],
    "hangul": ["안녕하세요", "세계", "\u1100\u1161\u11a8", "한국어"],
    "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🏳️‍🌈", "❤️", "🤖", "✨", "1️⃣"],
    "digits": ["0", "7", "42", "1234", "3.14159", "1,000,000", "2026-12-04", "١٢٣", "１２３", "²", "Ⅻ", "½", "߁߂",
               "0x1F", "1e-5"],
    "space": [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u2009", "\u3000", "\u0085", "\u2028", "\v", "\f",
              "   \n  ", " \t "],
    "code": ["def f(x):\n    return x**2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
             "if x != None and y >= 3:", "std::vector<int64_t> ids;", "#include <stdio.h>", "a->b", "x += 1;  // ok",
             "{\"key\": [1, 2, 3]}", "SELECT * FROM t WHERE id = 7;", "```python\nprint('hi')\n```"],
    "contractions": ["I'm", "you'll", "YOU'LL", "it'S", "we're", "They've", "he'd", "Dog's", "'s", "ſ", "'ſ", "'K",
                     "don't", "O'Neil", "’s", "rock'n'roll"],
    "punct": ["!", "?!", "...", "—", "–", "«»", "“quoted”", "(parens)", "[x]", "@user", "#tag", "$5", "%", "&&",
              "||", "~", "`", "^", "*", "\\"],
}
ADDED = {  # family -> (special tokens, the post-processor's BOS or None)
    "gpt2": (["<|endoftext|>"], None),
    "smollm2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>"),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None),
    "prefixed": (["<s>", "</s>"], "<s>"),
}
# One non-special added token, matched in the normalized text.
NORMALIZED_ADDED = "kvpress"


def random_code_point(rng: random.Random) -> str:
    """A code point from a mix of planes (surrogates excluded), many of them unassigned or rare."""
    while True:
        cp = rng.choice([rng.randrange(0x20, 0x250), rng.randrange(0x250, 0x3000), rng.randrange(0x3000, 0xD800),
                         rng.randrange(0xE000, 0x10000), rng.randrange(0x10000, 0x20000),
                         rng.randrange(0x20000, 0x110000)])
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def invalid_utf8(rng: random.Random) -> bytes:
    """Bytes that are not valid UTF-8: stray continuation bytes, truncated or overlong sequences,
    surrogates, values past U+10FFFF, bytes 0xF5..0xFF, between valid text."""
    pieces = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xc3", b"\xe2\x82", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x9f\x98",
              b"\xf4\x90\x80\x80", b"\xf5", b"\xff", b"\xfe\xfe", b"\xc3\x28", b"\xe2\x28\xa1", b"\xf0\x28\x8c\x28"]
    parts = []
    for _ in range(rng.randint(1, 4)):
        parts.append(rng.choice(pieces) if rng.random() < 0.6 else rng.choice(WORDS["latin"] + WORDS["cjk"]).encode())
    return b"".join(parts)


def make_strings(rng: random.Random, stories: list[str], n: int, added: list[str]) -> list[bytes]:
    fixed = ["", " ", "  ", "\n", "a", "Hello world", "Hello  world", "hello\nworld", " leading", "trailing ",
             "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|begin_of_text|><|start_header_id|>user",
             "kvpress is a kvpress", "12345678901234567890", "\u0085\u0085 x", "'S'LL'VE"]
    strings = [s.encode() for s in fixed]
    categories = list(WORDS) + ["story", "added", "random", "invalid"]
    while len(strings) < n:
        parts = []
        for _ in range(rng.randint(1, 6)):
            category = rng.choice(categories)
            if category == "story":
                story = rng.choice(stories)
                start = rng.randrange(len(story))
                parts.append(story[start:start + rng.randint(1, 120)].encode())
            elif category == "added":
                parts.append(rng.choice(added + [NORMALIZED_ADDED]).encode())
            elif category == "random":
                parts.append("".join(random_code_point(rng) for _ in range(rng.randint(1, 5))).encode())
            elif category == "invalid":
                parts.append(invalid_utf8(rng))
            else:
                parts.append(rng.choice(WORDS[category]).encode())
            if rng.random() < 0.5:
                parts.append(rng.choice(WORDS["space"]).encode())
        strings.append(b"".join(parts))
    return strings[:n]


def build(name: str, corpus: list[str]) -> Tokenizer:
    special, bos = ADDED[name]
    tok = Tokenizer(models.BPE(ignore_merges=(name == "llama3")))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "gpt2":
        tok.pre_tokenizer = byte_level
    elif name == "smollm2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif name in ("llama3", "qwen2"):
        pattern = LLAMA3_PATTERN if name == "llama3" else QWEN2_PATTERN
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        if name == "qwen2":
            tok.normalizer = normalizers.NFC()
    elif name == "prefixed":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(NORMALIZED_ADDED, normalized=True, special=False)])
    if bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        template = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
        tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    return tok


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument("--strings", type=int, default=10_000))
    start = time.time()
    out = prepare_out(args.out)
    rng = random.Random(20261204)
    stories = load_stories(args.data)
    corpus = stories + [" ".join(rng.choice(words) for _ in range(12)) for words in WORDS.values() for _ in range(50)]
    every_added = sorted({t for special, _ in ADDED.values() for t in special})
    strings = make_strings(rng, stories, args.strings, every_added)
    # Long inputs: a whole stories file, and runs of 100,000 spaces, newlines, letters, digits and
    # emoji (the regexes' repetitions and look-aheads over long runs).
    strings += ["\n".join(stories).encode(), b" " * 100_000 + b"x", b"\n" * 100_000, b"a" * 100_000,
                b"7" * 100_000, "\U0001F600".encode() * 25_000]
    write_json(out / "strings.json", {**versions(), "tokenizers_version": tokenizers.__version__,
                                      "strings_hex": [s.hex() for s in strings]}, indent=0)
    for name in ADDED:
        tok = build(name, corpus)
        folder = prepare_out(out / name)
        tok.save(str(folder / "tokenizer.json"))
        # What the C++ reader loads must be what is compared: reload the saved file.
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cases = []
        for raw in strings:
            text = raw.decode("utf-8", errors="replace")
            ids = tok.encode(text, add_special_tokens=True).ids
            cases.append({"ids": ids, "ids_plain": tok.encode(text, add_special_tokens=False).ids,
                          "decoded": tok.decode(ids, skip_special_tokens=False),
                          "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
        write_json(folder / "expected.json", {"tokenizer": name, "cases": cases}, indent=0, ensure_ascii=False)
    print(f"make_tokenizer_fixtures: tokenizers {tokenizers.__version__}: {len(ADDED)} byte-level tokenizers x "
          f"{len(strings)} strings in {out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
