#!/usr/bin/env python3
"""RULER-style long-context tasks for kvpress-cpp's quality benchmark.

    python benchmarks/quality/make_tasks.py --out DIR [--tokenizer smollm2-135m-instruct|PATH]
        [--lengths 1024,2048,4096] [--examples 20] [--tasks all|LIST] [--seed 0] [--stories FILE]

Ten synthetic tasks in the spirit of NVIDIA's RULER (the suite of kvpress's leaderboard), written from
scratch: needle-in-a-haystack retrieval (niah_single_1/2/3, niah_multikey, niah_multivalue,
niah_multiquery), variable tracking (vt), common and frequent words extraction (cwe, fwe) and
question answering over held-out TinyStories (qa). Haystacks are RULER's noise sentences, the held-out
stories of --stories (default: <repo>/../shared/data/tinystories_valid_100.txt; stories are separated
by lines "<|endoftext|>"), numbered word lists or coded text.

Each example has a "context" (what the model prefills: an instruction line and the haystack), a
"question" asked after it, an "answer_prefix" that begins the answer, the "answers" and a "metric":
"all" (every answer must occur in the output) or "part" (one of them). Lengths are counted in tokens
of the model's tokenizer without special tokens: --tokenizer is a model folder name under
${XDG_CACHE_HOME:-~/.cache}/kvpress-cpp/models (its *.gguf file, read by transformers), a folder with
a tokenizer.json or a .gguf file. context + question ("tokens", measured on the final texts, each
encoded on its own) fill the target length less RESERVE tokens, left for the chat template and the
answer prefix, to within one haystack unit (a sentence, a list item, a coded word).

Deterministic: every (task, length) draws from its own random.Random(f"{seed}-{task}-{length}"), so
any subset of tasks and lengths regenerates the same lines.

Written: DIR/<task>_<length>.jsonl (one example a line: id, task, length, tokens, context, question,
answer_prefix, answers, metric, max_new_tokens) and DIR/manifest.json. Takes seconds (most of it
loading the tokenizer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import string
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[2]
STORIES_FILE = "tinystories_valid_100.txt"
STORY_SEPARATOR = "<|endoftext|>"
DEFAULT_STORIES = (REPO / ".." / "shared" / "data" / STORIES_FILE).resolve()
DEFAULT_TOKENIZER = "smollm2-135m-instruct"
GENERATOR = "benchmarks/quality/make_tasks.py"

RESERVE = 40  # tokens of the target length left for the chat template and the answer prefix
NOISE = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
STORY_BREAK = "\n\n"  # between stories of a haystack
# Before the question, which the pipeline appends to the context's text (in the chat template's user
# turn, as kvpress's does): RULER's templates put it on a line of its own.
QUESTION_BREAK = "\n"
OPENING_WORDS = 10  # words of a story quoted by qa's question

# niah keys are "<adjective>-<noun>" pairs.
ADJECTIVES = [
    "long", "quiet", "bright", "hollow", "swift", "ancient", "silver", "gentle", "frozen", "hidden", "golden",
    "narrow", "sudden", "bitter", "curious", "distant", "eager", "fragile", "humble", "lively", "modern",
    "noisy", "patient", "rapid", "rustic", "sacred", "shallow", "smooth", "steady", "tender", "vivid", "wild",
    "wooden", "yellow", "crimson", "dusty", "polite", "brave", "clever", "lonely",
]
NOUNS = [
    "context", "river", "lantern", "harbor", "meadow", "engine", "compass", "garden", "mirror", "castle",
    "pencil", "thunder", "valley", "window", "basket", "candle", "forest", "island", "jacket", "kettle",
    "ladder", "market", "needle", "orchard", "pepper", "rocket", "saddle", "tunnel", "violin", "wagon",
    "anchor", "bridge", "cottage", "desert", "falcon", "glacier", "hammer", "journal", "magnet", "planet",
]
# qa asks for the name of the first "a/an [adjective] <noun> named/called <Name>" of a story.
QA_NOUNS = [
    "girl", "boy", "man", "woman", "lady", "kid", "hero", "king", "queen", "prince", "princess", "dog", "puppy",
    "cat", "kitten", "bird", "owl", "duck", "hen", "chicken", "bunny", "rabbit", "bear", "fish", "frog", "mouse",
    "lion", "tiger", "leopard", "fox", "wolf", "deer", "horse", "pony", "cow", "pig", "sheep", "goat", "monkey",
    "elephant", "giraffe", "turtle", "snake", "squirrel", "butterfly", "bee", "beetle", "bug", "ant", "spider",
    "ladybug", "worm", "whale", "dolphin", "shark", "crab", "bat", "penguin", "dragon", "unicorn", "ghost", "robot",
]
QA_NAMING = re.compile(r"\b(?:a|an) (?:[a-z]+ )?(" + "|".join(QA_NOUNS) + r") (?:named|called) ([A-Z][a-z]+)\b")
# A sentence ends at . ! ? (maybe closed by a quote) followed by whitespace; pieces keep that whitespace.
SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)|(?<=[.!?][\"'\u201d\u2019])(?=\s)")


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
class TokenCounter:
    """Token counts without special tokens; counts of haystack units are cached (they repeat)."""

    def __init__(self, backend) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.cache: dict[str, int] = {}

    def count(self, text: str) -> int:
        return len(self.backend.encode(text, add_special_tokens=False).ids)

    def unit(self, text: str) -> int:
        if text not in self.cache:
            self.cache[text] = self.count(text)
        return self.cache[text]

    def units(self, texts: list[str]) -> list[int]:
        """Counts of many units, the new ones encoded in one batch."""
        new = sorted({t for t in texts if t not in self.cache})
        if new:
            for text, encoding in zip(new, self.backend.encode_batch(new, add_special_tokens=False)):
                self.cache[text] = len(encoding.ids)
        return [self.cache[t] for t in texts]


def models_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvpress-cpp" / "models"


def gguf_tokenizer(path: Path):
    """The tokenizers.Tokenizer transformers builds from a GGUF file's vocabulary and merges."""
    import transformers
    from transformers import AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).backend_tokenizer


def load_tokenizer(spec: str) -> tuple[TokenCounter, str]:
    """--tokenizer: a model folder name under models_dir(), a folder with tokenizer.json or a .gguf file.
    Returns the counter and the file it was read from."""
    path = Path(spec).expanduser()
    if not path.exists() and os.sep not in spec:
        folder = models_dir() / spec
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            sys.exit(f"make_tasks: no .gguf file in {folder} (download the model or pass --tokenizer PATH)")
        path = ggufs[0]
    if path.is_dir():
        from tokenizers import Tokenizer

        if not (path / "tokenizer.json").exists():
            sys.exit(f"make_tasks: no tokenizer.json in {path}")
        return TokenCounter(Tokenizer.from_file(str(path / "tokenizer.json"))), str(path / "tokenizer.json")
    if path.suffix == ".gguf" and path.exists():
        return TokenCounter(gguf_tokenizer(path)), str(path)
    sys.exit(f"make_tasks: --tokenizer {spec} is neither a model name, a folder with tokenizer.json nor a .gguf file")


# ---------------------------------------------------------------------------------------------
# Haystack material
# ---------------------------------------------------------------------------------------------
@dataclass
class Story:
    text: str
    units: list[str]  # its sentences, the first led by STORY_BREAK, the others by their own whitespace
    counts: list[int]  # tokens of each unit
    opening: str  # its first OPENING_WORDS words


@dataclass
class QaTarget:
    story: int  # index in Material.stories
    noun: str
    name: str


@dataclass
class Material:
    """What the tasks draw from, prepared once."""

    counter: TokenCounter
    stories: list[Story]
    vocabulary: list[str]  # cwe's words: lowercase alphabetic words of >= 4 letters in the stories, sorted
    qa_targets: list[QaTarget]


def load_stories(path: Path) -> list[str]:
    """The non-empty stories of the file, stripped (tests/reference/common.py's split)."""
    text = path.read_text(encoding="utf-8")
    return [s.strip() for s in text.split(STORY_SEPARATOR) if s.strip()]


def opening(text: str) -> str:
    return " ".join(text.split()[:OPENING_WORDS])


def qa_target(index: int, text: str) -> QaTarget | None:
    """The story's first naming, unless the question would be ambiguous (the same noun named twice
    differently) or give the answer away (the name among the quoted opening words)."""
    matches = list(QA_NAMING.finditer(text))
    if not matches:
        return None
    noun, name = matches[0].group(1), matches[0].group(2)
    if any(m.group(1) == noun and m.group(2) != name for m in matches):
        return None
    if name in re.findall(r"[A-Za-z]+", opening(text)):
        return None
    return QaTarget(index, noun, name)


def prepare(counter: TokenCounter, stories_file: Path) -> Material:
    texts = load_stories(stories_file)
    if not texts:
        sys.exit(f"make_tasks: no stories in {stories_file}")
    stories = []
    for text in texts:
        units = [p for p in SENTENCE_END.split(text) if p]
        units[0] = STORY_BREAK + units[0]
        stories.append(Story(text, units, [], opening(text)))
    counts = counter.units([u for s in stories for u in s.units])
    start = 0
    for story in stories:
        story.counts = counts[start:start + len(story.units)]
        start += len(story.units)
    words = {w for t in texts for w in re.findall(r"[\w']+", t) if w.isascii() and w.isalpha() and w.islower()}
    vocabulary = sorted(w for w in words if len(w) >= 4)  # sorted: a set's order changes between runs
    targets = [t for i, text in enumerate(texts) if (t := qa_target(i, text)) is not None]
    return Material(counter, stories, vocabulary, targets)


def noise_units() -> Iterator[str]:
    return itertools.cycle(" " + s for s in NOISE)


def story_units(material: Material, order: list[int]) -> Iterator[tuple[str, bool]]:
    """(unit, starts a story) for the stories of `order`, again from the first once all are used."""
    for index in itertools.cycle(order):
        story = material.stories[index]
        for k, unit in enumerate(story.units):
            yield unit, k == 0


# ---------------------------------------------------------------------------------------------
# Fitting a haystack to the budget
# ---------------------------------------------------------------------------------------------
def take(units: Iterator, cost: Callable[[object], int], budget: int) -> list:
    """Units from the stream while their summed cost stays within budget."""
    taken, total = [], 0
    for unit in units:
        total += cost(unit)
        if total > budget:
            break
        taken.append(unit)
    return taken


def fit(build: Callable[[int], tuple[str, str]], n: int, counter: TokenCounter, budget: int,
        what: str) -> tuple[str, str, int, int]:
    """build(n) -> (context, question) with n haystack units; n was estimated from summed unit counts,
    so the measured texts may be a few tokens over: drop units until they fit. Returns (context,
    question, tokens, n)."""
    while n >= 0:
        context, question = build(n)
        question = QUESTION_BREAK + question
        tokens = counter.count(context) + counter.count(question)
        if tokens <= budget:
            return context, question, tokens, n
        n -= 1
    sys.exit(f"make_tasks: {what} does not fit in {budget} tokens; use a longer length")


def slot(fraction: float, slots: int) -> int:
    """Uniform slot in [0, slots) for a fraction in [0, 1) drawn before the haystack's size is known."""
    return min(int(fraction * slots), slots - 1)


def insert(units: list[str], inserts: list[tuple[int, str]]) -> str:
    """The units with each (position, text) placed before units[position] (after the last one for
    position == len(units)), those at one position in their list order; leading whitespace dropped."""
    by_position: dict[int, list[str]] = {}
    for position, text in inserts:
        by_position.setdefault(position, []).append(text)
    pieces = []
    for k in range(len(units) + 1):
        pieces.extend(by_position.get(k, []))
        if k < len(units):
            pieces.append(units[k])
    return "".join(pieces).lstrip()


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------
@dataclass
class Example:
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    tokens: int


def word_keys(rng: random.Random, count: int) -> list[str]:
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), count)
    return [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]


def seven_digits(rng: random.Random, count: int) -> list[str]:
    return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), count)]


def uuids(rng: random.Random, count: int) -> list[str]:
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


def listing(items: list[str]) -> str:
    return ", ".join(items[:-1]) + ", and " + items[-1] if len(items) > 1 else items[0]


def needle_haystack(material: Material, rng: random.Random, budget: int, preamble: str, needles: list[str],
                    question: str, stories: bool, ordered: bool = False) -> tuple[str, str, int]:
    """The needles at uniformly random sentence boundaries of a noise or stories haystack (stories in
    file order from a random one), in list order when `ordered`. Returns (context, question, tokens)."""
    counter = material.counter
    fractions = [rng.random() for _ in needles]
    if ordered:
        fractions.sort()
    if stories:
        start = rng.randrange(len(material.stories))
        order = list(range(start, len(material.stories))) + list(range(start))
        stream: Iterator[str] = (unit for unit, _ in story_units(material, order))
    else:
        stream = noise_units()
    needle_units = [" " + n for n in needles]
    fixed = counter.count(preamble) + sum(counter.units(needle_units)) + counter.count(question)
    units = take(stream, counter.unit, budget - fixed)

    def build(n: int) -> tuple[str, str]:
        inserts = [(slot(f, n + 1), u) for f, u in zip(fractions, needle_units)]
        return preamble + insert(units[:n], inserts), question

    context, question, tokens, _ = fit(build, len(units), counter, budget, "the needles")
    return context, question, tokens


NIAH_PREAMBLE = ("Some special magic {kind}s are hidden in the text below. Remember them: you will be asked about "
                 "them afterwards.\n\n")


def niah(material: Material, rng: random.Random, budget: int, *, stories: bool, kind: str = "number",
         needles: int = 1, shared_key: bool = False, all_keys: bool = False) -> Example:
    """needles "One of the special magic <kind>s for <key> is: <value>."; one key for all of them when
    shared_key (all values asked), all keys asked when all_keys, else one key asked."""
    keys = word_keys(rng, 1 if shared_key else needles)
    values = uuids(rng, needles) if kind == "uuid" else seven_digits(rng, needles)
    needle_keys = keys * needles if shared_key else keys
    texts = [f"One of the special magic {kind}s for {k} is: {v}." for k, v in zip(needle_keys, values)]
    if shared_key or all_keys:
        asked = listing(keys)
        question = f"What are all the special magic {kind}s for {asked} mentioned in the provided text?"
        prefix = f"The special magic {kind}s for {asked} mentioned in the provided text are"
        answers = values
    else:
        target = rng.randrange(needles)
        question = f"What is the special magic {kind} for {keys[target]} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {keys[target]} mentioned in the provided text is"
        answers = [values[target]]
    context, question, tokens = needle_haystack(material, rng, budget, NIAH_PREAMBLE.format(kind=kind), texts,
                                                question, stories)
    return Example(context, question, prefix, answers, tokens)


def variable_tracking(material: Material, rng: random.Random, budget: int, chain: int = 4) -> Example:
    """A chain "VAR A = 12345." "VAR B = VAR A." ... in order at random depths of the noise haystack."""
    names: list[str] = []
    while len(names) < chain:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, chain)]
    preamble = "Follow the chain(s) of variable assignments hidden in the text below.\n\n"
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {chain} variables are "
              f"assigned the value {value}, they are:")
    context, question, tokens = needle_haystack(material, rng, budget, preamble, statements, question, False,
                                                ordered=True)
    return Example(context, question, prefix, names, tokens)


def common_words(material: Material, rng: random.Random, budget: int, length: int, top: int = 10) -> Example:
    """A numbered list where `top` words appear ~length/200 times each and the others 3 times each."""
    counter = material.counter
    if len(material.vocabulary) <= top:
        sys.exit("make_tasks: cwe needs more distinct words in the stories")
    common_count, rare_count = max(4, round(length / 200)), 3
    words = rng.sample(material.vocabulary, len(material.vocabulary))
    common, rare = words[:top], words[top:]
    shuffle_seed = rng.getrandbits(64)  # the shuffle of whichever list fits
    preamble = ("Below is a numbered list of words. Some words appear more often than others; remember the ones "
                "that appear most often.\n\n")
    question = f"What are the {top} most common words in the above list?"
    prefix = f"Answer: The top {top} words that appear most often in the list are:"

    def items(n: int) -> list[str]:
        chosen = common * common_count + rare[:n] * rare_count
        random.Random(shuffle_seed).shuffle(chosen)
        return chosen

    # Tokens of " <i>." for every position and of " <word>", summed as rare words are added.
    numbers: list[int] = [0]  # numbers[i] = tokens of " 1." ... " i."

    def numbering(items_count: int) -> int:
        while len(numbers) <= items_count:
            numbers.append(numbers[-1] + counter.unit(f" {len(numbers)}."))
        return numbers[items_count]

    available = budget - counter.count(preamble) - counter.count(question)
    words_tokens = common_count * sum(counter.units([" " + w for w in common]))
    n = 0
    while n < len(rare):
        added = rare_count * counter.unit(" " + rare[n])
        if numbering(top * common_count + (n + 1) * rare_count) + words_tokens + added > available:
            break
        words_tokens += added
        n += 1
    else:
        sys.exit(f"make_tasks: cwe ran out of words ({len(rare)} rare words) at length {length}")

    def build(k: int) -> tuple[str, str]:
        return preamble + " ".join(f"{i}. {w}" for i, w in enumerate(items(k), 1)), question

    context, question, tokens, _ = fit(build, n, counter, budget, "cwe's common words")
    return Example(context, question, prefix, common, tokens)


def coded_words(rng: random.Random, count: int) -> list[str]:
    words: list[str] = []
    while len(words) < count:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))
        if word not in words:
            words.append(word)
    return words


def frequent_words(material: Material, rng: random.Random, budget: int, vocabulary: int = 500,
                   alpha: float = 2.0) -> Example:
    """Coded words drawn with Zipf probabilities (rank ** -alpha); the three most frequent ones, with
    counts strictly apart from each other and from the fourth, are the answer."""
    top = 3
    counter = material.counter
    preamble = "Below is a coded text of made-up words. Keep count of how often each coded word appears.\n\n"
    question = "What are the three most frequently appeared coded words in the above coded text?"
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    available = budget - counter.count(preamble) - counter.count(question)
    cumulative = list(itertools.accumulate(rank ** -alpha for rank in range(1, vocabulary + 1)))
    for _ in range(100):
        words = coded_words(rng, vocabulary)
        stream = (" " + words[rng.choices(range(vocabulary), cum_weights=cumulative)[0]] for _ in itertools.count())
        units = take(stream, counter.unit, available)

        def build(n: int) -> tuple[str, str]:
            return preamble + "".join(units[:n]).lstrip(), question

        context, question, tokens, n = fit(build, len(units), counter, budget, "fwe's coded text")
        counts: dict[str, int] = {}
        for unit in units[:n]:
            counts[unit[1:]] = counts.get(unit[1:], 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top + 1]
        if len(ranked) > top and all(ranked[i][1] > ranked[i + 1][1] for i in range(top)):
            return Example(context, question, prefix, [w for w, _ in ranked[:top]], tokens)
    sys.exit("make_tasks: fwe found no coded text with a strict top; use a longer length")


def story_question(material: Material, rng: random.Random, budget: int) -> Example:
    """A story with a named character among shuffled distractor stories, asked for the name."""
    counter = material.counter
    target = rng.choice(material.qa_targets)
    story = material.stories[target.story]
    distractors = [i for i, s in enumerate(material.stories) if i != target.story and s.opening != story.opening]
    rng.shuffle(distractors)
    fraction = rng.random()
    preamble = "Below are several short stories. Read them carefully: you will be asked about one of them.\n\n"
    question = f'In the story that begins "{story.opening}", what is the name of the {target.noun}?'
    target_text = STORY_BREAK + story.text
    fixed = counter.count(preamble) + counter.count(target_text) + counter.count(question)
    units = take(story_units(material, distractors), lambda u: counter.unit(u[0]), budget - fixed)

    def build(n: int) -> tuple[str, str]:
        boundaries = [k for k in range(n) if units[k][1]] + [n]  # story starts and the end
        at = boundaries[slot(fraction, len(boundaries))]
        return preamble + insert([u for u, _ in units[:n]], [(at, target_text)]), question

    context, question, tokens, _ = fit(build, len(units), counter, budget, "the target story")
    return Example(context, question, "Answer:", [target.name], tokens)


@dataclass
class Task:
    metric: str
    max_new_tokens: int
    description: str
    make: Callable[[Material, random.Random, int, int], Example]  # (material, rng, budget, length)


TASKS: dict[str, Task] = {
    "niah_single_1": Task("all", 16, "one 7-digit number needle in repeated noise sentences",
                          lambda m, r, b, n: niah(m, r, b, stories=False)),
    "niah_single_2": Task("all", 16, "one 7-digit number needle in held-out stories",
                          lambda m, r, b, n: niah(m, r, b, stories=True)),
    "niah_single_3": Task("all", 40, "one UUID needle in held-out stories",
                          lambda m, r, b, n: niah(m, r, b, stories=True, kind="uuid")),
    "niah_multikey": Task("all", 16, "4 needles with different keys in held-out stories, one key asked",
                          lambda m, r, b, n: niah(m, r, b, stories=True, needles=4)),
    "niah_multivalue": Task("all", 64, "4 needles with one key and different numbers in held-out stories, all asked",
                            lambda m, r, b, n: niah(m, r, b, stories=True, needles=4, shared_key=True)),
    "niah_multiquery": Task("all", 64, "4 needles with different keys in held-out stories, all 4 keys asked",
                            lambda m, r, b, n: niah(m, r, b, stories=True, needles=4, all_keys=True)),
    "vt": Task("all", 30, "variable tracking: a chain of 4 assignments in noise sentences, all names asked",
               lambda m, r, b, n: variable_tracking(m, r, b)),
    "cwe": Task("all", 120, "common words extraction: the 10 most common words of a numbered word list",
                lambda m, r, b, n: common_words(m, r, b, n)),
    "fwe": Task("all", 50, "frequent words extraction: the 3 most frequent words of Zipf-distributed coded text",
                lambda m, r, b, n: frequent_words(m, r, b)),
    "qa": Task("part", 16, "the name of a story's character, the story among shuffled held-out distractor stories",
               lambda m, r, b, n: story_question(m, r, b)),
}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                        help=f"model name under {models_dir()}, tokenizer folder or .gguf file")
    parser.add_argument("--lengths", default="1024,2048,4096", help="comma list of target lengths in tokens")
    parser.add_argument("--examples", type=int, default=20, help="examples per task and length")
    parser.add_argument("--tasks", default="all", help=f"all, or a comma list of: {', '.join(TASKS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stories", type=Path, default=DEFAULT_STORIES)
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    args.tasks = list(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    if any(n <= RESERVE for n in args.lengths) or args.examples < 1:
        parser.error(f"lengths must exceed {RESERVE} tokens and --examples be >= 1")
    return args


def examples(material: Material, task: str, length: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}-{task}-{length}")  # str seeds hash with SHA-512: the same in every run
    spec = TASKS[task]
    rows = []
    for i in range(count):
        ex = spec.make(material, rng, length - RESERVE, length)
        rows.append({"id": f"{task}_{length}_{i}", "task": task, "length": length, "tokens": ex.tokens,
                     "context": ex.context, "question": ex.question, "answer_prefix": ex.answer_prefix,
                     "answers": ex.answers, "metric": spec.metric, "max_new_tokens": spec.max_new_tokens})
    return rows


def main() -> None:
    args = parse_args()
    start = time.time()
    counter, tokenizer_file = load_tokenizer(args.tokenizer)
    material = prepare(counter, args.stories)
    loaded = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    files = []
    for task in args.tasks:
        for length in args.lengths:
            rows = examples(material, task, length, args.examples, args.seed)
            name = f"{task}_{length}.jsonl"
            text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            (args.out / name).write_text(text, encoding="utf-8")
            files.append(name)
    manifest = {"seed": args.seed, "tokenizer": args.tokenizer, "lengths": args.lengths, "examples": args.examples,
                "tasks": {t: {"metric": TASKS[t].metric, "description": TASKS[t].description} for t in args.tasks},
                "files": files, "generator": GENERATOR, "tokenizer_file": Path(tokenizer_file).name,
                "stories": args.stories.name, "reserve": RESERVE}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    print(f"make_tasks: {len(args.tasks)} tasks x {len(args.lengths)} lengths x {args.examples} examples in "
          f"{args.out} ({time.time() - loaded:.1f} s, {loaded - start:.1f} s loading the tokenizer)")


if __name__ == "__main__":
    main()
