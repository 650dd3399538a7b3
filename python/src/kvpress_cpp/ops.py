"""kvpress-cpp's ops (torch.ops.kvpress.*) with type hints and docstrings.

Shapes: B batch, Hq query heads, Hkv KV heads, S cached tokens, D head dim. K/V may be float32,
float16 or bfloat16; scores are float32 [B, Hkv, S], higher = keep. Bad input raises RuntimeError
("<op>: <argument> must be <expected>, got <actual>"). The C++ declarations (include/kvpress/ops.h)
are the reference; tests/python/test_package.py checks that every registered op has a wrapper here.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

_ops = torch.ops.kvpress


def _schema_default(op: str, argument: str):
    """The default an op's schema declares: its family (src/ops/<family>/<family>.cpp) writes it
    from the C++ constant, so it is stated once (e.g. ops::kDefaultSketchDimension in
    kvpress/ops.h)."""
    for a in getattr(_ops, op).default._schema.arguments:
        if a.name == argument and a.default_value is not None:
            return a.default_value
    raise RuntimeError(f"kvpress_cpp: torch.ops.kvpress.{op} declares no default for {argument}")


_UNSEEDED = _schema_default("random_scores", "seed")  # ops::kUnseeded: the default CPU generator

# ---- selection -------------------------------------------------------------------------------


def n_kept(seq_len: int, compression_ratio: float) -> int:
    """kvpress's compute_n_kept: max(1, int(seq_len * (1 - compression_ratio)))."""
    return _ops.n_kept(seq_len, compression_ratio)


def topk_indices(scores: Tensor, k: int) -> Tensor:
    """Positions of the k highest scores per row, ascending; ties go to the lower position.
    scores [B, H, S] -> [B, H, k] int64. Raises on NaN or infinite scores."""
    return _ops.topk_indices(scores, k)


def gather_kv(keys: Tensor, values: Tensor, indices: Tensor) -> Tuple[Tensor, Tensor]:
    """keys/values [B, Hkv, S, D] at indices [B, Hkv, n] -> contiguous [B, Hkv, n, D] each."""
    return _ops.gather_kv(keys, values, indices)


def compact_kv_(keys: Tensor, values: Tensor, indices: Tensor) -> None:
    """In place: row i of each head becomes its row indices[..., i] (strictly ascending per head);
    rows n.. are left unspecified. keys/values [B, Hkv, S, D], indices [B, Hkv, n] int64."""
    _ops.compact_kv_(keys, values, indices)


def topk_mask_across_heads(scores: Tensor, n_total: int) -> Tensor:
    """The n_total highest scores over all (head, position) pairs of each batch row, as a mask.
    scores [B, H, S] -> [B, H, S] bool (heads may keep different numbers of tokens)."""
    return _ops.topk_mask_across_heads(scores, n_total)


# ---- RoPE and heads --------------------------------------------------------------------------


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] along the last dim (HF's rotate_half)."""
    return _ops.rotate_half(x)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin. x [B, H, n, D], cos/sin [n, D]."""
    return _ops.apply_rope(x, cos, sin)


def invert_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The exact inverse of apply_rope (pre-RoPE keys from cached ones). x [B, H, n, D], cos/sin [n, D]."""
    return _ops.invert_rope(x, cos, sin)


def group_mean(per_query_head: Tensor, num_kv_heads: int) -> Tensor:
    """Mean over each group of Hq / num_kv_heads consecutive query heads: [B, Hq, ...] -> [B, Hkv, ...]."""
    return _ops.group_mean(per_query_head, num_kv_heads)


def window_attention(queries: Tensor, keys: Tensor) -> Tensor:
    """Causal softmax attention of the last w positions over the first S - w keys (float32 softmax,
    GQA without repeated keys). queries [B, Hq, w, D] post-RoPE, keys [B, Hkv, S, D] -> [B, Hq, w, S - w]."""
    return _ops.window_attention(queries, keys)


def window_attention_mean(queries: Tensor, keys: Tensor) -> Tensor:
    """window_attention(queries, keys).mean(2), fused (never the [B, Hq, w, S] tensor) -> [B, Hq, S - w]."""
    return _ops.window_attention_mean(queries, keys)


# ---- scores ----------------------------------------------------------------------------------


def key_norm_scores(keys: Tensor) -> Tensor:
    """KnormPress: -||k_i||_2. keys [B, Hkv, S, D] -> [B, Hkv, S] float32."""
    return _ops.key_norm_scores(keys)


def keydiff_scores(keys: Tensor) -> Tensor:
    """KeyDiffPress: -cos(k_i, anchor), anchor the mean of the head's L2-normalised keys -> [B, Hkv, S]."""
    return _ops.keydiff_scores(keys)


def rescue_column_max(logits: Tensor, scale: float) -> Tensor:
    """CTRPress's rescue: max over rows of logits / scale minus each row's log-sum-exp. [n, R] -> [R]."""
    return _ops.rescue_column_max(logits, scale)


def max_similarity(rows: Tensor, candidates: Tensor) -> Tuple[Tensor, Tensor]:
    """MergingPress's nearest kept key: each row's largest dot product with a candidate of its head
    and the first candidate reaching it. rows [B, H, n, D], candidates [B, H, m, D] float32
    -> (values [B, H, n] float32, indices [B, H, n] int64)."""
    return _ops.max_similarity(rows, candidates)


def output_projected_l1_norms(values: Tensor, o_proj: Tensor, num_heads: int) -> Tensor:
    """CriticalKVPress's ||v W_o^h||_1 per token, averaged over each KV head's query heads -> [B, Hkv, S]."""
    return _ops.output_projected_l1_norms(values, o_proj, num_heads)


def streaming_llm_scores(keys: Tensor, n_sink: int, compression_ratio: float) -> Tensor:
    """StreamingLLMPress: 1 everywhere but 0 on [n_sink, n_sink + n_pruned) -> [B, Hkv, S]."""
    return _ops.streaming_llm_scores(keys, n_sink, compression_ratio)


def random_scores(keys: Tensor, seed: int = _UNSEEDED) -> Tensor:
    """RandomPress: uniform [0, 1) scores, equal to torch.rand(..., generator=manual_seed(seed),
    dtype=keys.dtype) for seed >= 0 -> [B, Hkv, S]."""
    return _ops.random_scores(keys, seed)


def lagkv_scores(keys: Tensor, values: Tensor, n_sink: int, lag_size: int, cross_scoring: bool) -> Tensor:
    """LagKVPress: lag-relative statistics of keys and values [B, Hkv, S, D] -> [B, Hkv, S]."""
    return _ops.lagkv_scores(keys, values, n_sink, lag_size, cross_scoring)


def lagkv_partition_scores(keys: Tensor, values: Tensor, n_sink: int, lag_size: int, cross_scoring: bool) -> Tensor:
    """LagKV's per-partition scores before the sink/tail handling of lagkv_scores (the fused kernel)."""
    return _ops.lagkv_partition_scores(keys, values, n_sink, lag_size, cross_scoring)


def snapkv_scores(window_attn: Tensor, num_kv_heads: int, kernel_size: int) -> Tensor:
    """SnapKVPress from its window attention [B, Hq, w, S - w]: window mean, avg-pool, group mean; the
    window's own positions get max + 1 -> [B, Hkv, S]."""
    return _ops.snapkv_scores(window_attn, num_kv_heads, kernel_size)


def snapkv_scores_from_mean(mean_attn: Tensor, num_kv_heads: int, kernel_size: int, window_size: int) -> Tensor:
    """snapkv_scores from the window attention already averaged over its queries [B, Hq, S - w]."""
    return _ops.snapkv_scores_from_mean(mean_attn, num_kv_heads, kernel_size, window_size)


def tova_scores(last_attn: Tensor, num_kv_heads: int) -> Tensor:
    """TOVAPress: the last query's attention [B, Hq, 1, S - 1] averaged over all query heads; the last
    position gets max + 1 -> [B, Hkv, S]."""
    return _ops.tova_scores(last_attn, num_kv_heads)


def observed_attention_scores(attentions: Tensor, num_kv_heads: int) -> Tensor:
    """ObservedAttentionPress: attention received by each key [B, Hq, S, S], over the queries that see
    it, then group mean -> [B, Hkv, S]."""
    return _ops.observed_attention_scores(attentions, num_kv_heads)


# ---- Compactor: leverage, non-causal attention, z-scores -------------------------------------


def zscore(scores: Tensor) -> Tensor:
    """(x - mean) / max(std, 1e-6) with one mean and one unbiased std over the whole tensor, float32."""
    return _ops.zscore(scores)


def blend_scores(scores: Sequence[Tensor], weights: Sequence[float], normalize: bool = True) -> Tensor:
    """sum_i weights[i] * s_i, each z-scored first when normalize (CompactorPress's blend)."""
    return _ops.blend_scores(list(scores), list(weights), normalize)


def gaussian_sketch(batch: int, heads: int, head_dim: int, sketch_dimension: int, dtype: torch.dtype,
                    device: Union[torch.device, str], seed: int = _UNSEEDED) -> Tensor:
    """LeverageScorePress's sketch randn(B, H, D, k) / sqrt(k), drawn in dtype on a CPU generator
    (seed >= 0: a fresh one), returned as float32 on device."""
    return _ops.gaussian_sketch(batch, heads, head_dim, sketch_dimension, dtype, torch.device(device), seed)


def sketch_keys(prerope_keys: Tensor, sketch: Tensor) -> Tensor:
    """X = (K - mean_S K) sketch, float32. prerope_keys [B, Hkv, S, D], sketch [B, Hkv, D, k] or [D, k]."""
    return _ops.sketch_keys(prerope_keys, sketch)


def sketch_prerope_keys(keys: Tensor, cos: Tensor, sin: Tensor, sketch: Tensor) -> Tuple[Tensor, Tensor]:
    """LeverageScorePress's sketch of a post-RoPE cache: X = sketch_keys(invert_rope(keys, cos, sin),
    sketch) and its Gram X^T X. keys [B, Hkv, S, D], cos/sin [S, D], sketch [B, Hkv, D, k] or [D, k]
    -> (X [B, Hkv, S, k], X^T X [B, Hkv, k, k]), float32."""
    return _ops.sketch_prerope_keys(keys, cos, sin, sketch)


def cholesky_leverage(sketched: Tensor, factor: Tensor) -> Tensor:
    """||L^-1 x_i||^2 for the rows of X [B, Hkv, S, k] given the lower Cholesky factor L [B, Hkv, k, k]
    of the regularised Gram matrix -> [B, Hkv, S] float32."""
    return _ops.cholesky_leverage(sketched, factor)


def ridge_leverage(sketched: Tensor) -> Tensor:
    """Ridge leverage x_i^T (X^T X + lambda I)^-1 x_i of the rows of X [B, Hkv, S, k] -> [B, Hkv, S]."""
    return _ops.ridge_leverage(sketched)


def sketched_leverage(prerope_keys: Tensor, sketch: Tensor) -> Tensor:
    """ridge_leverage(sketch_keys(prerope_keys, sketch)) -> [B, Hkv, S]."""
    return _ops.sketched_leverage(prerope_keys, sketch)


def leverage_scores(prerope_keys: Tensor,
                    sketch_dimension: int = _schema_default("leverage_scores", "sketch_dimension"),
                    seed: int = _UNSEEDED) -> Tensor:
    """LeverageScorePress's raw scores (sketch drawn in the keys' dtype), not z-scored -> [B, Hkv, S]."""
    return _ops.leverage_scores(prerope_keys, sketch_dimension, seed)


def noncausal_column_sums(queries: Tensor, keys: Tensor,
                          chunk_size: int = _schema_default("noncausal_column_sums", "chunk_size")) -> Tensor:
    """Non-causal attention within chunks of chunk_size positions, summed over each chunk's queries
    (no 1/sqrt(D), kvpress's padding). queries [B, Hq, S, D], keys [B, Hkv, S, D] -> [B, Hq, S]."""
    return _ops.noncausal_column_sums(queries, keys, chunk_size)


def noncausal_attention_scores(column_sums: Tensor, values: Tensor) -> Tensor:
    """NonCausalAttnPress's scores: group mean x ||v_i||, avg-pool 3, z-score -> [B, Hkv, S]."""
    return _ops.noncausal_attention_scores(column_sums, values)


# ---- attention over compressed caches --------------------------------------------------------


def ragged_attention(queries: Tensor, packed_keys: Tensor, packed_values: Tensor, offsets: Tensor,
                     tail_keys: Tensor, tail_values: Tensor, scale: Optional[float] = None) -> Tensor:
    """Causal attention of n new tokens over a head-ragged layer: KV head bh holds packed rows
    [offsets[bh], offsets[bh + 1]) of packed_keys/values [T, D], then tail [B, Hkv, m, D].
    queries [B, Hq, n, D] -> [B, Hq, n, D]; scale defaults to 1 / sqrt(D)."""
    return _ops.ragged_attention(queries, packed_keys, packed_values, offsets, tail_keys, tail_values, scale)


def paged_attention(queries: Tensor, key_pool: Tensor, value_pool: Tensor, page_table: Tensor, lengths: Tensor,
                    scale: Optional[float] = None) -> Tensor:
    """Causal attention of n new tokens over per-head page lists: token t of head (b, h) is row
    t % page_size of page page_table[b, h, t // page_size]. pools [pages, page_size, D],
    page_table [B, Hkv, max_pages], lengths [B, Hkv] int64, queries [B, Hq, n, D] -> [B, Hq, n, D]."""
    return _ops.paged_attention(queries, key_pool, value_pool, page_table, lengths, scale)


def paged_write(key_pool: Tensor, value_pool: Tensor, keys: Tensor, values: Tensor, slots: Tensor) -> None:
    """In place: row r of keys/values [N, D] into slot slots[r] = page * page_size + row of the pools.
    Slots must be in range and distinct (RuntimeError otherwise)."""
    _ops.paged_write(key_pool, value_pool, keys, values, slots)


def paged_attention_quantized(queries: Tensor, key_codes: Tensor, key_scales: Tensor, value_codes: Tensor,
                              value_scales: Tensor, format: str, page_table: Tensor, lengths: Tensor,
                              residual_keys: Tensor, residual_values: Tensor, residual_slots: Tensor,
                              scale: Optional[float] = None) -> Tensor:
    """paged_attention over quantized pages (format "int8", "fp8" or "int4", kv_quantize's codes and
    scales): head (b, h) of length L holds its first L // page_size pages in the page table and its
    last L % page_size tokens at residual_keys/values[residual_slots[b], h] ([R, Hkv, page_size, D],
    the queries' dtype). Rows are dequantized inside the kernel."""
    return _ops.paged_attention_quantized(queries, key_codes, key_scales, value_codes, value_scales, format,
                                          page_table, lengths, residual_keys, residual_values, residual_slots, scale)


def kv_quantize(rows: Tensor, format: str, keys: bool) -> Tuple[Tensor, Tensor]:
    """Full pages [P, page_size, D] -> (codes [P, page_size, code_bytes] uint8, scales): int8 and fp8
    e4m3 with one float32 scale per page, int4 with KIVI's split (keys per channel, values per token;
    float16 scales and minima)."""
    return _ops.kv_quantize(rows, format, keys)


def kv_dequantize(codes: Tensor, scales: Tensor, format: str, keys: bool, head_dim: int) -> Tensor:
    """kv_quantize's pages read back as float32 [P, page_size, D]."""
    return _ops.kv_dequantize(codes, scales, format, keys, head_dim)


# ---- any press of the registry on one layer --------------------------------------------------

Params = Union[Mapping[str, object], Sequence[str], None]


def params_list(params: Params) -> list:
    """Press parameters as the ops take them: ["window_size=32", ...]. A mapping's values are written
    as text (True -> "true", None -> "None")."""
    if params is None:
        return []
    if isinstance(params, Mapping):
        return [f"{key}={_param_text(value)}" for key, value in params.items()]
    return [str(p) for p in params]


def _param_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "None" if value is None else str(value)


def press_compress(name: str, compression_ratio: float, params: Params, keys: Tensor, values: Tensor,
                   **inputs: Union[Tensor, int, float, None]) -> Tuple[Tensor, Tensor, Tensor]:
    """Compresses one layer with the press `name` (kvpress's class name) and its parameters.
    keys/values [B, Hkv, S, D]; inputs: any LayerInputs field by name (queries, hidden_states,
    q_proj, cos, sin, attentions, num_heads, ...; registry_json()["layer_inputs"] lists them).
    -> (keys [B, Hkv, n, D], values, kept positions [B, Hkv, n] ascending)."""
    return _ops.press_compress(name, compression_ratio, params_list(params), keys, values, **inputs)


def press_compress_ragged(name: str, compression_ratio: float, params: Params, keys: Tensor, values: Tensor,
                          **inputs: Union[Tensor, int, float, None]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """press_compress for presses whose heads keep different numbers of tokens (any press works):
    -> (keys [T, D], values [T, D], positions [T], lengths [B, Hkv]), heads packed one after another."""
    return _ops.press_compress_ragged(name, compression_ratio, params_list(params), keys, values, **inputs)


def press_scores(name: str, compression_ratio: float, params: Params, keys: Tensor, values: Tensor,
                 **inputs: Union[Tensor, int, float, None]) -> Tensor:
    """The scores [B, Hkv, S] of a ScorerPress (kind "scorer" in registry_json()) on one layer."""
    return _ops.press_scores(name, compression_ratio, params_list(params), keys, values, **inputs)


def cpu_kernel_isa() -> str:
    """What the CPU kernels' hot loops run in this process: the register tiles' ISA ("avx512",
    "avx2" or "baseline"), then "+<isa>-clones" when the other loops' clones run another one (e.g.
    "avx2+avx512-clones" under KVPRESS_DISABLE_AVX512=1 on an AVX-512 CPU)."""
    return _ops.cpu_kernel_isa()


def registry_json() -> str:
    """Every press (name, kind, summary, inputs, parameters with types and defaults) and every
    LayerInputs field, as JSON text (kvpress-cli list --json prints the same)."""
    return _ops.registry_json()
