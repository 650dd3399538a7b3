#!/usr/bin/env python3
"""Chat-template fixtures: transformers' rendering of every template kvpress::llama knows.

    python make_chat_fixtures.py --out DIR [--tokenizers DIR]

Every template text in tests/data/chat_templates (see its README.md) renders a set of conversations
through transformers' render_jinja_template (what tokenizer.apply_chat_template(tokenize=False)
calls, with the tokenizer's bos_token and eos_token), with and without the generation prompt, and
with the options the templates read (Qwen3's enable_thinking, Llama 3.1/3.2's date_string). The
conversations probe what the renderings differ in: a system message or none, several turns,
assistant turns with and without <think> blocks before and after the last user message, text with
leading and trailing whitespace of several kinds (Llama 3 trims it as Python's str.strip does),
empty and non-ASCII content.

With --tokenizers (the folder make_tokenizer_fixtures.py wrote; default: DIR/../tokenizers), each
rendering is also encoded, without added special tokens, by the byte-level tokenizer of its family
there (qwen2 for ChatML, llama3 for Llama 3), whose added tokens hold the template's special tokens.

Written: DIR/cases.json, a list of {file, family, messages, add_generation_prompt, options, text,
tokenizer, ids}; for Llama 3.2 without a date_string the text holds the date of this run, recorded as
"today". Takes a second.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from common import parse_args, prepare_out, versions, write_json

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# file -> (family as kvpress::llama::ChatTemplate::name(), special tokens, fixture tokenizer)
CHATML = {"bos_token": None, "eos_token": "<|im_end|>"}
LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
FILES = {
    "smollm2.jinja": ("smollm2", CHATML, "qwen2"),
    "qwen2_5.jinja": ("qwen2.5", CHATML, "qwen2"),
    "qwen3.jinja": ("qwen3", CHATML, "qwen2"),
    "qwen3_string_content.jinja": ("qwen3", CHATML, "qwen2"),
    "qwen3_think_history.jinja": ("qwen3", CHATML, "qwen2"),
    "llama3.jinja": ("llama3", LLAMA3, "llama3"),
    "llama3_always_prompt.jinja": ("llama3", LLAMA3, "llama3"),
    "llama3_1.jinja": ("llama3.1", LLAMA3, "llama3"),
    "llama3_1_initial.jinja": ("llama3.1", LLAMA3, "llama3"),
    "llama3_2.jinja": ("llama3.2", LLAMA3, "llama3"),
}
THINK = "<think>\nLet me count: one, two.\n</think>\n\nTwo."
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "\tWhat is 2+2? \u3000\u00a0"},
     {"role": "assistant", "content": " Four.\n\n"}, {"role": "user", "content": "And 3+3?\u2028"}],
    [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": THINK},
     {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "\n\n<think>\n\nYes.\n</think>\nSure."}],
    [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": THINK}],
    [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": "No think block here."},
     {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "<think></think>"},
     {"role": "system", "content": "Late system."}, {"role": "user", "content": "Ünïcödé 日本語 🙂 \u0085"}],
]
OPTIONS = [{}, {"enable_thinking": False}, {"date_string": "01 Jan 2030"}]


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument("--tokenizers", type=Path, default=None))
    out = prepare_out(args.out)
    tokenizers_dir = args.tokenizers or args.out.parent / "tokenizers"
    assert sorted(FILES) == sorted(p.name for p in TEMPLATES.glob("*.jinja")), "FILES must list every template"
    tokenizers = {name: Tokenizer.from_file(str(tokenizers_dir / name / "tokenizer.json")) for name in ("qwen2", "llama3")}
    today = datetime.datetime.now().strftime("%d %b %Y")  # transformers' strftime_now, as Llama 3.2 reads it
    cases = []
    for file, (family, special, tokenizer) in FILES.items():
        text = (TEMPLATES / file).read_text(encoding="utf-8")
        for messages in CONVERSATIONS:
            for generation_prompt in (False, True):
                for options in OPTIONS:
                    rendered = render_jinja_template(conversations=[messages], chat_template=text,
                                                     add_generation_prompt=generation_prompt, **special, **options)[0][0]
                    cases.append({"file": file, "family": family, "messages": messages,
                                  "add_generation_prompt": generation_prompt, "options": options, "text": rendered,
                                  "tokenizer": tokenizer,
                                  "ids": tokenizers[tokenizer].encode(rendered, add_special_tokens=False).ids})
    write_json(out / "cases.json", {**versions(), "today": today, "cases": cases}, indent=0, ensure_ascii=False)
    print(f"make_chat_fixtures: {len(FILES)} templates, {len(cases)} renderings in {out}")


if __name__ == "__main__":
    main()
