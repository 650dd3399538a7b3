"""What every fixture script of tests/reference shares, in one place.

Importing this module first checks that the installed kvpress is the pinned version (before torch,
transformers or kvpress are imported), so a fixture never silently comes from another release:

    from common import KVPRESS_VERSION, parse_args, setup, ...   # first import of a make_*.py

It then holds:

* the command line (`--out`, `--models`, `--data` and their defaults), the run set-up (threads,
  global seed, quiet loggers), the output folder's clean-up, the version fields of a manifest and
  the writing of safetensors / JSON files;
* the stories file and the TinyStories-656K model and tokenizer, the prompts that
  make_model_fixtures.py and make_ragged_fixtures.py share, random-weight Llama models;
* what kvpress's forward hook receives (`capture`), RoPE (`apply_rope`, `inv_freq`), the kept
  positions of a compressed cache (`kept_positions`, `kept_mask`);
* presses from the C++ registry's parameter syntax (`parse_value`, `build_press`, `split_seed`);
* kvpress's pipeline after the prefill (`pipeline_context_length`, `decode_tail`, `greedy_steps`)
  and kvpress-cli eval's continuation NLL (`eval_prefix`, `continuation_nll`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import io
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

PINNED_KVPRESS = "0.5.5"
SCRIPT = Path(sys.argv[0]).name or "tests/reference"  # the running script, for messages


def require_pinned_kvpress() -> str:
    """Returns the installed kvpress version; exits with a message naming the script otherwise."""
    try:
        version = importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{SCRIPT}: kvpress {PINNED_KVPRESS} is not installed in {sys.executable}")
    if version != PINNED_KVPRESS:
        sys.exit(f"{SCRIPT}: the parity target is kvpress {PINNED_KVPRESS}, but {sys.executable} has kvpress "
                 f"{version}; run scripts/setup.sh and use its virtual environment")
    return version


KVPRESS_VERSION = require_pinned_kvpress()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import rotate_half  # noqa: E402

import kvpress  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "tinystories-656k"
STORIES_FILE = "tinystories_valid_100.txt"
STORY_SEPARATOR = "<|endoftext|>"

# Prompts on TinyStories-656K: (name, story index in the stories file, prefix length incl. BOS,
# question tokens, decode steps). The question is the story's next tokens after the prefix. "long":
# 400 tokens take LagKV's partitioned path (tie-free at ratio 0.5) and NonCausalAttn's padded last
# chunk; "short": 140 tokens take LagKV's short-input ramp (and keep 70 >= SnapKV's window of 64,
# so the window's equal max + 1 scores do not straddle the threshold). make_model_fixtures.py and
# make_ragged_fixtures.py run them.
PROMPTS = [
    ("long", 2, 400, 8, 8),
    ("short", 1, 140, 8, 8),
]

# kvpress-cli eval's protocol: the prefix is floor(EVAL_PREFIX_FRACTION * length) tokens (its default).
EVAL_PREFIX_FRACTION = 0.5

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
SHORT_DTYPE = {torch.float32: "f32", torch.bfloat16: "bf16"}


# ---------------------------------------------------------------------------------------------
# Command line, set-up, output
# ---------------------------------------------------------------------------------------------
def default_models() -> Path:
    """--models' default: $KVPRESS_MODELS, else <repo>/../shared/models."""
    return Path(os.environ.get("KVPRESS_MODELS", REPO.parent / "shared" / "models"))


def parse_args(doc: str, add_arguments=None, out_default: Path | None = None) -> argparse.Namespace:
    """--out DIR (required unless out_default), --models DIR, --data FILE, and what
    add_arguments(parser) adds. args.data is resolved: --data, else <models>/../data/STORIES_FILE."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=out_default is None, default=out_default)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--models", type=Path, default=default_models())
    parser.add_argument("--data", type=Path, default=None,
                        help=f"stories file (default: <models>/../data/{STORIES_FILE})")
    args = parser.parse_args()
    args.data = args.data or args.models.parent / "data" / STORIES_FILE
    return args


def setup(threads: int) -> float:
    """CPU threads, the global seed 0, transformers and kvpress quiet; returns the start time."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # kvpress's warnings (decoding presses' overridden ratio, KVCompose's "~2x the context",
    # PerLayerCompressionPress's flash attention) repeat on every run.
    logging.getLogger("kvpress").setLevel(logging.ERROR)
    return time.time()


def prepare_out(out: Path, stale: tuple[str, ...] = ("*.safetensors", "*.json")) -> Path:
    """Creates `out` and removes the files matching `stale` (a fixture folder holds only this run)."""
    out.mkdir(parents=True, exist_ok=True)
    for pattern in stale:
        for path in out.glob(pattern):
            path.unlink()
    return out


def versions() -> dict[str, str]:
    """The version fields every manifest starts with."""
    return {"kvpress_version": KVPRESS_VERSION, "torch_version": torch.__version__,
            "transformers_version": transformers.__version__}


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def write_json(path: Path, obj, indent: int = 1, ensure_ascii: bool = True) -> None:
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Stories, model, tokenizer
# ---------------------------------------------------------------------------------------------
def load_stories(data: Path) -> list[str]:
    """The non-empty stories of the stories file, stripped; indices in the fixtures count these."""
    text = data.read_text(encoding="utf-8")
    return [s.strip() for s in text.split(STORY_SEPARATOR) if s.strip()]


def token_ids(tok, text: str) -> torch.Tensor:
    """[1, n] int64: the tokenizer's ids of text, BOS included."""
    return tok(text, return_tensors="pt").input_ids


def first_story_with(tok, stories: list[str], min_tokens: int) -> tuple[int, torch.Tensor]:
    """The index and ids [1, n] of the first story of at least min_tokens tokens."""
    for index, story in enumerate(stories):
        ids = token_ids(tok, story)
        if ids.shape[1] >= min_tokens:
            return index, ids
    raise SystemExit(f"{SCRIPT}: no story with >= {min_tokens} tokens")


def model_dir(models: Path) -> Path:
    """<models>/tinystories-656k; exits with a message when it is missing."""
    path = models / MODEL
    if not (path / "config.json").exists():
        raise SystemExit(f"{SCRIPT}: model not found at {path} (use --models or KVPRESS_MODELS)")
    return path


def load_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(str(path))


def load_model(path: Path, attn_implementation: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(path), attn_implementation=attn_implementation, dtype=dtype).eval()


def random_llama(seed: int, head_dim: int, num_layers: int, hidden_size: int, intermediate_size: int,
                 attn_implementation: str) -> LlamaForCausalLM:
    """A random-weight Llama (8 query / 2 KV heads, vocabulary 1000), float32, from
    torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=4096, rope_theta=10000.0,
        # Larger than the default 0.02 so that attention is peaked rather than near-uniform
        # (near-uniform attention makes attention-based scores near-ties everywhere).
        initializer_range=0.08, tie_word_embeddings=False, attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).eval()


def perturb_biases_and_norms(model) -> None:
    """Draws a random-weight model's biases and per-head q/k norm weights away from transformers'
    initial 0 and 1 (N(0, 0.5) and U(0.5, 1.5)), so that a runner ignoring them is caught."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(".bias"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.uniform_(0.5, 1.5)


# ---------------------------------------------------------------------------------------------
# What kvpress sees
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def capture(model):
    """Forward hooks (with_kwargs) on every layer's self_attn recording, per layer index, what
    kvpress's BasePress.forward_hook receives: the module, kwargs["hidden_states"], the layer's
    cache keys/values, output[1] (eager attention weights, else None), kwargs["position_embeddings"]
    and kwargs["cache_position"]. Registered before a press's hooks, they run before it compresses.

        with capture(model) as captured:   # {layer_idx: dict}, the last forward's per layer
            model.model(input_ids=ids, past_key_values=DynamicCache())
    """
    captured: dict[int, dict] = {}

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        captured[module.layer_idx] = {
            "module": module,
            "hidden_states": kwargs["hidden_states"].detach().clone(),
            "keys": layer.keys.detach().clone(),
            "values": layer.values.detach().clone(),
            "attentions": None if output[1] is None else output[1].detach().clone(),
            "position_embeddings": tuple(t.detach().clone() for t in kwargs["position_embeddings"]),
            "cache_position": kwargs.get("cache_position"),
        }
        return output

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' Llama applies it: x [B, H, S, D], cos/sin [B, S, D]."""
    return (x * cos.unsqueeze(1)) + (rotate_half(x) * sin.unsqueeze(1))


def inv_freq(rotary_emb) -> torch.Tensor:
    """The RoPE inverse frequencies of a rotary embedding (model.model.rotary_emb), float32 [D/2]
    whatever the model dtype (HF keeps them in float32)."""
    return rotary_emb.inv_freq.detach().to(torch.float32).contiguous()


def kept_positions(keys: torch.Tensor, values: torch.Tensor | None, new_keys: torch.Tensor,
                   new_values: torch.Tensor | None, sort: bool = True) -> torch.Tensor:
    """Where each row of a compressed cache (new_keys [B, H, n, D], with new_values when given) sits
    in the cache it was selected from (keys [B, H, S, D]): post-RoPE keys of different positions
    differ, so every kept row must match exactly one cached position. [B, H, n] int64, ascending,
    or in the order kvpress left the rows (topk's score order) with sort=False."""
    full, kept_rows = keys, new_keys
    if values is not None:
        full, kept_rows = torch.cat([keys, values], -1), torch.cat([new_keys, new_values], -1)
    full = full.detach().to(torch.float32)
    kept_rows = kept_rows.detach().to(torch.float32)
    kept = torch.empty(new_keys.shape[:3], dtype=torch.int64)
    for bi in range(keys.shape[0]):
        for hi in range(keys.shape[1]):
            rows: dict[bytes, list[int]] = {}
            for i, row in enumerate(full[bi, hi].numpy()):
                rows.setdefault(row.tobytes(), []).append(i)
            found = [rows.get(row.tobytes(), []) for row in kept_rows[bi, hi].numpy()]
            assert all(len(f) == 1 for f in found), "a kept row matches no (or several) cached positions"
            kept[bi, hi] = torch.tensor([f[0] for f in found], dtype=torch.int64)
    return kept.sort(-1).values.contiguous() if sort else kept.contiguous()


def kept_mask(kept: torch.Tensor, length: int) -> torch.Tensor:
    """bool [..., length]: True at the kept positions [..., n]."""
    mask = torch.zeros(*kept.shape[:-1], length, dtype=torch.bool)
    return mask.scatter_(-1, kept, True).contiguous()


# ---------------------------------------------------------------------------------------------
# Presses from the C++ registry's parameter syntax
# ---------------------------------------------------------------------------------------------
def parse_value(text: str):
    """A parameter's text as kvpress takes it: True/true -> bool, int, float, else the text."""
    if text in ("True", "False", "true", "false"):
        return text in ("True", "true")
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


# Where a press's artifact files named by relative paths are (QFilterPress's q_filters,
# ExpectedAttentionStatsPress's stats_folder): the generators set it to their output folder; the
# C++ tests resolve those paths (the registry's "path" parameters) against the fixture folder.
ARTIFACT_DIR = Path(".")
ARTIFACT_PARAMS = ("q_filters", "stats_folder", "kvzap_model", "budget_curves", "attention_pattern", "restore")


# RestoreKVPress's artifacts: what kvpress downloads from higokri/RestoreKV-<model>[_plus].
RESTORE_TOKENS = 8


def restore_lora_targets() -> list[str]:
    """The projections a restore adapter covers: scripts/make_artifact.py's list (one place)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_artifact  # noqa: E402 (scripts/ is not a package)
    return make_artifact.RESTORE_LORA_TARGETS


def make_restore_artifacts(base, folder: Path, seed: int, lora_extras: dict | None = None) -> None:
    """RestoreKVPress's artifacts for `base` (a model it may wrap), random and seeded, in the authors'
    folder layout: RESTORE_TOKENS restore embeddings (embedding rows of random tokens plus noise) in
    restore_embeddings.safetensors, and a PEFT LoRA adapter of rank 4 on every projection with random
    A and B (adapter_config.json, adapter_model.safetensors). lora_extras: more LoraConfig fields."""
    from peft import LoraConfig, get_peft_model
    g = torch.Generator().manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", target_modules=restore_lora_targets(),
                        **(lora_extras or {}))
    adapted = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_A" in name or "lora_B" in name:  # peft starts B at zero: no effect; make both matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    adapted.save_pretrained(str(folder))
    table = base.get_input_embeddings().weight.detach()
    rows = table[torch.randint(0, table.shape[0], (RESTORE_TOKENS,), generator=g)]
    noise = torch.randn(rows.shape, generator=g) * table.std()
    save_file({"restore_embeddings": (rows + noise).contiguous()}, str(folder / "restore_embeddings.safetensors"))


def use_local_restore(press: kvpress.RestoreKVPress, folder: Path) -> None:
    """kvpress's post_init_from_model, reading the local folder instead of the hub."""
    def post_init_from_model(model):
        if press.restore_model_name == str(folder):
            return
        press.restore_embeddings = load_file(str(folder / "restore_embeddings.safetensors"))["restore_embeddings"].to(
            model.device, dtype=model.dtype)
        # kvpress loads each adapter name once; another folder under the same name replaces it.
        loaded = model.__dict__.setdefault("_restore_folders", {})
        if loaded.get(press.adapter_name) != str(folder):
            if press.adapter_name in getattr(model, "peft_config", {}):
                model.delete_adapter(press.adapter_name)
            model.load_adapter(str(folder), adapter_name=press.adapter_name)
            loaded[press.adapter_name] = str(folder)
        model.disable_adapters()
        press.restore_model_name = str(folder)
    press.post_init_from_model = post_init_from_model


def build_press(name: str, params: dict[str, str], ratio: float | None):
    """A kvpress press from the C++ registry's parameter syntax: a wrapper names its inner press
    with "press" (its parameters "press.<param>"), ComposedPress its presses with "presses" = "A,B"
    ("presses.<i>.<param>"); PerLayerCompressionPress takes "compression_ratios" = "r0,r1,..."
    (ratio unused). The inner presses get `ratio`."""
    if name == "LUKVPress":  # kvpress downloads its curve by model name; ours comes from the file
        params = dict(params)
        # kvpress gets the .npy the file was converted from (LU-KV's published format, what it downloads).
        curves = np.load(ARTIFACT_DIR / Path(params.pop("budget_curves")).with_suffix(".npy"), allow_pickle=False)
        kwargs = {k: parse_value(v) for k, v in params.items() if k != "press" and not k.startswith("press.")}
        if "press" in params:  # the inner press scores only: kvpress's default ratio 0
            sub = {k[len("press."):]: v for k, v in params.items() if k.startswith("press.")}
            kwargs["press"] = build_press(params["press"], sub, 0.0)
        press = kvpress.LUKVPress(compression_ratio=ratio, **kwargs)
        press._budget_curves = curves  # what post_init_from_model would download
        return press
    if name == "DuoAttentionPress":  # kvpress downloads its pattern by model name; ours is the folder
        params = dict(params)
        folder = ARTIFACT_DIR / params.pop("attention_pattern")
        config = json.loads((folder / "config.json").read_text())
        scores = np.clip(np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t", ndmin=2), 0, 1)
        press = kvpress.DuoAttentionPress(**{k: parse_value(v) for k, v in params.items()})
        # What load_attention_pattern would download (post_init_from_model then makes the mask).
        press.load_attention_pattern = lambda model: (config["sink_size"], config["recent_size"], scores)
        return press
    if name == "RestoreKVPress":  # kvpress downloads its artifacts by model name; ours are the folder
        params = dict(params)
        folder = ARTIFACT_DIR / params.pop("restore")
        press = kvpress.RestoreKVPress(compression_ratio=ratio, **{k: parse_value(v) for k, v in params.items()})
        use_local_restore(press, folder)
        return press
    if "presses" in params:
        inner = []
        for i, sub in enumerate(params["presses"].split(",")):
            prefix = f"presses.{i}."
            inner.append(build_press(sub, {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)},
                                     ratio))
        return getattr(kvpress, name)(presses=inner)
    if "press" in params:
        sub_params = {k[len("press."):]: v for k, v in params.items() if k.startswith("press.")}
        rest = {k: v for k, v in params.items() if k != "press" and not k.startswith("press.")}
        if name == "PerLayerCompressionPress":
            ratios = [float(x) for x in rest.pop("compression_ratios").split(",")]
            return kvpress.PerLayerCompressionPress(press=build_press(params["press"], sub_params, 0.0),
                                                    compression_ratios=ratios)
        inner = build_press(params["press"], sub_params, ratio)
        return getattr(kvpress, name)(press=inner, **{k: parse_value(v) for k, v in rest.items()})
    params = {k: str(ARTIFACT_DIR / v) if k in ARTIFACT_PARAMS else v for k, v in params.items()}
    if name == "QFilterPress":  # kvpress downloads its filters by model name; ours come from the file
        filters = load_file(params["q_filters"])["q_filters"]
        press = kvpress.QFilterPress(compression_ratio=ratio)
        press.q_filters = filters
        press.load_q_filters = lambda model_name: filters  # what post_init_from_model would download
        return press
    if name == "KVzapPress":  # kvpress downloads nvidia/KVzap-<type>-<model>; ours comes from the folder
        from kvpress.presses.kvzap_press import KVzapModel
        press = kvpress.KVzapPress(compression_ratio=ratio, model_type=params.get("model_type", "mlp"))
        with contextlib.redirect_stdout(io.StringIO()):
            press.kvzap_model = KVzapModel.from_pretrained(params["kvzap_model"])
        press.post_init_from_model = lambda model: None  # what would download it
        return press
    if name == "ThinKPress":  # its ratio is the fraction of key channels (kvpress-cpp's registry too)
        return kvpress.ThinKPress(key_channel_compression_ratio=ratio, **{k: parse_value(v) for k, v in params.items()})
    kwargs = {k: parse_value(v) for k, v in params.items()}
    if name not in NO_RATIO:
        kwargs["compression_ratio"] = ratio
    return getattr(kvpress, name)(**kwargs)


# kvpress presses built without a compression ratio (SimLayerKVPress: each layer decides; its
# compression_ratio is computed after a forward pass). kvpress-cpp's registry builds them with 0.
NO_RATIO = ("SimLayerKVPress", "DuoAttentionPress")


def registry_ratio(name: str, ratio: float) -> float:
    """The ratio kvpress-cpp's registry builds `name` with: `ratio`, or 0 for a press without one."""
    return 0.0 if name in NO_RATIO else ratio


def write_random_kvzap(folder: Path, hidden_size: int, kv_heads: int, num_layers: int, hidden_dim: int | None):
    """kvpress's KVzapModel (linear, or an MLP with hidden_dim) with seeded random weights, saved
    as kvpress saves it."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    torch.manual_seed(4321)
    config = KVzapConfig(input_dim=hidden_size, output_dim=kv_heads, n_modules=num_layers, hidden_dim=hidden_dim)
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
        KVzapModel(config).save_pretrained(str(folder))


def split_seed(name: str, params: dict[str, str]) -> tuple[dict[str, str], int | None]:
    """"seed" on a press whose kvpress class has no seed field (LeverageScorePress, CompactorPress:
    their sketch comes from torch's global generator) is a C++-only parameter: returns the params
    without it and the seed, with which the generator reseeds the global CPU generator right before
    each score()/compress(), as the C++ press does with a fresh generator. Otherwise (params, None)."""
    fields = {f.name for f in dataclasses.fields(getattr(kvpress, name))}
    if "seed" not in params or "seed" in fields:
        return dict(params), None
    return {k: v for k, v in params.items() if k != "seed"}, int(params["seed"])


# ---------------------------------------------------------------------------------------------
# After the prefill: kvpress's pipeline and kvpress-cli eval's protocol
# ---------------------------------------------------------------------------------------------
def pipeline_context_length(press, cache, context_length: int) -> int:
    """The position kvpress's pipeline (KVPressTextGenerationPipeline._forward) gives the question
    after a prefill of context_length tokens with `press`: the compressed length
    (cache.get_seq_length()) after a press that re-rotates the kept keys to 0..n_kept-1
    (KeyRerotationPress, FinchPress with rerotate_keys) or RestoreKVPress, else context_length."""
    if (isinstance(press, (kvpress.KeyRerotationPress, kvpress.RestoreKVPress))
            or (isinstance(press, kvpress.FinchPress) and press.rerotate_keys)):
        return cache.get_seq_length()
    return context_length


def greedy_steps(model, cache, first: torch.Tensor, start: int, steps: int):
    """One token per forward at positions start, start+1, ...: `first`, then greedy tokens.
    Returns the tokens fed [steps] int64 and their logits [steps, V]."""
    fed, logits = [], []
    token = first
    for i in range(steps):
        fed.append(token)
        out = model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[start + i]]))
        logits.append(out.logits[0, -1])
        token = out.logits[0, -1].argmax()
    return torch.stack(fed).to(torch.int64), torch.stack(logits).contiguous()


def question_then_greedy(model, cache, question: torch.Tensor, start: int, new_tokens: int):
    """kvpress's generate_answer: the question [1, q] in one forward at positions start.., then
    greedy tokens one per forward. Returns the tokens fed after the question [new_tokens - 1] and the
    logits [new_tokens, V] (the question's last position, then every greedy step)."""
    position_ids = torch.arange(start, start + question.shape[1]).unsqueeze(0)
    out = model(input_ids=question, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
    logits, fed = [out.logits[0, -1]], []
    position = start + question.shape[1]
    for _ in range(new_tokens - 1):
        token = logits[-1].argmax()
        fed.append(token)
        out = model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=torch.tensor([[position]]))
        logits.append(out.logits[0, -1])
        position += 1
    return torch.stack(fed).to(torch.int64), torch.stack(logits).contiguous()


def decode_tail(model, cache, question: torch.Tensor, start: int, steps: int, one_by_one: bool = False):
    """kvpress's generate_answer with teacher-forced bookkeeping: the question [1, q] at positions
    start.., then `steps` greedy tokens one at a time. one_by_one feeds the question one token per
    forward (the same as one causal forward; transformers cannot mask a multi-token forward over
    layers of different lengths). Returns the question logits [q, V], the tokens fed during
    decoding [steps] and their logits [steps, V]."""
    q = question.shape[1]
    if one_by_one:
        question_logits = torch.stack([
            model(input_ids=question[:, i:i + 1], past_key_values=cache,
                  position_ids=torch.tensor([[start + i]])).logits[0, -1] for i in range(q)])
    else:
        position_ids = torch.arange(start, start + q).unsqueeze(0)
        question_logits = model(input_ids=question, past_key_values=cache, position_ids=position_ids).logits[0]
    fed, logits = greedy_steps(model, cache, question_logits[-1].argmax(), start + q, steps)
    return question_logits.contiguous(), fed, logits


def eval_prefix(n: int) -> int:
    """kvpress-cli eval's prefix length for a story of n tokens."""
    return int(math.floor(EVAL_PREFIX_FRACTION * n))


def continuation_nll(logits: torch.Tensor, ids: torch.Tensor, prefix: int) -> float:
    """Mean NLL of ids[0, prefix+1:] under logits [n - 1 - prefix, V] (float32) of the positions
    prefix..n-2, as kvpress-cli eval computes it (kvpress::llama::score_continuation)."""
    targets = ids[0, prefix + 1:]
    return -logits.log_softmax(-1).gather(1, targets[:, None]).mean().item()
