"""Runs kvpress 0.5.5's own test suite (tests/ of its source distribution) with
kvpress_cpp.accelerate() on, offline: every hub model the suite loads is served from a local Hugging
Face cache whose entries all hold the bundled TinyStories-656K model.

Usage: python run.py --models DIR [--work DIR] [--no-accelerate] [pytest args...]
Prints pytest's summary, the tests that cannot run offline with why, and the calls and fallbacks
per press and reason. Exit status: pytest's when it failed; else 1 when acceleration failed its
checks (check_acceleration: a fallback for a reason kvpress_cpp does not name, or a press
accelerate() claims that the suite called but that never went through kvpress-cpp); else 0.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile

KVPRESS_VERSION = "0.5.5"
# Every hub model kvpress's tests name (tests/fixtures.py and the test files), all served by the
# bundled model: the suite checks shapes, cache lengths and press behaviour, not a model's answers.
HUB_MODELS = [
    "MaxJeblick/llama2-0b-unit-test",
    "maxjeblick/llama2-0b-unit-test",
    "h2oai/h2o-danube3-500m-chat",
    "meta-llama/Llama-3.2-1B-Instruct",
]
HERE = os.path.dirname(os.path.abspath(__file__))

# Tests that cannot run offline on the bundled model, and why. Each also fails with acceleration off
# (run.py --no-accelerate shows it): they are kvpress's own limits here, not ours.
DOWNLOADS_STATS = "downloads ExpectedAttentionStatsPress's query statistics from the hub"
DOWNLOADS_QFILTERS = "downloads QFilterPress's Q-filters from the hub"
UNIT_MODEL_VOCAB = ("feeds token ids up to 3000 and checks shapes of MaxJeblick/llama2-0b-unit-test; "
                    "TinyStories-656K has 2048 tokens")
UNIT_MODEL_TEXT = "expects the exact text MaxJeblick/llama2-0b-unit-test generates"
UNIT_MODEL_TOKENS = "expects the token counts of MaxJeblick/llama2-0b-unit-test's tokenizer in the log"
CANNOT_RUN_OFFLINE = {
    "tests/presses/test_duo_attention_press.py::test_load_attention_pattern":
        "downloads DuoAttention's head patterns from raw.githubusercontent.com",
    "tests/presses/test_ea_with_stats.py::test_load_stats": DOWNLOADS_STATS,
    "tests/presses/test_qfilters_press.py::test_load_qfilters": DOWNLOADS_QFILTERS,
    "tests/presses/test_key_rerotation_press_rope.py::test_rerotate_keys_is_matches_reference_implementation[full-default]":
        "atol 1e-6 between kvpress's rerotation and its reference holds on the unit-test model's keys, "
        "not on TinyStories-656K's (kvpress's own Python fails it too)",
    "tests/presses/test_key_rerotation_press_rope.py::test_rerotate_keys_is_matches_reference_implementation[full-yarn]":
        "the same with YaRN RoPE scaling",
    "tests/presses/test_presses.py::test_presses_keep_highest_score": UNIT_MODEL_VOCAB,
    "tests/test_per_layer_compression_press.py::test_per_layer_compression_press": UNIT_MODEL_VOCAB,
    "tests/test_generate.py::test_generate": UNIT_MODEL_TEXT,
    "tests/test_pipeline.py::test_pipeline_answer_is_correct": UNIT_MODEL_TEXT,
    "tests/test_pipeline.py::test_pipeline": UNIT_MODEL_TOKENS,
    "tests/test_pipeline.py::test_pipeline_single_or_no_question": UNIT_MODEL_TOKENS,
    "tests/test_pipeline.py::test_pipeline_compresses_context": UNIT_MODEL_TOKENS,
}
# default_presses entries 3 and 6 (ExpectedAttentionStatsPress, QFilterPress) in every test built on them.
for wrapper in ["None", "ComposedPress", "KeyRerotationPress", "AdaKVPress", "ChunkPress", "CriticalKVPress",
                "CriticalAdaKVPress", "DMSPress", "MergingPress", "EntropyGatedChunkKVPress"]:
    CANNOT_RUN_OFFLINE[f"tests/presses/test_presses.py::test_presses_run[{wrapper}-press_dict3]"] = DOWNLOADS_STATS
    CANNOT_RUN_OFFLINE[f"tests/presses/test_presses.py::test_presses_run[{wrapper}-press_dict6]"] = DOWNLOADS_QFILTERS
for decoding in ["DecodingPress", "CAMPress"]:
    CANNOT_RUN_OFFLINE[f"tests/test_decoding_compression.py::test_all_presses_work_with_decoding_press[press_config3-{decoding}]"] = DOWNLOADS_STATS
    CANNOT_RUN_OFFLINE[f"tests/test_decoding_compression.py::test_all_presses_work_with_decoding_press[press_config6-{decoding}]"] = DOWNLOADS_QFILTERS


def fetch_suite(work):
    """kvpress's sdist (pip download, pinned) unpacked under work; returns its root."""
    root = os.path.join(work, f"kvpress-{KVPRESS_VERSION}")
    if os.path.isdir(os.path.join(root, "tests")):
        return root
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"kvpress=={KVPRESS_VERSION}", "-d", work], check=True)
    with tarfile.open(os.path.join(work, f"kvpress-{KVPRESS_VERSION}.tar.gz")) as tar:
        tar.extractall(work, filter="data")
    return root


def make_hub_cache(cache, model_dir):
    """A Hugging Face hub cache (HF_HUB_CACHE layout) in which every HUB_MODELS entry is model_dir."""
    for name in HUB_MODELS:
        repo = os.path.join(cache, "models--" + name.replace("/", "--"))
        snapshot = os.path.join(repo, "snapshots", "local")
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write("local")
        if os.path.isdir(snapshot):
            shutil.rmtree(snapshot)
        shutil.copytree(model_dir, snapshot)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", required=True, help="folder holding tinystories-656k/")
    p.add_argument("--work", default=os.path.join(os.getcwd(), "kvpress_suite"), help="download and cache folder")
    p.add_argument("--no-accelerate", action="store_true", help="run the suite on kvpress's own Python")
    args, pytest_args = p.parse_known_args()
    os.makedirs(args.work, exist_ok=True)
    root = fetch_suite(args.work)
    cache = os.path.join(args.work, "hub")
    make_hub_cache(cache, os.path.join(args.models, "tinystories-656k"))
    report = os.path.join(args.work, "acceleration.json")
    if os.path.exists(report):
        os.remove(report)
    env = dict(os.environ, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONPATH=os.pathsep.join([HERE, root]),
               KVPRESS_CPP_ACCELERATE="0" if args.no_accelerate else "1", KVPRESS_CPP_ACCELERATION_REPORT=report)
    deselect = [arg for test in CANNOT_RUN_OFFLINE for arg in ("--deselect", test)]
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest_accelerate", "-q", "-rfEs", "--no-header",
           "-p", "no:cacheprovider", *deselect, *pytest_args, "tests"]
    status = subprocess.run(cmd, cwd=root, env=env).returncode
    print(f"\nNot run ({len(CANNOT_RUN_OFFLINE)} tests that cannot run offline on the bundled model):")
    by_reason = {}
    for test, reason in CANNOT_RUN_OFFLINE.items():
        by_reason.setdefault(reason, []).append(test)
    for reason, tests in by_reason.items():
        print(f"  {reason}:")
        for test in tests:
            print(f"    {test}")
    if args.no_accelerate:
        return status
    if not os.path.exists(report):
        print("kvpress_cpp acceleration: no report was written (did pytest start?)")
        return status or 1
    with open(report) as f:
        counts = json.load(f)
    print(format_counts(counts))
    problems = check_acceleration(counts)
    for problem in problems:
        print(f"FAIL {problem}")
    return status or (1 if problems else 0)


def format_counts(counts):
    """The report's table: calls and fallbacks per press (accelerated presses the suite never called
    included), by reason, then each fallback's detail."""
    per_press = dict(counts["per_press"])
    for name in counts["accelerated"]:
        per_press.setdefault(name, {"calls": 0, "fallbacks": 0, "reasons": {}})
    lines = [f"kvpress_cpp acceleration: {counts['calls']} calls through kvpress-cpp, {counts['fallbacks']} fell "
             f"back to kvpress", f"  {'press':<28} {'calls':>6} {'fallbacks':>9}  reasons"]
    for name, c in sorted(per_press.items()):
        reasons = ", ".join(f"{r} {n}" for r, n in c["reasons"].items()) or ("not called" if not c["calls"] else "-")
        lines.append(f"  {name:<28} {c['calls']:>6} {c['fallbacks']:>9}  {reasons}")
    if counts["fallback_reasons"]:
        lines.append("  fallbacks:")
        lines += [f"    {n:5d}  {key}" for key, n in sorted(counts["fallback_reasons"].items(), key=lambda kv: -kv[1])]
    never = sorted(name for name, c in per_press.items() if name in counts["accelerated"] and not c["calls"])
    if never:
        lines.append(f"  accelerated presses with no call through kvpress-cpp: {', '.join(never)}")
    return "\n".join(lines)


def check_acceleration(counts):
    """What the run says is wrong with acceleration: a fallback whose reason is not one of
    kvpress_cpp.REASONS (the named unsupported inputs: anything else is an input the library should
    have taken), and a press accelerate() claims that the suite called but never through kvpress-cpp."""
    problems = []
    named = set(counts["reasons"])
    for name, c in sorted(counts["per_press"].items()):
        for reason, n in c["reasons"].items():
            if reason not in named:
                problems.append(f"{name}: {n} calls fell back for {reason!r}, not a reason kvpress_cpp names")
    for name in counts["accelerated"]:
        c = counts["per_press"].get(name)
        if c and c["calls"] == 0 and c["fallbacks"] > 0:
            problems.append(f"{name}: the suite called it {c['fallbacks']} times, never through kvpress-cpp "
                            f"({', '.join(c['reasons'])})")
    return problems


if __name__ == "__main__":
    sys.exit(main())
