"""scripts/make_artifact.py's LU-KV profiling (`lukv`): the convex relaxation, the greedy, the curve.

Usage: python test_lukv_curve.py /path/to/scripts/make_artifact.py /path/to/model-folder
(the Python needs torch, numpy, transformers and kvpress: the project's venv).
"""
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

make_artifact_py = os.path.abspath(sys.argv[1])
model_dir = Path(sys.argv[2])
sys.path.insert(0, os.path.dirname(make_artifact_py))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checklist import Checklist  # noqa: E402
import make_artifact  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

transformers.utils.logging.disable_progress_bar()

check = Checklist()


def hull_slopes(decrements: list[float]) -> list[float]:
    """Per unit step, minus the slope of the lower convex hull of (b, L(b)), L(b) = -sum(d[:b])
    (the loss up to a constant): an independent construction (monotone chain)."""
    points = [(0, 0.0)]
    for b, d in enumerate(decrements, start=1):
        points.append((b, points[-1][1] - d))
    hull = []
    for p in points:
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1]) -
                                  (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(p)
    slopes = []
    for (b0, l0), (b1, l1) in zip(hull, hull[1:]):
        slopes += [-(l1 - l0) / (b1 - b0)] * (b1 - b0)
    return slopes


# 1. The isotonic fit is the convex hull's slopes (the paper's relaxation), non-increasing, same sum.
g = torch.Generator().manual_seed(3)
worst = 0.0
for trial in range(200):
    d = (torch.rand(int(torch.randint(1, 14, (1,), generator=g)), generator=g, dtype=torch.float64) * 4).floor()
    fit = make_artifact.isotonic_nonincreasing(d)
    worst = max(worst, max(abs(a - b) for a, b in zip(fit.tolist(), hull_slopes(d.tolist()))))
    if not (fit[1:] <= fit[:-1] + 1e-12).all() or abs(fit.sum().item() - d.sum().item()) > 1e-9:
        check("isotonic fit is non-increasing with the same sum", False, str(d.tolist()))
        break
check("isotonic fit equals the convex hull's slopes (200 random sequences, ties included)", worst < 1e-12,
      f"max difference {worst}")
check("isotonic fit by hand", make_artifact.isotonic_nonincreasing(torch.tensor([1.0, 5.0, 2.0, 2.0, 3.0])).tolist()
      == [3.0, 3.0, 7 / 3, 7 / 3, 7 / 3])

# 2. The greedy on non-increasing gains is the optimum (exhaustive search), and keeps prefixes.
ok, detail = True, ""
for trial in range(40):
    gains = torch.stack([make_artifact.isotonic_nonincreasing(torch.rand(4, generator=g, dtype=torch.float64))
                         for _ in range(3)])
    totals = list(range(13))
    kept = make_artifact.greedy_budgets(gains, totals)
    for total, row in zip(totals, kept.tolist()):
        best = max(sum(gains[h, :b].sum().item() for h, b in enumerate(split))
                   for split in itertools.product(range(5), repeat=3) if sum(split) == total)
        got = sum(gains[h, :b].sum().item() for h, b in enumerate(row))
        if sum(row) != total or abs(best - got) > 1e-12:
            ok, detail = False, f"total {total}: kept {row}, gain {got}, optimum {best}"
check("greedy budgets reach the exhaustive optimum (40 problems, every total)", ok, detail)
even = make_artifact.greedy_budgets(torch.ones(2, 3, dtype=torch.float64), [1, 2, 3])
check("equal gains: the earlier token, then the lower head", even.tolist() == [[1, 0], [1, 1], [2, 1]],
      str(even.tolist()))

# 3. The curve by hand: head 0's scorer ranks well (oracle 5 then 1), head 1's oracle is flat (3, 3);
# head 2's scorer ranks its tokens the wrong way round (oracle 1 first, then 5): relaxed to 3, 3.
scores = torch.tensor([[[2.0, 1.0], [2.0, 1.0], [2.0, 1.0]]], dtype=torch.float64)  # [L=1, Hkv=3, T=2]
oracle = torch.tensor([[[5.0, 1.0], [3.0, 3.0], [1.0, 5.0]]], dtype=torch.float64)
curve = make_artifact.lukv_curve([scores], [oracle])
# rho 0.5: round(0.5 * 6) = 3 tokens: gains 5 (head 0), then 3, 3, 3, 3 (heads 1, 2; earlier token,
# lower head first) -> head 0 keeps 1, head 1 keeps 1, head 2 keeps 1.
check("curve by hand at 0.5", curve[49, 0].tolist() == [0.5, 0.5, 0.5], str(curve[49, 0].tolist()))
# rho 0.34: round(0.66 * 6) = 4 -> 5, then head 1's first, head 2's first, head 1's second.
check("curve by hand at 0.34", curve[33, 0].tolist() == [0.5, 0.0, 0.5], str(curve[33, 0].tolist()))
# rho 0.17: round(0.83 * 6) = 5 -> head 2's second 3 before head 0's 1.
check("curve by hand at 0.17", curve[16, 0].tolist() == [0.5, 0.0, 0.0], str(curve[16, 0].tolist()))

# 4. Invariants on random samples: in [0, 1]; each head prunes more as the target grows; the mean over
# heads is the target (up to rounding the total budget).
samples = [(torch.rand(3, 2, 20, generator=g, dtype=torch.float64), torch.rand(3, 2, 20, generator=g,
                                                                                 dtype=torch.float64) ** 3)
           for _ in range(4)]
curve = make_artifact.lukv_curve([s for s, _ in samples], [o for _, o in samples])
targets = torch.tensor([1 - round((1 - (i + 1) / 100) * 120) / 120 for i in range(99)], dtype=torch.float64)
check("curve shape [99, L, Hkv]", list(curve.shape) == [99, 3, 2], str(list(curve.shape)))
check("curve in [0, 1]", bool(((curve >= 0) & (curve <= 1)).all()))
check("curve non-decreasing in the target ratio", bool((curve[1:] >= curve[:-1] - 1e-12).all()))
check("curve's mean over heads is the target", (curve.mean(dim=(1, 2)) - targets).abs().max().item() < 1e-12)

# 5. End to end on the bundled model: two contexts of 24 tokens, 4 decoding steps; the oracle is the
# decoding's attention times ||W_O^h v|| (checked against one step by hand), and the command writes
# the file LUKVPress reads.
model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
tok = AutoTokenizer.from_pretrained(str(model_dir))
import kvpress  # noqa: E402

story = (model_dir.parent.parent / "data" / "tinystories_valid_100.txt").read_text().split(
    make_artifact.STORY_SEPARATOR)[0]
context = tok(story.strip(), return_tensors="pt").input_ids[:, :24]
assert context.shape[1] == 24, context.shape
score, one_step = make_artifact.lukv_sample(model, kvpress.KnormPress(), context, 1, sink=4, window=1)
with torch.no_grad():
    out = model(input_ids=context, use_cache=True)
    step = model(input_ids=out.logits[0, -1].argmax().view(1, 1), past_key_values=out.past_key_values,
                 output_attentions=True)
config = model.config
groups = config.num_attention_heads // config.num_key_value_heads
expected = []
for i, layer in enumerate(model.model.layers):
    v = out.past_key_values.layers[i].values[0, :, :24].double().repeat_interleave(groups, 0)  # [Hq, T, D]
    w = layer.self_attn.o_proj.weight.double().view(config.hidden_size, config.num_attention_heads, -1)
    norms = torch.stack([(w[:, h] @ v[h].T).norm(dim=0) for h in range(config.num_attention_heads)])
    expected.append((step.attentions[i][0, :, 0, :24].double() * norms).view(config.num_key_value_heads, groups, -1)
                    .amax(1))
check("oracle of one decoding step by hand", (one_step - torch.stack(expected)).abs().max().item() < 1e-6)
knorm = -torch.stack([out.past_key_values.layers[i].keys[0, :, :24].double().norm(dim=-1) for i in range(2)])
protected = knorm.amax(-1, keepdim=True) + 1
check("scorer's scores with sink and window protected",
      torch.allclose(score[..., 4:23], knorm[..., 4:23])
      and torch.allclose(score[..., :4], protected.expand(-1, -1, 4))
      and torch.allclose(score[..., 23:], protected))

with tempfile.TemporaryDirectory() as tmp:
    out_file = Path(tmp) / "curve.safetensors"
    cmd = [sys.executable, make_artifact_py, "lukv", "--model", str(model_dir), "--out", str(out_file),
           "--num-samples", "2", "--context-len", "24", "--future-len", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    check("lukv command", run.returncode == 0, run.stderr[-400:])
    if run.returncode == 0:
        written = load_file(str(out_file))["budget_curves"]
        again = subprocess.run(cmd[:6] + [str(Path(tmp) / "again.safetensors")] + cmd[7:], capture_output=True)
        check("lukv writes budget_curves [99, L, Hkv] float32",
              list(written.shape) == [99, 2, 4] and written.dtype == torch.float32)
        check("lukv is deterministic",
              again.returncode == 0 and torch.equal(written, load_file(str(Path(tmp) / "again.safetensors"))[
                  "budget_curves"]))
    bad = subprocess.run([sys.executable, make_artifact_py, "lukv", "--model", str(model_dir), "--out",
                          str(Path(tmp) / "x.safetensors"), "--press", "DecodingPress"], capture_output=True, text=True)
    check("lukv refuses a press that is no scorer",
          bad.returncode == 2 and "--press: DecodingPress is not a kvpress ScorerPress" in bad.stderr, bad.stderr)
    check("nothing half-written", not (Path(tmp) / "x.safetensors").exists())

check.finish()
