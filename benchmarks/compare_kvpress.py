#!/usr/bin/env python3
"""Side-by-side speed of kvpress 0.5.5 and kvpress-cpp on identical inputs, in one process.

Both sides run in this Python process on the same tensors, with the same dtype and the same
intra-op thread pool (torch.set_num_threads; libkvpress.so runs through the same libtorch), and
alternate per repetition (which side goes first alternates too). Our presses are called through
torch.ops.kvpress.press_compress (src/bindings/press_ops.cpp), which builds the press with kvpress::make_press and
runs BasePress::compress; kvpress's side calls press.compress(module, hidden_states, keys, values,
attentions, kwargs) as its forward hook does. Both time score + top-k + gather of K and V.

Table (a), projections excluded: kvpress's attention module gets q_proj/k_proj that merely slice
precomputed pre-RoPE queries/keys out of `hidden_states` (a view, no GEMM); we get the same queries
after RoPE (the last window for SnapKV/TOVA, all positions for NonCausalAttn/Compactor), the RoPE
tables where a press needs them (LeverageScore, Compactor invert RoPE on the cached keys), and the
full attention matrix for ObservedAttention (both sides). RoPE of the queries stays inside
kvpress's press, as in kvpress. Table (b), each side's full path: real hidden states [B, S, Hq*D]
and projection weights (nn.Linear on kvpress's side, q_proj/k_proj tensors on ours), for the
presses that read them (SnapKV, TOVA, LeverageScore, NonCausalAttn, Compactor). Ours gets the RoPE
tables too, except LeverageScorePress: given cos/sin our presses get the pre-RoPE keys by inverting
RoPE on the cached keys instead of projecting them (CompactorPress does so in table (b), as it
needs cos/sin for its queries; kvpress projects K).

Memory: both sides' outputs (the kept K/V, tens of MiB) are fresh allocations. glibc serves large
ones by mmap and gives them back on free, so each call would page-fault and zero new memory: on the
development VM that costs ~0.4 ms per MiB (2.5 GB/s), more than most presses' work, and whether a
call pays it depends on glibc's heuristics, not on the press. Unless --fresh-pages, the script
re-executes itself with MALLOC_MMAP_MAX_=0 and a high MALLOC_TRIM_THRESHOLD_, so both sides reuse
freed heap memory, as an engine's caching allocator (or in-place compaction) would.

Inputs are random (timings depend only on shapes). Unless --no-check, each deterministic press's
kept positions are compared once, untimed, with kvpress's top-k ("agree" = share of positions in
common).

    ~/.cache/kvpress-cpp/venv/bin/python benchmarks/compare_kvpress.py --lib build/libkvpress.so
    ... --seq 4096 --presses KnormPress,SnapKVPress --repeats 3 --png /tmp/compare.png --csv /tmp/compare.csv

--json/--csv write the rows of both tables (columns: scripts/plot.py's COMPARE_COLUMNS); the chart
(--png) is scripts/plot.py's `compare` chart, which redraws such a file:
`scripts/plot.py compare /tmp/compare.csv --out /tmp/compare.png`.
The last line reads `min speedup A, median speedup B over N presses` for table (a).
See docs/PERFORMANCE.md.
"""
import argparse
import csv
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import plot  # noqa: E402 (scripts/plot.py: the chart and its file format)

ALL_PRESSES = [
    "RandomPress", "KnormPress", "StreamingLLMPress", "KeyDiffPress", "SnapKVPress", "LagKVPress",
    "TOVAPress", "ObservedAttentionPress", "LeverageScorePress", "NonCausalAttnPress", "CompactorPress",
]
PROJECTION_PRESSES = ["SnapKVPress", "TOVAPress", "LeverageScorePress", "NonCausalAttnPress", "CompactorPress"]
RANDOMISED = {"RandomPress", "LeverageScorePress", "CompactorPress"}  # no agreement check
WINDOW = 64  # SnapKVPress's default window_size
ROPE_THETA = 500000.0  # Llama-3.1

# ----------------------------------------------------------------------------- inputs


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class Layer:
    """Random inputs of one Llama-3.1-8B-shaped layer, built once."""

    def __init__(self, args, dtype, need_full, need_attn):
        B, Hq, Hkv, D, S = args.batch, args.q_heads, args.kv_heads, args.head_dim, args.seq
        self.B, self.Hq, self.Hkv, self.D, self.S, self.dtype = B, Hq, Hkv, D, S, dtype
        g = torch.Generator().manual_seed(0)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        inv_freq = ROPE_THETA ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [S, D], HF layout
        self.position_embeddings = (self.cos[None], self.sin[None])  # what kvpress's kwargs carry

        q_pre = randn(B, Hq, S, D)
        k_pre = randn(B, Hkv, S, D)
        self.values = randn(B, Hkv, S, D)
        self.keys = rope(k_pre, self.cos, self.sin).contiguous()  # the cache: post-RoPE keys
        self.q_post = rope(q_pre, self.cos, self.sin).contiguous()  # our side of table (a)
        self.q_window = self.q_post[:, :, -WINDOW:].contiguous()
        self.q_last = self.q_post[:, :, -1:].contiguous()
        # kvpress's side of table (a): pre-RoPE queries and keys laid out as "hidden states"
        # [B, S, Hq*D + Hkv*D]; q_proj/k_proj slice them (views, no GEMM).
        self.hs_slices = torch.cat(
            [q_pre.transpose(1, 2).reshape(B, S, Hq * D), k_pre.transpose(1, 2).reshape(B, S, Hkv * D)], dim=-1
        )
        del q_pre, k_pre
        nq = Hq * D
        self.slicing_module = self._module(lambda h: h[..., :nq], lambda h: h[..., nq:])

        self.hidden = self.Wq = self.Wk = self.linear_module = None
        if need_full:  # table (b): real hidden states and projection weights
            hidden = Hq * D
            self.hidden = randn(B, S, hidden)
            self.Wq = randn(Hq * D, hidden, scale=1 / math.sqrt(hidden))
            self.Wk = randn(Hkv * D, hidden, scale=1 / math.sqrt(hidden))
            q_lin = torch.nn.Linear(hidden, Hq * D, bias=False, dtype=dtype)
            k_lin = torch.nn.Linear(hidden, Hkv * D, bias=False, dtype=dtype)
            q_lin.weight = torch.nn.Parameter(self.Wq, requires_grad=False)
            k_lin.weight = torch.nn.Parameter(self.Wk, requires_grad=False)
            self.linear_module = self._module(q_lin, k_lin)

        self.attentions = None
        if need_attn:  # causal rows of non-negative weights summing to 1, built in place
            a = torch.empty(B, Hq, S, S, dtype=dtype)
            a.uniform_(generator=g).tril_()
            self.attentions = a.div_(a.sum(-1, keepdim=True))

    def _module(self, q_proj, k_proj):
        """The attributes kvpress reads from a Llama-like attention module."""
        config = types.SimpleNamespace(num_attention_heads=self.Hq, num_key_value_heads=self.Hkv)
        return types.SimpleNamespace(config=config, head_dim=self.D, num_key_value_heads=self.Hkv,
                                     layer_idx=0, q_proj=q_proj, k_proj=k_proj)

    def kvpress_args(self, name, full):
        """(module, hidden_states, keys, values, attentions, kwargs) for press.compress/score."""
        module, hs = (self.linear_module, self.hidden) if full else (self.slicing_module, self.hs_slices)
        attn = self.attentions if name == "ObservedAttentionPress" else None
        return module, hs, self.keys, self.values, attn, {"position_embeddings": self.position_embeddings}

    def our_kwargs(self, name, full):
        """Optional inputs of torch.ops.kvpress.press_compress (LayerInputs fields)."""
        kw = {"num_heads": self.Hq}
        if full:
            kw.update(hidden_states=self.hidden, q_proj=self.Wq, k_proj=self.Wk)
            if name != "LeverageScorePress":  # given cos/sin, it would invert RoPE instead of projecting K
                kw.update(cos=self.cos, sin=self.sin)
        elif name == "SnapKVPress":
            kw["queries"] = self.q_window
        elif name == "TOVAPress":
            kw["queries"] = self.q_last
        elif name == "ObservedAttentionPress":
            kw["attentions"] = self.attentions
        elif name == "LeverageScorePress":
            kw.update(cos=self.cos, sin=self.sin)
        elif name == "NonCausalAttnPress":
            kw["queries"] = self.q_post
        elif name == "CompactorPress":
            kw.update(queries=self.q_post, cos=self.cos, sin=self.sin)
        return kw


# ----------------------------------------------------------------------------- timing


def bench(kv_fn, our_fn, repeats, warmup):
    """Median seconds of each side; the sides alternate, and so does which one goes first."""
    for _ in range(warmup):
        kv_fn()
        our_fn()
    times = {"kv": [], "ours": []}
    for r in range(repeats):
        order = [("kv", kv_fn), ("ours", our_fn)] if r % 2 == 0 else [("ours", our_fn), ("kv", kv_fn)]
        for side, fn in order:
            gc.collect()
            t0 = time.perf_counter()
            out = fn()
            times[side].append(time.perf_counter() - t0)
            del out
    return times["kv"], times["ours"]


def agreement(press, layer, name, full, ours_kept, ratio):
    """Share of kept positions in common with kvpress's top-k (None for randomised presses)."""
    if name in RANDOMISED:
        return None
    scores = press.score(*layer.kvpress_args(name, full))
    n_kept = torch.ops.kvpress.n_kept(layer.S, ratio)
    ref = scores.topk(n_kept, dim=-1).indices
    common, total = 0, 0
    for r, o in zip(ref.reshape(-1, n_kept).tolist(), ours_kept.reshape(-1, ours_kept.shape[-1]).tolist()):
        common += len(set(r) & set(o))
        total += n_kept
    return common / total


def floor_model(layer, n_kept, lib):
    """(peaks, {press: (floor seconds, its largest term)}) from kvpress_press_work, built next to
    the library: benchmarks/press_work.h is the one definition of each press's work (kvpress_bench
    reports the same floors) and benchmarks/machine_peaks.h of the machine's true limits, measured by
    it now, at this process's thread count, in the kernels' instruction set: the float32 FMA peak
    with register-resident accumulators, and the read, write and copy bandwidths over a buffer of the
    layer's K and V. docs/PERFORMANCE.md explains each press's line."""
    tool = os.path.join(os.path.dirname(os.path.abspath(lib)), "benchmarks", "kvpress_press_work")
    if not os.path.exists(tool):
        sys.exit(f"compare_kvpress: {tool} not found (build the project's benchmarks)")
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[layer.dtype]
    cmd = [tool, "--batch", layer.B, "--q-heads", layer.Hq, "--kv-heads", layer.Hkv, "--head-dim", layer.D,
           "--seq", layer.S, "--dtype", dtype, "--n-kept", n_kept, "--threads", torch.get_num_threads()]
    out = json.loads(subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout)
    floors = {name: (w["floor_seconds"], w["bound"]) for name, w in out["presses"].items()}
    return out, floors


def run_table(title, presses, layer, args, full, kvpress_mod):
    rows = []
    n_kept = torch.ops.kvpress.n_kept(layer.S, args.ratio)
    peaks, floors = floor_model(layer, n_kept, args.lib)
    print(f"  {peaks_line(peaks)}", flush=True)
    for name in presses:
        press = getattr(kvpress_mod, name)(compression_ratio=args.ratio)
        kv_args = layer.kvpress_args(name, full)
        our_kw = layer.our_kwargs(name, full)

        def kv_fn():
            return press.compress(*kv_args)

        def our_fn():
            return torch.ops.kvpress.press_compress(name, args.ratio, [], layer.keys, layer.values, **our_kw)

        try:
            all_kv, all_ours = bench(kv_fn, our_fn, args.repeats, args.warmup)
            t_kv, t_ours = statistics.median(all_kv), statistics.median(all_ours)
        except Exception as e:  # report and go on with the other presses
            print(f"  {name:24s} FAILED: {str(e).splitlines()[0]}", flush=True)
            continue
        agree = None if args.no_check else agreement(press, layer, name, full, our_fn()[2], args.ratio)
        floor = bound = None
        if not full and name in floors:  # table (b) adds the projections, whose floor is not modelled
            floor, bound = floors[name]
        rows.append(dict(press=name, kv=t_kv, ours=t_ours, speedup=t_kv / t_ours, agree=agree, floor=floor,
                         bound=bound))
        print(f"  {name:24s} kvpress {t_kv * 1e3:10.2f} ms   ours {t_ours * 1e3:9.2f} ms   "
              f"{t_kv / t_ours:7.2f}x" + ("" if agree is None else f"   agree {agree:.4f}") +
              f"   (all ms: kvpress {' '.join(f'{t * 1e3:.0f}' for t in all_kv)}; "
              f"ours {' '.join(f'{t * 1e3:.0f}' for t in all_ours)})", flush=True)
        del kv_args, our_kw
        gc.collect()
    print()
    print(markdown_table(title, rows, peaks))
    return rows, peaks


def peaks_line(peaks):
    """The true limits a table's floors come from, as every table prints them."""
    return (f"floors from this run's peaks ({torch.get_num_threads()} threads, {peaks['fma_isa']}): FMA "
            f"{peaks['fma_peak'] / 1e9:.1f} GFLOP/s float32, read {peaks['read_bandwidth'] / 1e9:.1f} GB/s, "
            f"write {peaks['write_bandwidth'] / 1e9:.1f} GB/s, copy {peaks['copy_bandwidth'] / 1e9:.1f} GB/s "
            f"(read + written), over a buffer of the layer's K and V; floor = the largest of FLOPs / FMA, "
            f"read / read, written / write, (read + written) / copy")


def markdown_table(title, rows, peaks):
    """One table as printed and as --markdown writes it."""
    lines = [title, "", peaks_line(peaks), "", "| press | kvpress 0.5.5 (ms) | kvpress-cpp (ms) | speedup | kept positions agree | floor (ms) | "
             "ours / floor |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        agree = "-" if r["agree"] is None else f"{r['agree'] * 100:.2f}%"
        floor = "-" if r["floor"] is None else f"{r['floor'] * 1e3:.2f} ({r['bound']})"
        over = "-" if r["floor"] is None else f"{r['ours'] / r['floor']:.1f}x"
        lines.append(f"| {r['press']} | {r['kv'] * 1e3:.2f} | {r['ours'] * 1e3:.2f} | {r['speedup']:.2f}x | {agree} "
                     f"| {floor} | {over} |")
    return "\n".join(lines) + "\n"


def run_metadata():
    """What every output of one run records: UTC date, the checkout's commit (-dirty with uncommitted
    changes), the CPU model (lscpu) and what the library's CPU kernels run (ops.cpu_kernel_isa)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd):
        r = subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cpu = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")), cpu)
    except (OSError, subprocess.CalledProcessError):
        pass
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=commit, cpu_model=cpu,
                kernel_isa=torch.ops.kvpress.cpu_kernel_isa())


# ----------------------------------------------------------------------------- files


def file_rows(rows_a, rows_b, run):
    """Both tables' rows in scripts/plot.py's compare format (milliseconds; agree a fraction), each
    with the run's metadata (run_metadata), so a CSV row says where and when it was measured."""
    out = []
    for table, rows in (("a", rows_a), ("b", rows_b)):
        for r in rows:
            out.append(dict(table=table, press=r["press"], kvpress_ms=round(r["kv"] * 1e3, 3),
                            kvpress_cpp_ms=round(r["ours"] * 1e3, 3), agree=r["agree"],
                            floor_ms=None if r["floor"] is None else round(r["floor"] * 1e3, 3), **run))
    return out


def write_results(args, title, rows, markdown):
    """The table (--markdown), the rows (--json, --csv) and the chart (--png), all from this run."""
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown)
        print(f"markdown: {args.markdown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "rows": rows}, f, indent=1)
            f.write("\n")
        print(f"json: {args.json}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=plot.COMPARE_COLUMNS)
            writer.writeheader()
            writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
        print(f"csv: {args.csv}")
    if args.png:
        plot.plot_compare(rows, args.png, title)
        print(f"chart: {args.png}")


# ----------------------------------------------------------------------------- main


def find_library(arg):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in (arg, os.environ.get("KVPRESS_LIB"), os.path.join(root, "build", "libkvpress.so")):
        if path and os.path.exists(path):
            return path
    sys.exit("compare_kvpress: libkvpress.so not found: pass --lib PATH (or set KVPRESS_LIB)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", help="path of libkvpress.so (default: $KVPRESS_LIB, then build/libkvpress.so)")
    p.add_argument("--seq", type=int, default=16384, help="cached tokens S (default 16384)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--presses", default="all", help="comma-separated kvpress class names (default: all)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help=f"intra-op threads for both sides (default {torch.get_num_threads()})")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side and press (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per side first")
    p.add_argument("--ratio", type=float, default=0.5, help="compression ratio")
    p.add_argument("--png", default="compare_kvpress.png", help="chart path ('' for none)")
    p.add_argument("--json", help="also write both tables' rows as JSON ({title, rows})")
    p.add_argument("--csv", help="also write both tables' rows as CSV (scripts/plot.py compare reads either)")
    p.add_argument("--markdown", help="also write the run's line and both tables as Markdown (docs/PERFORMANCE.md)")
    p.add_argument("--table", choices=["a", "b", "both"], default="both", help="which tables to run")
    p.add_argument("--attn-budget-gib", type=float, default=2.0,
                   help="largest [B,Hq,S,S] attention tensor to build for ObservedAttentionPress")
    p.add_argument("--no-check", action="store_true", help="skip the untimed kept-position comparison")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--fresh-pages", action="store_true",
                   help="leave glibc's malloc as it is (outputs may page-fault fresh memory on every call)")
    args = p.parse_args()
    if not args.fresh_pages and "MALLOC_MMAP_MAX_" not in os.environ:
        # glibc reads these once, at start-up: run this script again with them (see the top).
        env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
        os.execve(sys.executable, [sys.executable] + sys.argv, env)

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    presses = ALL_PRESSES if args.presses == "all" else [x.strip() for x in args.presses.split(",") if x.strip()]
    unknown = [x for x in presses if x not in ALL_PRESSES]
    if unknown:
        sys.exit(f"compare_kvpress: unknown press {unknown}; known: {', '.join(ALL_PRESSES)}")
    if args.seq <= WINDOW + 16:
        sys.exit(f"compare_kvpress: --seq must exceed {WINDOW + 16} (SnapKVPress's window)")

    torch.set_num_threads(args.threads)
    lib = args.lib = find_library(args.lib)
    torch.ops.load_library(lib)
    import kvpress as kvpress_mod  # after torch, as in kvpress's own use

    attn_gib = args.batch * args.q_heads * args.seq ** 2 * torch.tensor([], dtype=dtype).element_size() / 2 ** 30
    skipped = []
    if "ObservedAttentionPress" in presses and attn_gib > args.attn_budget_gib:
        presses = [x for x in presses if x != "ObservedAttentionPress"]
        skipped.append(f"ObservedAttentionPress skipped: its [B,Hq,S,S] attentions would take {attn_gib:.1f} GiB "
                       f"(budget {args.attn_budget_gib:g} GiB, --attn-budget-gib)")
    full_presses = [x for x in PROJECTION_PRESSES if x in presses] if args.table in ("b", "both") else []
    a_presses = presses if args.table in ("a", "both") else []

    shape = (f"B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} S={args.seq} "
             f"{args.dtype}, ratio {args.ratio}")
    from importlib.metadata import version

    run = run_metadata()
    run_line = (f"Run {run['date']}, commit {run['commit']}, CPU {run['cpu_model']}, kernels {run['kernel_isa']}, "
                f"kvpress {version('kvpress')}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(run_line)
    print(f"kvpress {version('kvpress')} vs kvpress-cpp ({lib}), torch {torch.__version__}")
    heap = "fresh pages allowed" if args.fresh_pages else "freed heap memory reused (MALLOC_MMAP_MAX_=0)"
    print(f"shape {shape}; threads {torch.get_num_threads()}; median of {args.repeats} alternating calls "
          f"after {args.warmup} warm-up; {heap}")
    for s in skipped:
        print(s)
    print(flush=True)

    with torch.inference_mode():
        t0 = time.perf_counter()
        layer = Layer(args, dtype, need_full=bool(full_presses),
                      need_attn="ObservedAttentionPress" in a_presses)
        print(f"inputs built in {time.perf_counter() - t0:.1f} s", flush=True)
        rows_a, rows_b = [], []
        markdown = [run_line + "\n"]
        if full_presses:
            print("(b) full path from hidden states and projection weights", flush=True)
            title = (f"Table (b): each side's full path from hidden states [B,S,{args.q_heads * args.head_dim}] "
                     f"and projection weights ({shape})")
            rows_b, peaks = run_table(title, full_presses, layer, args, True, kvpress_mod)
            markdown.append(markdown_table(title, rows_b, peaks))
        if a_presses:
            print("(a) projections excluded", flush=True)
            title = f"Table (a): same inputs, projections excluded ({shape})"
            rows_a, peaks = run_table(title, a_presses, layer, args, False, kvpress_mod)
            markdown.append(markdown_table(title, rows_a, peaks))

    rows = file_rows(rows_a, rows_b, run)
    if not rows:
        sys.exit("compare_kvpress: every press failed, nothing to report")
    title = (f"kvpress-cpp vs kvpress 0.5.5: {shape}, {torch.get_num_threads()} threads\n"
             f"{run['date']}, {run['commit']}, {run['cpu_model']}, kernels {run['kernel_isa']}")
    write_results(args, title, rows, "\n".join(markdown))
    rows = rows_a or rows_b
    speedups = [r["speedup"] for r in rows]
    if not rows_a:
        print("note: table (a) was not run; the summary below is for table (b)")
    print(f"min speedup {min(speedups):.2f}, median speedup {statistics.median(speedups):.2f} over {len(speedups)} presses")
    # A press faster than its floor means the floor model is wrong: the benchmark fails.
    below = [r for r in rows_a + rows_b if r["floor"] is not None and r["ours"] < r["floor"]]
    for r in below:
        print(f"FLOOR MODEL WRONG: {r['press']} ran in {r['ours'] * 1e3:.3f} ms, under its floor of "
              f"{r['floor'] * 1e3:.3f} ms (benchmarks/press_work.h)")
    if below:
        sys.exit(1)


if __name__ == "__main__":
    main()
