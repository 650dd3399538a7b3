#!/usr/bin/env bash
# End-to-end test of kvpress-cli (registered in ctest as cli.end_to_end):
#   bash test_cli.sh <path-to-kvpress-cli> [<fixtures-dir>]
# Makes its own small inputs with Python (torch + safetensors from the project venv: $KVPRESS_PYTHON,
# else $KVPRESS_VENV/bin/python, else ~/.cache/kvpress-cpp/venv/bin/python), runs the CLI on them,
# checks the outputs with Python's safetensors (so the C++ writer is read by the reference
# reader), and checks every error path: exit code 2 and exactly one stderr line starting with
# "kvpress-cli: error: ". From the fixtures dir it reads pipeline/pipeline.json (kvpress's pipeline
# answers, tests/reference/make_pipeline_fixtures.py) to check `ask` against kvpress.
# Exits non-zero and names each failed check.
set -uo pipefail

cli="${1:?usage: test_cli.sh <path-to-kvpress-cli> [<fixtures-dir>]}"
fixtures="${2:-}"
[ -x "$cli" ] || { echo "test_cli.sh: $cli is not an executable" >&2; exit 1; }

python="${KVPRESS_PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in "${KVPRESS_VENV:-}/bin/python" "$HOME/.cache/kvpress-cpp/venv/bin/python" python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import torch, safetensors' 2>/dev/null; then
      python="$candidate"
      break
    fi
  done
fi
[ -n "$python" ] || { echo "test_cli.sh: no Python with torch and safetensors (set KVPRESS_PYTHON)" >&2; exit 1; }

tmp="$(mktemp -d "${TMPDIR:-/tmp}/kvpress_cli_test.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
failures=0
checks=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# ---- inputs -------------------------------------------------------------------------------
# B=2, Hkv=2, Hq=4 (GQA 2), S=40, D=8, hidden=32. Random data has no ties.
"$python" - "$tmp" <<'EOF' || { echo "FAIL: could not create the inputs" >&2; exit 1; }
import math, sys
import torch
from safetensors.torch import save_file

out = sys.argv[1]
g = torch.Generator().manual_seed(0)
B, HKV, HQ, S, D, HID = 2, 2, 4, 40, 8, 32

def randn(*shape):
    return torch.randn(*shape, generator=g)

keys, values = randn(B, HKV, S, D), randn(B, HKV, S, D)
queries = randn(B, HQ, S, D)
# Causal softmax attention of every position (what eager attention returns).
k_rep = keys.repeat_interleave(HQ // HKV, dim=1)
logits = queries @ k_rep.transpose(-1, -2) / math.sqrt(D)
logits = logits.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
attentions = logits.softmax(-1)
inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
freqs = torch.outer(torch.arange(S).float(), inv_freq)
emb = torch.cat([freqs, freqs], dim=-1)
cos, sin = emb.cos(), emb.sin()
hidden_states = randn(B, S, HID)
q_proj, k_proj = randn(HQ * D, HID) / math.sqrt(HID), randn(HKV * D, HID) / math.sqrt(HID)
meta = {"num_heads": str(HQ), "layer_idx": "0", "num_layers": "2"}

def save(name, tensors, metadata=meta):
    save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out}/{name}", metadata=metadata)

save("kv.safetensors", {"keys": keys, "values": values})
save("kv_bf16.safetensors", {"keys": keys.bfloat16(), "values": values.bfloat16()})
save("queries.safetensors", {"keys": keys, "values": values, "queries": queries[:, :, -16:]})
save("hidden.safetensors", {"keys": keys, "values": values, "hidden_states": hidden_states,
                            "q_proj": q_proj, "k_proj": k_proj, "cos": cos, "sin": sin})
save("full.safetensors", {"keys": keys, "values": values, "queries": queries,
                          "attentions": attentions})
# RoPE's inverse frequencies given as such (KeyRerotationPress, ExpectedAttentionPress), instead of
# being derived from cos/sin; and a wrong shape.
save("kv_inv_freq.safetensors", {"keys": keys, "values": values, "inv_freq": inv_freq})
save("kv_cos_sin.safetensors", {"keys": keys, "values": values, "cos": cos, "sin": sin})
save("bad_inv_freq.safetensors", {"keys": keys, "values": values, "inv_freq": torch.cat([inv_freq, inv_freq])})
# Compactor: post-RoPE queries of every position and the RoPE tables (pre-RoPE keys by inverse RoPE).
save("compactor.safetensors", {"keys": keys, "values": values, "queries": queries, "cos": cos, "sin": sin})
# Broken inputs.
save("keys_3d.safetensors", {"keys": keys[0], "values": values[0]})
save("values_mismatch.safetensors", {"keys": keys, "values": values[:, :, :-1]})
save("no_keys.safetensors", {"values": values})
save("typo.safetensors", {"keys": keys, "values": values, "querys": queries})
save("bad_queries.safetensors", {"keys": keys, "values": values, "queries": queries[..., :4]})
save("bad_meta.safetensors", {"keys": keys, "values": values}, {"num_heads": "four"})
open(f"{out}/garbage.safetensors", "wb").write(b"\xff" * 64)
EOF

# ---- helpers ------------------------------------------------------------------------------
# expect_ok NAME ARGS...: exit code 0.
expect_ok() {
  local name="$1"; shift
  checks=$((checks + 1))
  local rc=0
  "$cli" "$@" >"$tmp/stdout" 2>"$tmp/stderr" || rc=$?
  if [ "$rc" -ne 0 ]; then
    fail "$name: exit code $rc, expected 0 (stderr: $(head -c 500 "$tmp/stderr"))"
    return 1
  fi
}

# expect_error NAME EXPECTED-SUBSTRING ARGS...: exit code 2, one stderr line starting with
# "kvpress-cli: error: " and containing the substring, nothing on stdout.
expect_error() {
  local name="$1" want="$2"; shift 2
  checks=$((checks + 1))
  local rc=0
  "$cli" "$@" >"$tmp/stdout" 2>"$tmp/stderr" || rc=$?
  local lines
  lines=$(wc -l <"$tmp/stderr")
  if [ "$rc" -ne 2 ]; then
    fail "$name: exit code $rc, expected 2 (stderr: $(head -c 500 "$tmp/stderr"))"
  elif [ "$lines" -ne 1 ]; then
    fail "$name: stderr has $lines lines, expected 1:"$'\n'"$(cat "$tmp/stderr")"
  elif ! grep -q '^kvpress-cli: error: ' "$tmp/stderr"; then
    fail "$name: stderr does not start with 'kvpress-cli: error: ': $(cat "$tmp/stderr")"
  elif ! grep -qF -- "$want" "$tmp/stderr"; then
    fail "$name: stderr lacks '$want': $(cat "$tmp/stderr")"
  elif [ -s "$tmp/stdout" ]; then
    fail "$name: unexpected stdout: $(head -c 200 "$tmp/stdout")"
  fi
}

# ---- help, version, list ------------------------------------------------------------------
if expect_ok "--help" --help; then
  grep -q 'kvpress-cli compress --press NAME --ratio R' "$tmp/stdout" || fail "--help: no usage line"
fi
expect_ok "compress --help" compress --help && { grep -q '^Usage:' "$tmp/stdout" || fail "compress --help: no usage"; }
if expect_ok "--version" --version; then
  grep -Eq '^kvpress-cli [0-9]+\.[0-9]+\.[0-9]+' "$tmp/stdout" || fail "--version: got '$(cat "$tmp/stdout")'"
fi

# The registry's presses, as list --names prints them; list and list --json must list the same.
presses=()
if expect_ok "list --names" list --names; then
  mapfile -t presses <"$tmp/stdout"
  [ "${#presses[@]}" -ge 44 ] || fail "list --names: only ${#presses[@]} presses (kvpress 0.5.5 alone has 44)"
fi
if expect_ok "list" list; then
  for p in "${presses[@]}"; do
    grep -q "^$p\$" "$tmp/stdout" || fail "list: $p missing"
  done
  grep -q 'window_size' "$tmp/stdout" || fail "list: SnapKVPress parameters missing"
  grep -q 'needs:' "$tmp/stdout" || fail "list: no 'needs:' lines"
fi
# list --json: the same presses, and every LayerInputs field, each documented in docs/CLI.md.
if expect_ok "list --json" list --json; then
  "$python" - "$tmp/stdout" "$(dirname "$0")/../../docs/CLI.md" "${presses[@]}" <<'PY' || fail "list --json: see above"
import json, sys
listing = json.load(open(sys.argv[1]))
doc = open(sys.argv[2]).read()
names = sorted(p["name"] for p in listing["presses"])
assert names == sorted(sys.argv[3:]), names
assert all(p["kind"] in ("scorer", "wrapper", "decoding", "second_pass", "channel", "layer", "query_aware")
           for p in listing["presses"])
missing = [f["name"] for f in listing["layer_inputs"] if f"`{f['name']}`" not in doc]
assert not missing, f"docs/CLI.md does not describe the input fields {missing}"
PY
fi

# ---- compress: successes ------------------------------------------------------------------
# Each case: output name, input name, press, ratio, extra args. Checked below in one Python run.
cases=()
run_case() {
  local out="$1" in="$2" press="$3" ratio="$4"; shift 4
  if expect_ok "compress $out" compress --press "$press" --ratio "$ratio" "$@" \
      --input "$tmp/$in" --output "$tmp/$out"; then
    grep -q "^$press: ratio .* 40 -> [0-9]* tokens per head" "$tmp/stdout" ||
      fail "compress $out: summary line: $(cat "$tmp/stdout")"
    [ "$(wc -l <"$tmp/stdout")" -eq 1 ] || fail "compress $out: summary is not one line"
    cases+=("$out $in $press $ratio")
  fi
}
run_case knorm.st kv.safetensors KnormPress 0.5
run_case knorm_bf16.st kv_bf16.safetensors KnormPress 0.3
run_case knorm_r0.st kv.safetensors KnormPress 0
run_case knorm_r099.st kv.safetensors KnormPress 0.99
run_case snapkv_queries.st queries.safetensors SnapKVPress 0.5 --param window_size=8 --param kernel_size=3
run_case snapkv_hidden.st hidden.safetensors SnapKVPress 0.25 --param=window_size=8
run_case snapkv_attn.st full.safetensors SnapKVPress 0.6 --param window_size=8
run_case tova.st full.safetensors TOVAPress 0.5
run_case observed.st full.safetensors ObservedAttentionPress 0.5
run_case streaming.st kv.safetensors StreamingLLMPress 0.5 --param n_sink=2
run_case keydiff.st kv.safetensors KeyDiffPress 0.4
run_case lagkv.st kv.safetensors LagKVPress 0.5 --param lag_size=8
run_case random.st kv.safetensors RandomPress 0.5 --param seed=3
run_case compactor.st compactor.safetensors CompactorPress 0.5 --param seed=1 --param chunk_size=16
run_case compactor_paper.st compactor.safetensors CompactorPress 0.6 --param blending=0.3 --param seed=1
run_case compactor_r09.st compactor.safetensors CompactorPress 0.9 --param seed=1
run_case noncausal.st compactor.safetensors NonCausalAttnPress 0.5 --param chunk_size=16
run_case leverage.st compactor.safetensors LeverageScorePress 0.5 --param seed=2
run_case knorm_extra.st typo.safetensors KnormPress 0.5 --allow-unknown-tensors
grep -q "warning: .*ignoring unknown tensor 'querys'" "$tmp/stderr" || fail "--allow-unknown-tensors: no warning"
# Nested presses (docs/CLI.md): a wrapper's inner press and its parameters.
expect_ok "compress ChunkKVPress(SnapKVPress)" compress --press ChunkKVPress --ratio 0.5 --param press=SnapKVPress \
  --param press.window_size=8 --param chunk_length=4 --input "$tmp/queries.safetensors" --output "$tmp/chunkkv.st" --quiet
expect_ok "compress ComposedPress" compress --press ComposedPress --ratio 0.5 --param presses=KnormPress,KeyDiffPress \
  --param presses.1.compression_ratio=0.25 --input "$tmp/kv.safetensors" --output "$tmp/composed.st" --quiet
# CTR-Press (docs/PRESS_NOTES.md): QSMPress with an explicit query (its value merge on), CTRPress.
expect_ok "compress QSMPress" compress --press QSMPress --ratio 0.5 --param sink_tokens=2 --param recent_tokens=4 \
  --param query_length=6 --input "$tmp/compactor.safetensors" --output "$tmp/qsm.st" --quiet
expect_ok "compress CTRPress" compress --press CTRPress --ratio 0.5 --param sink_tokens=2 --param entropy=reference \
  --input "$tmp/compactor.safetensors" --output "$tmp/ctr.st" --quiet
# inv_freq from the input file: KeyRerotationPress gives the keys it gives with cos/sin (from which it
# would otherwise derive the frequencies), and fails without either.
if expect_ok "compress KeyRerotationPress inv_freq" compress --press KeyRerotationPress --ratio 0.5 \
    --input "$tmp/kv_inv_freq.safetensors" --output "$tmp/rerot_inv_freq.st" --quiet &&
   expect_ok "compress KeyRerotationPress cos/sin" compress --press KeyRerotationPress --ratio 0.5 \
    --input "$tmp/kv_cos_sin.safetensors" --output "$tmp/rerot_cos_sin.st" --quiet; then
  checks=$((checks + 1))
  "$python" - "$tmp" <<'EOF' || fail "KeyRerotationPress with inv_freq differs from cos/sin"
import sys
import torch
from safetensors.torch import load_file
a = load_file(f"{sys.argv[1]}/rerot_inv_freq.st")
b = load_file(f"{sys.argv[1]}/rerot_cos_sin.st")
assert a["keys"].shape == (2, 2, 20, 8), a["keys"].shape
assert torch.equal(a["kept_indices"], b["kept_indices"]), "kept_indices differ"
assert torch.allclose(a["keys"], b["keys"], atol=1e-5), (a["keys"] - b["keys"]).abs().max()
EOF
fi
expect_error "KeyRerotationPress without inv_freq or cos/sin" "needs inv_freq" compress --press KeyRerotationPress \
  --ratio 0.5 --input "$tmp/kv.safetensors" --output "$tmp/rerot.st"
expect_error "inv_freq shape" "inv_freq must be [4] (head_dim / 2), got [8]" compress --press KeyRerotationPress \
  --ratio 0.5 --input "$tmp/bad_inv_freq.safetensors" --output "$tmp/rerot.st"
expect_ok "compress --quiet" compress --press KnormPress --ratio 0.5 --input "$tmp/kv.safetensors" \
  --output "$tmp/quiet.st" --quiet && { [ ! -s "$tmp/stdout" ] || fail "--quiet printed: $(cat "$tmp/stdout")"; }

# Head-ragged press (docs/CLI.md, "Head-ragged output"): the paper's across-heads selection of
# CompactorPress. Its kept set must be the 2 * 20 best (head, position) pairs of each batch row
# under the scores that the per-head run (compactor.st, same seed and chunk_size) wrote.
if expect_ok "compress head-ragged" compress --press CompactorPress --ratio 0.5 --param seed=1 --param chunk_size=16 \
    --param selection=across_heads --input "$tmp/compactor.safetensors" --output "$tmp/ragged.st"; then
  grep -Eq '^CompactorPress: ratio 0.5, 40 -> [0-9.]+ tokens per head on average \(min [0-9]+, max [0-9]+; head-ragged\)' \
    "$tmp/stdout" || fail "compress head-ragged: summary line: $(cat "$tmp/stdout")"
  checks=$((checks + 1))
  "$python" - "$tmp" <<'EOF' || fail "head-ragged output checks (see above)"
import sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file

tmp = sys.argv[1]
src, got, dense = (load_file(f"{tmp}/{n}") for n in ("compactor.safetensors", "ragged.st", "compactor.st"))
with safe_open(f"{tmp}/ragged.st", "pt") as f:
    meta = f.metadata()
bad = 0
def check(cond, what):
    global bad
    if not cond:
        print(f"FAIL: head-ragged: {what}", file=sys.stderr)
        bad += 1

keys, values, scores = src["keys"], src["values"], dense["scores"]
B, H, S, D = keys.shape
n = int(S * 0.5)
check(set(got) == {"keys", "values", "kept_indices", "lengths"}, f"tensors {sorted(got)}")
lengths, idx = got["lengths"], got["kept_indices"]
check(lengths.shape == (B, H) and lengths.dtype == torch.int64, f"lengths {lengths.dtype} {tuple(lengths.shape)}")
T = int(lengths.sum())
check(T == B * H * n, f"{T} tokens kept, expected {B * H * n}")
check(got["keys"].shape == (T, D) and got["values"].shape == (T, D), f"keys {tuple(got['keys'].shape)}")
check(idx.shape == (T,) and idx.dtype == torch.int64, f"kept_indices {idx.dtype} {tuple(idx.shape)}")
check(len(set(lengths.flatten().tolist())) > 1, f"head budgets are all equal: {lengths.tolist()}")
check(meta.get("layout") == "head_ragged" and meta.get("n_kept") == str(T), f"metadata {meta}")
row = 0
for b in range(B):
    kept = set()
    for h in range(H):
        L = int(lengths[b, h])
        i = idx[row:row + L]
        check(bool((i[1:] > i[:-1]).all()) and bool((i >= 0).all() and (i < S).all()), f"[{b},{h}] indices {i.tolist()}")
        check(torch.equal(got["keys"][row:row + L], keys[b, h, i]), f"[{b},{h}] keys are not keys[kept_indices]")
        check(torch.equal(got["values"][row:row + L], values[b, h, i]), f"[{b},{h}] values are not values[kept_indices]")
        kept |= {(h, p) for p in i.tolist()}
        row += L
    s = scores[b]
    best = sorted(((h, p) for h in range(H) for p in range(S)), key=lambda hp: (-float(s[hp]), hp))[: H * n]
    check(kept == set(best), f"row {b}: kept set is not the top-{H * n} (head, position) pairs")
print("checked the head-ragged output", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
fi
expect_error "compress bad selection" "CompactorPress: parameter selection must be per_head or across_heads, got 'sideways'" \
  compress --press CompactorPress --ratio 0.5 --param selection=sideways --input "$tmp/compactor.safetensors" \
  --output "$tmp/err_out.st"

checks=$((checks + 1))
"$python" - "$tmp" "${cases[@]}" <<'EOF' || fail "output checks (see above)"
import json, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file

tmp, cases = sys.argv[1], [c.split() for c in sys.argv[2:]]
bad = 0
def check(cond, what):
    global bad
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        bad += 1

for out, inp, press, ratio in cases:
    r = float(ratio)
    src = load_file(f"{tmp}/{inp}")
    got = load_file(f"{tmp}/{out}")
    with safe_open(f"{tmp}/{out}", "pt") as f:
        meta = f.metadata()
    keys, values = src["keys"], src["values"]
    B, H, S, D = keys.shape
    n = max(1, int(S * (1 - r)))
    tag = f"{out} ({press}, ratio {ratio})"
    bad_before = bad
    check(set(got) == {"keys", "values", "scores", "kept_indices"}, f"{tag}: tensors {sorted(got)}")
    if bad > bad_before:
        continue
    idx, scores = got["kept_indices"], got["scores"]
    check(got["keys"].shape == (B, H, n, D), f"{tag}: keys shape {tuple(got['keys'].shape)}, n_kept {n}")
    check(got["values"].shape == (B, H, n, D), f"{tag}: values shape {tuple(got['values'].shape)}")
    check(got["keys"].dtype == keys.dtype and got["values"].dtype == keys.dtype, f"{tag}: dtype")
    check(idx.shape == (B, H, n) and idx.dtype == torch.int64, f"{tag}: kept_indices {idx.dtype} {tuple(idx.shape)}")
    check(scores.shape == (B, H, S) and scores.dtype == torch.float32, f"{tag}: scores {scores.dtype} {tuple(scores.shape)}")
    if bad > bad_before:
        continue
    check(bool((idx[..., 1:] > idx[..., :-1]).all()), f"{tag}: kept_indices not strictly ascending")
    check(bool((idx >= 0).all() and (idx < S).all()), f"{tag}: kept_indices out of range")
    gi = idx.unsqueeze(-1).expand(B, H, n, D)
    check(torch.equal(got["keys"], keys.gather(2, gi)), f"{tag}: keys are not keys[kept_indices]")
    check(torch.equal(got["values"], values.gather(2, gi)), f"{tag}: values are not values[kept_indices]")
    # The kept positions are the n best scores (ties to the lower position).
    for b in range(B):
        for h in range(H):
            s = scores[b, h].tolist()
            best = sorted(sorted(range(S), key=lambda i: (-s[i], i))[:n])
            check(idx[b, h].tolist() == best, f"{tag}: kept_indices[{b},{h}] are not the top-{n} scores")
    if press == "CompactorPress":
        # Sinks (8 first, 4 last) carry the maximum score; kept whenever n_kept > 12 (the best
        # inner token ties with them).
        sinks = list(range(8)) + list(range(S - 4, S))
        check(bool((scores[..., sinks] == scores.amax(-1, keepdim=True)).all()), f"{tag}: sinks do not hold the max")
        if n > len(sinks):
            check(all(set(sinks) <= set(idx[b, h].tolist()) for b in range(B) for h in range(H)), f"{tag}: sinks dropped")
    if press == "KnormPress":
        want = -keys.float().norm(dim=-1)
        check(torch.allclose(scores, want, rtol=1e-2 if keys.dtype == torch.bfloat16 else 1e-5, atol=1e-3),
              f"{tag}: scores are not -||k||")
    check(meta.get("press") == press, f"{tag}: metadata press {meta.get('press')}")
    check(float(meta.get("ratio", "nan")) == r, f"{tag}: metadata ratio {meta.get('ratio')}")
    try:
        params = json.loads(meta.get("params", ""))
        check(isinstance(params, dict), f"{tag}: params is not an object")
        if press == "SnapKVPress":
            check(params.get("window_size") == "8", f"{tag}: params {params}")
    except json.JSONDecodeError:
        check(False, f"{tag}: params is not JSON: {meta.get('params')}")
print(f"checked {len(cases)} outputs", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF

# ---- compress: errors ---------------------------------------------------------------------
in="$tmp/kv.safetensors"
out="$tmp/err_out.st"
expect_error "no command" "no command given"
expect_error "unknown command" "unknown command 'squeeze'" squeeze
expect_error "unknown option" "unknown option '--pres'" compress --pres KnormPress --ratio 0.5 --input "$in" --output "$out"
expect_error "unknown press" "unknown press 'NopePress'" compress --press NopePress --ratio 0.5 --input "$in" --output "$out"
# KVComposePress needs the engine's second pass (a model): compress on one layer refuses clearly.
expect_error "KVComposePress needs a second pass" "needs the engine's second pass" compress --press KVComposePress --ratio 0.5 --input "$in" --output "$out"
expect_error "KVzipPress needs its replay" "KVzip cannot compress one layer on its own" compress --press KVzipPress --ratio 0.5 --input "$in" --output "$out"
expect_error "unknown --param" "unknown parameter 'window'" compress --press SnapKVPress --ratio 0.5 --param window=8 --input "$in" --output "$out"
expect_error "--param on a press without params" "unknown parameter 'n_sink'" compress --press KnormPress --ratio 0.5 --param n_sink=3 --input "$in" --output "$out"
expect_error "malformed --param" "--param expects KEY=VALUE, got 'window_size'" compress --press SnapKVPress --ratio 0.5 --param window_size --input "$in" --output "$out"
expect_error "bad --param value" "window_size" compress --press SnapKVPress --ratio 0.5 --param window_size=big --input "$in" --output "$out"
expect_error "ratio 1" "--ratio must be a number in [0, 1), got '1'" compress --press KnormPress --ratio 1 --input "$in" --output "$out"
expect_error "ratio negative" "--ratio must be a number in [0, 1)" compress --press KnormPress --ratio -0.1 --input "$in" --output "$out"
expect_error "ratio not a number" "got 'half'" compress --press KnormPress --ratio half --input "$in" --output "$out"
expect_error "ratio nan" "got 'nan'" compress --press KnormPress --ratio nan --input "$in" --output "$out"
expect_error "missing --ratio" "compress needs --ratio" compress --press KnormPress --input "$in" --output "$out"
expect_error "missing --input" "compress needs --input" compress --press KnormPress --ratio 0.5 --output "$out"
expect_error "option without value" "option --output needs a value" compress --press KnormPress --ratio 0.5 --input "$in" --output
expect_error "missing input file" "No such file or directory" compress --press KnormPress --ratio 0.5 --input "$tmp/absent.safetensors" --output "$out"
expect_error "not safetensors" "garbage.safetensors" compress --press KnormPress --ratio 0.5 --input "$tmp/garbage.safetensors" --output "$out"
expect_error "SnapKV without attentions/queries/hidden_states" "SnapKVPress" compress --press SnapKVPress --ratio 0.5 --param window_size=8 --input "$in" --output "$out"
expect_error "NonCausalAttn with window queries only" "queries must cover every position" compress --press NonCausalAttnPress --ratio 0.5 --input "$tmp/queries.safetensors" --output "$out"
expect_error "Compactor without cos/sin" "LeverageScorePress: needs cos/sin" compress --press CompactorPress --ratio 0.5 --input "$tmp/full.safetensors" --output "$out"
expect_error "ObservedAttention without attentions" "attentions" compress --press ObservedAttentionPress --ratio 0.5 --input "$tmp/queries.safetensors" --output "$out"
expect_error "keys not 4-D" "keys must be [batch, kv_heads, seq_len, head_dim]" compress --press KnormPress --ratio 0.5 --input "$tmp/keys_3d.safetensors" --output "$out"
expect_error "values shape" "values must have the shape of keys" compress --press KnormPress --ratio 0.5 --input "$tmp/values_mismatch.safetensors" --output "$out"
expect_error "missing keys" "keys [batch, kv_heads, seq_len, head_dim] are required but were not given" compress --press KnormPress --ratio 0.5 --input "$tmp/no_keys.safetensors" --output "$out"
expect_error "unknown tensor" "unknown tensor 'querys'" compress --press KnormPress --ratio 0.5 --input "$tmp/typo.safetensors" --output "$out"
expect_error "queries head_dim" "queries must be [2, num_heads, Sq, 8]" compress --press SnapKVPress --ratio 0.5 --input "$tmp/bad_queries.safetensors" --output "$out"
expect_error "bad metadata" "metadata num_heads must be an integer, got 'four'" compress --press KnormPress --ratio 0.5 --input "$tmp/bad_meta.safetensors" --output "$out"
expect_error "bad device" "--device must be a torch device such as cpu, cuda or cuda:1, got 'warp9'" compress --press KnormPress --ratio 0.5 --device warp9 --input "$in" --output "$out"
expect_error "unwritable output" "No such file or directory" compress --press KnormPress --ratio 0.5 --input "$in" --output "$tmp/no/such/dir/out.st"
expect_error "output is a directory" "is a directory" compress --press KnormPress --ratio 0.5 --input "$in" --output "$tmp"
checks=$((checks + 1))
[ ! -e "$out" ] || fail "an error run wrote $out"

# ---- calibrate ----------------------------------------------------------------------------
# Two "layers" of one context (the same file twice is enough to exercise aggregation).
if expect_ok "calibrate" calibrate --press KnormPress --input "$tmp/queries.safetensors" \
    --input "$tmp/queries.safetensors" --observe 4 --tolerance 0.2 --json "$tmp/cal.json"; then
  checks=$((checks + 1))
  grep -q "largest ratio within tolerance" "$tmp/stdout" || fail "calibrate: no result line in stdout"
  checks=$((checks + 1))
  "$python" - "$tmp/cal.json" <<'PYEOF' || fail "calibrate: JSON result is wrong"
import json, sys
r = json.load(open(sys.argv[1]))
ev = r["evaluations"]
assert ev[0] == [0.0, 1.0], ev[0]
assert 0.0 <= r["ratio"] <= 0.95, r
assert r["quality"] >= 1.0 - 0.2, r
# every evaluated ratio at or below the answer passed (the search's guarantee)
assert all(q >= 0.8 for x, q in ev if x <= r["ratio"]), ev
PYEOF
fi
expect_error "calibrate without queries" "calibrate needs queries" calibrate --press KnormPress --input "$in"
expect_error "calibrate too few queries" "queries must hold at least --observe (32) rows, got 16" calibrate --press KnormPress --input "$tmp/queries.safetensors" --observe 32
expect_error "calibrate bad tolerance" "--tolerance must be a number >= 0, got '-1'" calibrate --press KnormPress --input "$in" --tolerance -1
expect_error "calibrate unknown press" "unknown press 'NopePress'" calibrate --press NopePress --input "$in"
expect_error "calibrate without input" "calibrate needs --input" calibrate --press KnormPress

# ---- eval: error paths (results: tests/cli/test_eval_parity.py) ----------------------------
expect_error "eval unknown press" "unknown press 'NopePress'" eval --press NopePress
expect_error "eval bad ratio list" "--ratios must be a comma-separated list of numbers in [0, 1), got '0.5,x'" eval --press KnormPress --ratios 0.5,x
expect_error "eval missing text" "$tmp/missing.txt" eval --press KnormPress --text "$tmp/missing.txt"
expect_error "eval param before press" "must follow the --press it applies to" eval --param window_size=8 --press SnapKVPress
expect_error "eval DecodingPress bad target" "DecodingPress: target_size" eval --press DecodingPress --param target_size=0
expect_error "eval PrefillDecodingPress bad part" "decoding_press must be DecodingPress or CompressionRatioDecodingPress" \
  eval --press PrefillDecodingPress --param decoding_press=KnormPress
# Decoding presses in eval (docs/EVAL.md): the continuation is fed one token per forward; a
# DecodingPress runs once (no ratio: JSON null), a CompressionRatioDecodingPress once per ratio.
if expect_ok "eval decoding presses" eval --max-stories 1 --ratios 0.25,0.5 --no-progress --json "$tmp/eval_decoding.json" \
    --press DecodingPress --param press=SnapKVPress --param press.window_size=8 --param compression_interval=16 \
    --param target_size=64 --press CompressionRatioDecodingPress --param press=KeyDiffPress --param compression_interval=8; then
  checks=$((checks + 2))
  grep -qF "(1 stories x (1 + 3 press runs: 1 press x 2 ratios + 1 without a ratio, once))" "$tmp/stdout" ||
    fail "eval decoding presses: summary line ($(tail -n 1 "$tmp/stdout"))"
  "$python" - "$tmp/eval_decoding.json" <<'EOF' || fail "eval decoding presses: results (see above)"
import json, math, sys
j = json.load(open(sys.argv[1]))
rows = [(r["press"], r["ratio"]) for r in j["results"]]
assert rows == [("DecodingPress", None), ("CompressionRatioDecodingPress", 0.25),
                ("CompressionRatioDecodingPress", 0.5)], rows
full = j["full"]["mean_nll"]
for r in j["results"]:
    assert math.isfinite(r["mean_nll"]) and 0 <= r["greedy_agreement"] <= 1, r
    # every press here compresses within the story's continuation: the NLL moves
    assert r["mean_nll"] != full, (r["label"], full)
EOF
fi

# ---- eval --png: scripts/plot.py run by a Python with matplotlib (docs/CLI.md) ---------------
# KVPRESS_PYTHON= (empty counts as unset): the CLI's own choice, the Python it was built with.
if KVPRESS_PYTHON= expect_ok "eval --png" eval --max-stories 1 --press KnormPress --ratios 0.5 --quiet --png "$tmp/eval.png"; then
  checks=$((checks + 1))
  [ "$(head -c 8 "$tmp/eval.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] ||
    fail "eval --png: $tmp/eval.png does not start with the PNG signature"
fi
# Checked before the evaluation: the missing --text would fail first otherwise.
KVPRESS_PYTHON="$tmp/no-such-python" expect_error "eval --png without a Python" \
  "--png needs Python with matplotlib: $tmp/no-such-python (from KVPRESS_PYTHON) cannot be run" \
  eval --press KnormPress --text "$tmp/missing.txt" --png "$tmp/never.png"
python_without_mpl=""
for candidate in /usr/bin/python3 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && ! "$candidate" -c 'import matplotlib' 2>/dev/null; then
    python_without_mpl="$(command -v "$candidate")"
    break
  fi
done
if [ -n "$python_without_mpl" ]; then
  KVPRESS_PYTHON="$python_without_mpl" expect_error "eval --png without matplotlib" \
    "--png needs Python with matplotlib: $python_without_mpl (from KVPRESS_PYTHON) cannot import matplotlib" \
    eval --press KnormPress --text "$tmp/missing.txt" --png "$tmp/never.png"
else
  echo "test_cli.sh: note: every Python found has matplotlib; the missing-matplotlib error is not checked"
fi
checks=$((checks + 1))
[ -e "$tmp/never.png" ] && fail "eval --png errors: $tmp/never.png was written"
# plot.py failing after the evaluation (the PNG's folder does not exist): its message on one line.
KVPRESS_PYTHON= expect_error "eval --png into a missing folder" "--png $tmp/nope/eval.png: " \
  eval --max-stories 1 --press KnormPress --ratios 0.5 --quiet --png "$tmp/nope/eval.png"
checks=$((checks + 1))
ls -a "$tmp" | grep -q '^\.plot-' && fail "eval --png: plot.py left a temporary file in $tmp"

# ---- generate: dense and paged (continuous batching) give the same tokens -------------------
cat >"$tmp/prompts.txt" <<'PROMPTS'
Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her friends. One day, she found a big red ball in the park and she wanted to share it with everyone she met.

Tom and his dog Max went to the beach. They ran on the sand and splashed in the water. Max found a shell and brought it to Tom, who laughed and said it was the best shell in the whole world.
The little bird could not fly. It sat on a branch and looked at the sky. A kind old owl came to the tree and said, "Do not be sad, little bird. Every day you will try, and one day you will fly."
Sue had a new toy car. It was blue and very fast.
PROMPTS
for mode in dense paged; do
  flags=()
  [ "$mode" = paged ] && flags=(--paged --max-batch 2 --page-size 8)
  expect_ok "generate $mode AdaKVPress" generate --prompts "$tmp/prompts.txt" --press AdaKVPress --ratio 0.5 \
    --max-new-tokens 12 --no-stop-at-eos --quiet --json "$tmp/generate_$mode.json" "${flags[@]}"
done
checks=$((checks + 1))
"$python" - "$tmp/generate_dense.json" "$tmp/generate_paged.json" <<'EOF2' || fail "generate: paged differs from dense"
import json, sys
dense, paged = (json.load(open(p)) for p in sys.argv[1:3])
assert dense["mode"] == "dense" and paged["mode"] == "paged" and dense["pool"] is None
assert len(dense["generations"]) == len(paged["generations"]) == 4, "four non-blank lines, four prompts"
for d, p in zip(dense["generations"], paged["generations"]):
    assert d["prompt_tokens"] == p["prompt_tokens"] and d["tokens"] == p["tokens"], (d["text"], p["text"])
    assert len(p["tokens"]) == 12
pool = paged["pool"]
assert pool["page_size"] == 8 and pool["max_running"] == 2 and pool["prefill_batches"] >= 2, pool
assert pool["prompt_pages_stored"] < pool["prompt_pages_uncompressed"], pool
assert 0 < pool["peak_pages_used"] <= pool["num_layers"] * pool["pages_per_layer"], pool
EOF2
# ---- generate --tp N: the paged mode over N tensor-parallel ranks (separate processes, Gloo) --------
# Global budgets: every rank keeps what one process keeps of its heads, so the tokens are one process's.
for tp in 2 4; do
  expect_ok "generate --tp $tp AdaKVPress" generate --prompts "$tmp/prompts.txt" --press AdaKVPress --ratio 0.5 \
    --max-new-tokens 12 --no-stop-at-eos --quiet --json "$tmp/generate_tp$tp.json" --max-batch 2 --page-size 8 \
    --tp "$tp"
done
checks=$((checks + 1))
"$python" - "$tmp/generate_paged.json" "$tmp/generate_tp2.json" "$tmp/generate_tp4.json" <<'EOF2' || fail "generate --tp differs from one process"
import json, sys
one, *ranks = (json.load(open(p)) for p in sys.argv[1:])
for tp, run in zip((2, 4), ranks):
    assert run["mode"] == "paged" and run["tensor_parallel"] == {"ranks": tp, "budgets": "global"}, run["tensor_parallel"]
    for o, r in zip(one["generations"], run["generations"]):
        assert o["tokens"] == r["tokens"], (tp, o["text"], r["text"])
    # Rank 0's pool holds its heads: 1/tp of one process's uncompressed prompt pages.
    assert run["pool"]["prompt_pages_uncompressed"] * tp == one["pool"]["prompt_pages_uncompressed"], run["pool"]
EOF2
if expect_ok "generate --tp 2 prints the ranks" generate --tp 2 --budgets per_rank --prompt "Once upon a time, a cat" \
  --press KnormPress --ratio 0.25 --max-new-tokens 4; then
  grep -q 'paged mode over 2 tensor-parallel ranks (per_rank budgets)$' "$tmp/stdout" ||
    fail "generate --tp: no ranks line: $(cat "$tmp/stdout")"
  grep -q "^rank 0's cache (its 2 of 4 KV heads):" "$tmp/stdout" || fail "generate --tp: no rank 0 line: $(cat "$tmp/stdout")"
fi
expect_error "generate --budgets without --tp" "--budgets needs --tp N with N > 1" generate --prompt "A dog" \
  --budgets per_rank
expect_error "generate --tp not dividing the heads" "the world size (3) must divide the KV heads (4)" generate \
  --prompt "A dog" --tp 3
expect_error "generate --tp with a second-pass press" "KVzipPress runs the model again over the context" \
  generate --prompt "Once upon a time, a cat" --tp 2 --press KVzipPress --ratio 0.5

if expect_ok "generate --paged prints the pool" generate --paged --prompt "Once upon a time, a cat" \
  --press StreamingLLMPress --ratio 0.25 --max-new-tokens 4; then
  grep -q '^\[0\] Once upon a time, a cat' "$tmp/stdout" || fail "generate: no prompt line: $(cat "$tmp/stdout")"
  grep -q '^paged cache: 2 layers x ' "$tmp/stdout" || fail "generate: no pool line: $(cat "$tmp/stdout")"
  grep -q 'peak pages in use: ' "$tmp/stdout" || fail "generate: no peak line: $(cat "$tmp/stdout")"
fi
# ---- query-stats: TriAttentionPress's statistics, then generation with them, dense and paged --------
if expect_ok "query-stats" query-stats --max-tokens 300 --out "$tmp/tri.safetensors"; then
  grep -q '^query statistics of .* over 300 tokens of .*: 2 layers x 8 heads x 8 frequency pairs' "$tmp/stdout" ||
    fail "query-stats: no summary line: $(cat "$tmp/stdout")"
  "$python" - "$tmp/tri.safetensors" <<'EOF2' || fail "query-stats: the file is not [layers, heads, head_dim / 2] x 3"
import sys
from safetensors.torch import load_file
t = load_file(sys.argv[1])
assert sorted(t) == ["q_abs_mean", "q_mean_imag", "q_mean_real"], sorted(t)
assert all(v.shape == (2, 8, 8) for v in t.values()), {k: v.shape for k, v in t.items()}
assert bool((t["q_abs_mean"] >= (t["q_mean_real"] ** 2 + t["q_mean_imag"] ** 2).sqrt() - 1e-5).all())
EOF2
  for mode in dense paged; do
    flags=()
    [ "$mode" = paged ] && flags=(--paged)
    expect_ok "generate $mode TriAttentionPress" generate --prompt "Once upon a time, a cat" --press TriAttentionPress \
      --param stats_file="$tmp/tri.safetensors" --param budget=12 --param divide_length=4 --max-new-tokens 30 \
      --no-stop-at-eos --quiet --json "$tmp/tri_$mode.json" "${flags[@]}"
  done
  cmp -s <("$python" -c 'import json,sys; print([g["tokens"] for g in json.load(open(sys.argv[1]))["generations"]])' "$tmp/tri_dense.json") \
    <("$python" -c 'import json,sys; print([g["tokens"] for g in json.load(open(sys.argv[1]))["generations"]])' "$tmp/tri_paged.json") ||
    fail "generate TriAttentionPress: paged differs from dense"
fi
expect_error "query-stats without --out" "query-stats: --out FILE is required" query-stats --max-tokens 10
expect_error "generate without prompts" "generate needs --prompts FILE" generate --press KnormPress --ratio 0.5
expect_error "generate scorer without ratio" "--press SnapKVPress needs --ratio R" generate --prompt "A dog" \
  --press SnapKVPress
expect_error "generate ratio without press" "--ratio and --param apply to a --press" generate --prompt "A dog" --ratio 0.5
expect_error "generate pool option without --paged" "need --paged" generate --prompt "A dog" --page-size 8
# Quantized pages: the pool line names the format and its bytes (int8: D codes per row and a float32
# scale per page, for keys and values), the residual rows get their own line.
if expect_ok "generate --paged --kv-dtype int8" generate --paged --kv-dtype int8 --page-size 8 \
  --prompt "Once upon a time, a cat" --press KnormPress --ratio 0.5 --max-new-tokens 4 --json "$tmp/int8.json"; then
  grep -q 'keys and values, int8)' "$tmp/stdout" || fail "generate --kv-dtype: no int8 pool line: $(cat "$tmp/stdout")"
  grep -q '^residual rows' "$tmp/stdout" || fail "generate --kv-dtype: no residual line: $(cat "$tmp/stdout")"
  checks=$((checks + 1))
  "$python" - "$tmp/int8.json" <<'EOF2' || fail "generate --kv-dtype int8: pool figures"
import json, sys
pool = json.load(open(sys.argv[1]))["pool"]
assert pool["kv_format"] == "int8" and pool["residual_bytes"] > 0, pool
assert pool["bytes_per_page"] == 2 * (8 * 16 + 4), pool  # head_dim 16
EOF2
fi
expect_error "generate bad KV format" "--kv-dtype: the KV format must be full, int8, fp8 or int4, got 'int2'" \
  generate --paged --prompt "A dog" --kv-dtype int2
expect_error "generate KV format without --paged" "need --paged" generate --prompt "A dog" --kv-dtype int8
expect_error "generate bad page size" "--page-size must be an integer in [1, 65536], got '0'" generate --paged \
  --prompt "A dog" --page-size 0
expect_error "generate missing prompts file" "--prompts $tmp/none.txt: cannot open the file" generate \
  --prompts "$tmp/none.txt"
expect_error "generate pool too small" "prompt 0 (8 tokens) can need 16 pages per layer with max_new_tokens 40, more than the pool's 4" \
  generate --paged --prompt "Once upon a time, a cat" --max-new-tokens 40 --page-size 16 --pages-per-layer 4
expect_error "generate press failing on a short prompt" "SnapKVPress" generate --paged --prompt "A dog" \
  --press SnapKVPress --ratio 0.5

# ---- ask: kvpress's question-answering pipeline ---------------------------------------------------
# The answers of kvpress's pipeline on the same context and questions (SnapKVPress, several questions
# from one cache; FinchPress query-aware): the CLI must give the same texts.
pipeline_fixture="$fixtures/pipeline/pipeline.json"
checks=$((checks + 1))
if [ -z "$fixtures" ] || [ ! -f "$pipeline_fixture" ]; then
  fail "ask: no $pipeline_fixture (tests/reference/make_pipeline_fixtures.py makes it; scripts/test.sh does)"
else
  "$python" - "$pipeline_fixture" "$tmp" <<'EOF2'
import json, sys
fx = json.load(open(sys.argv[1]))
open(f"{sys.argv[2]}/context.txt", "w").write(fx["context"])
cases = [c for c in fx["cases"] if (c["press"], c["params"], c["query_aware"]) in
         (("SnapKVPress", {}, False), ("FinchPress", {}, True))]
assert len(cases) == 2, cases
json.dump(cases, open(f"{sys.argv[2]}/ask_cases.json", "w"))
EOF2
  max_new=$("$python" -c "import json,sys; print(json.load(open(sys.argv[1]))['max_new_tokens'])" "$pipeline_fixture")
  for i in 0 1; do
    mapfile -t spec < <("$python" - "$tmp/ask_cases.json" "$i" <<'EOF2'
import json, sys
c = json.load(open(sys.argv[1]))[int(sys.argv[2])]
print(c["press"]); print(c["compression_ratio"]); print("--query-aware" if c["query_aware"] else "")
for q in c["questions"]: print(q)
EOF2
    )
    args=(ask --context "$tmp/context.txt" --press "${spec[0]}" --ratio "${spec[1]}" --max-new-tokens "$max_new"
          --quiet --json "$tmp/ask_$i.json")
    [ -n "${spec[2]}" ] && args+=("${spec[2]}")
    for q in "${spec[@]:3}"; do args+=(--question "$q"); done
    if expect_ok "ask ${spec[0]}" "${args[@]}"; then
      "$python" - "$tmp/ask_cases.json" "$i" "$tmp/ask_$i.json" <<'EOF2' || fail "ask ${spec[0]}: answers differ from kvpress's pipeline"
import json, sys
want = json.load(open(sys.argv[1]))[int(sys.argv[2])]["answers"]
got = [a["answer"] for a in json.load(open(sys.argv[3]))["answers"]]
assert got == want, (got, want)
EOF2
    fi
  done
fi
printf 'Lily and Tom went to the park. They played with a red ball all day.' >"$tmp/short.txt"
if expect_ok "ask prints question and answer" ask --context "$tmp/short.txt" --question "Who went to the park?" \
  --max-new-tokens 4; then
  grep -q '^\[0\] Q: Who went to the park?' "$tmp/stdout" || fail "ask: no question line: $(cat "$tmp/stdout")"
  grep -q '^    A: ' "$tmp/stdout" || fail "ask: no answer line: $(cat "$tmp/stdout")"
fi
expect_error "ask without context" "ask needs --context FILE" ask --question "Who?"
expect_error "ask without question" "ask needs at least one --question" ask --context "$tmp/short.txt"
expect_error "ask missing context" "--context $tmp/none.txt: cannot open the file" ask --context "$tmp/none.txt" \
  --question "Who?"
: >"$tmp/empty.txt"
expect_error "ask empty context" "the file is empty" ask --context "$tmp/empty.txt" --question "Who?"
expect_error "ask scorer without ratio" "ask: --press KnormPress needs --ratio R" ask --context "$tmp/short.txt" \
  --question "Who?" --press KnormPress
expect_error "ask FinchPress needs query-aware" "FinchPress observes the question: set query_aware" ask \
  --context "$tmp/short.txt" --question "Who?" --press FinchPress --ratio 0.5
expect_error "ask decoding press takes one question" "takes a single question" ask --context "$tmp/short.txt" \
  --question "Who?" --question "Where?" --press DecodingPress

# ---- outputs appear whole or not at all (kvpress::io::write_file_atomically) -------------------
mkdir -p "$tmp/outs"
printf 'old' >"$tmp/outs/out.safetensors"
expect_error "failed compress keeps an existing output" "unknown tensor 'querys'" \
  compress --press KnormPress --ratio 0.5 --input "$tmp/typo.safetensors" --output "$tmp/outs/out.safetensors"
checks=$((checks + 1))
[ "$(cat "$tmp/outs/out.safetensors")" = "old" ] || fail "a failed compress changed the existing output"
expect_ok "compress replaces an existing output" compress --press KnormPress --ratio 0.5 --quiet \
  --input "$tmp/kv.safetensors" --output "$tmp/outs/out.safetensors"
expect_ok "eval --json --csv" eval --max-stories 1 --press KnormPress --ratios 0.5 --quiet \
  --json "$tmp/outs/eval.json" --csv "$tmp/outs/eval.csv"
checks=$((checks + 1))
[ "$(ls -A "$tmp/outs" | sort | tr '\n' ' ')" = "eval.csv eval.json out.safetensors " ] ||
  fail "outputs: expected exactly eval.csv eval.json out.safetensors in $tmp/outs, got: $(ls -A "$tmp/outs" | tr '\n' ' ')"
expect_error "eval --csv into a missing folder" "--csv: $tmp/nope/eval.csv: cannot create a file next to it" \
  eval --max-stories 1 --press KnormPress --ratios 0.5 --quiet --csv "$tmp/nope/eval.csv"

if [ "$failures" -ne 0 ]; then
  echo "test_cli.sh: $failures failure(s) in $checks checks" >&2
  exit 1
fi
echo "test_cli.sh: all $checks checks passed"
