"""The ops are callable from Python as torch.ops.kvpress.* after loading libkvpress.so.

Usage: python test_torch_ops.py /path/to/libkvpress.so
"""
import sys

import torch

torch.ops.load_library(sys.argv[1])
ops = torch.ops.kvpress
failures = []
passed = 0


def check(name, ok):
    global passed
    print(("ok   " if ok else "FAIL ") + name)
    if not ok:
        failures.append(name)
    else:
        passed += 1


torch.manual_seed(0)
keys = torch.randn(1, 2, 40, 16)
values = torch.randn(1, 2, 40, 16)

check("key_norm_scores", torch.allclose(ops.key_norm_scores(keys), -keys.norm(dim=-1), rtol=1e-6, atol=1e-6))
check("key_norm_scores bfloat16", ops.key_norm_scores(keys.bfloat16()).dtype == torch.float32)
check("n_kept", ops.n_kept(1000, 0.9) == max(1, int(1000 * (1 - 0.9))))

scores = torch.tensor([[[1.0, 0.0, 1.0, 1.0, 0.0, 1.0]]])
check("topk_indices ties to lower position", ops.topk_indices(scores, 2).tolist() == [[[0, 2]]])

kept = ops.topk_indices(ops.key_norm_scores(keys), 10)
k, v = ops.gather_kv(keys, values, kept)
check("gather_kv", torch.equal(k, keys.gather(2, kept[..., None].expand(-1, -1, -1, 16))))

seeded = ops.random_scores(keys, 42)
generator = torch.Generator().manual_seed(42)
check("random_scores equals torch.rand", torch.equal(seeded, torch.rand(1, 2, 40, generator=generator)))

# Head-ragged attention: head 0 keeps positions 0..9, head 1 keeps 20..39, then one new token
# (the tail) attends; equals softmax attention over the kept positions and itself.
packed_k = torch.cat([keys[0, 0, :10], keys[0, 1, 20:]])
packed_v = torch.cat([values[0, 0, :10], values[0, 1, 20:]])
offsets = torch.tensor([0, 10, 30])
tail_k, tail_v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
q = torch.randn(1, 4, 1, 16)
out = ops.ragged_attention(q, packed_k, packed_v, offsets, tail_k, tail_v)
ref = []
for qh in range(4):
    h = qh // 2
    kk = torch.cat([packed_k[offsets[h]:offsets[h + 1]], tail_k[0, h]])
    vv = torch.cat([packed_v[offsets[h]:offsets[h + 1]], tail_v[0, h]])
    ref.append(torch.softmax(q[0, qh] @ kk.T / 4.0, -1) @ vv)
check("ragged_attention", torch.allclose(out[0, :, 0], torch.cat(ref), rtol=1e-5, atol=1e-5))

try:
    ops.key_norm_scores(torch.randn(2, 8, 64))
    check("error message", False)
except RuntimeError as error:
    check("error message", "keys must be [batch, kv_heads, seq_len, head_dim], got [2, 8, 64]" in str(error))

# Compactor ops against kvpress's own functions (the project venv holds kvpress: a missing one is a
# failure of the set-up, not a reason to check less).
from kvpress.presses.leverage_press import LeverageScorePress
from kvpress.presses.non_causal_attention_press import NonCausalAttnPress

z = ops.zscore(values.norm(dim=-1))
check("zscore", torch.allclose(z, (values.norm(dim=-1) - values.norm(dim=-1).mean()) / values.norm(dim=-1).std()))
queries = torch.randn(1, 4, 40, 16)
sums = ops.noncausal_column_sums(queries, keys, 16)
check("noncausal_column_sums shape", sums.shape == (1, 4, 40) and sums.dtype == torch.float32)
lev = ops.leverage_scores(keys, 48, 5)
torch.manual_seed(5)
ref = LeverageScorePress.compute_leverage_scores(keys, 48)
check("leverage_scores equals kvpress after torch.manual_seed", torch.allclose(lev, ref, rtol=1e-4, atol=1e-6))
ref = NonCausalAttnPress.non_causal_chunked_attn(queries, keys.repeat_interleave(2, dim=1), 16)
check("noncausal_column_sums equals kvpress (padded last chunk)", torch.allclose(sums, ref, rtol=1e-5, atol=1e-6))

# Registry presses through press_compress / press_scores (benchmarks/compare_kvpress.py).
pk, pv, pidx = ops.press_compress("KnormPress", 0.75, [], keys, values)
check("press_compress KnormPress", torch.equal(pidx, kept) and torch.equal(pk, k) and torch.equal(pv, v))
check("press_scores KnormPress", torch.equal(ops.press_scores("KnormPress", 0.75, [], keys, values), ops.key_norm_scores(keys)))
sk, _, sidx = ops.press_compress("StreamingLLMPress", 0.5, ["n_sink=2"], keys, values)
check("press_compress params", sidx[0, 0].tolist() == [0, 1] + list(range(22, 40)) and sk.shape == (1, 2, 20, 16))
snap_q = torch.randn(1, 4, 8, 16)
snap = ops.press_compress("SnapKVPress", 0.5, ["window_size=8"], keys, values, queries=snap_q, num_heads=4)
check("press_compress SnapKVPress keeps the window", set(range(32, 40)) <= set(snap[2][0, 0].tolist()))
try:
    ops.press_compress("KnormPress", 0.5, ["window_size"], keys, values)
    check("press_compress bad param", False)
except RuntimeError as error:
    check("press_compress bad param", 'params must be ["key=value", ...], got "window_size"' in str(error))

# Quantized pages: one full int8 page and 3 residual tokens per head; the kernel equals paged_attention over
# the dequantized page followed by the residual rows.
pages = torch.randn(2, 4, 16)  # head h's full page is page h
kc, ks = ops.kv_quantize(pages, "int8", True)
vc, vs = ops.kv_quantize(pages.flip(1), "int8", False)
check("kv_quantize int8", kc.dtype == torch.uint8 and ks.shape == (2, 1))
rk, rv = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
table = torch.tensor([[[0], [1]]])
qlen = torch.tensor([[7, 7]])
q8 = torch.randn(1, 4, 1, 16)
got = ops.paged_attention_quantized(q8, kc, ks, vc, vs, "int8", table, qlen, rk, rv, torch.tensor([0]))
pool_k = torch.cat([ops.kv_dequantize(kc, ks, "int8", True, 16), rk[0]])
pool_v = torch.cat([ops.kv_dequantize(vc, vs, "int8", False, 16), rv[0]])
want = ops.paged_attention(q8, pool_k, pool_v, torch.tensor([[[0, 2], [1, 3]]]), qlen)
check("paged_attention_quantized", torch.allclose(got, want, rtol=1e-5, atol=1e-5))

print(f"{passed} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
