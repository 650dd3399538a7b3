"""scripts/make_artifact.py's RestoreKV recipe (`restorekv`): the student's compressed forward, the
restore pass, the training and the folder it writes.

Usage: python test_restorekv_recipe.py /path/to/scripts/make_artifact.py /path/to/model-folder
(the Python needs torch, transformers, peft and kvpress: the project's venv).
"""
import json
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
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM  # noqa: E402

transformers.utils.logging.disable_progress_bar()
check = Checklist()


model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
tok = AutoTokenizer.from_pretrained(str(model_dir))
story = (model_dir.parent.parent / "data" / "tinystories_valid_100.txt").read_text().split(
    make_artifact.STORY_SEPARATOR)[0].strip()
ids = tok(story, return_tensors="pt").input_ids
n, m = 40, 12
context, continuation = ids[:, :n], ids[:, n:n + m]
assert continuation.shape[1] == m, ids.shape

with torch.no_grad():
    full = model(input_ids=torch.cat([context, continuation], 1), use_cache=True)
    past = [(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()) for layer in full.past_key_values.layers]
    layers, hkv = len(past), past[0][0].shape[1]

    # 1. Everything visible: the model's own logits.
    everything = torch.ones(layers, hkv, n, dtype=torch.bool)
    logits = make_artifact.compressed_forward(model, continuation, n, past, everything)
    check("compressed forward, nothing hidden = the model", (logits - full.logits[:, n:]).abs().max().item() < 1e-4,
          f"{(logits - full.logits[:, n:]).abs().max().item()}")

    # 2. Positions hidden in every head = a cache that holds only the others (original positions).
    hidden = torch.tensor([3, 7, 8, 20, 31])
    keep = torch.ones(n, dtype=torch.bool)
    keep[hidden] = False
    cache = DynamicCache()
    for i, (k, v) in enumerate(past):
        cache.update(k[:, :, keep], v[:, :, keep], i)
    positions = torch.arange(n, n + m).unsqueeze(0)
    shrunk = model(input_ids=continuation, past_key_values=cache, position_ids=positions,
                   cache_position=torch.arange(int(keep.sum()), int(keep.sum()) + m)).logits
    masked = make_artifact.compressed_forward(model, continuation, n, past, keep.expand(layers, hkv, n))
    check("compressed forward, hidden positions = a cache without them", (masked - shrunk).abs().max().item() < 1e-4,
          f"{(masked - shrunk).abs().max().item()}")

    # 3. KVzip's keep masks are kvpress's: ratio 0 keeps all, otherwise the budget.
    masks = make_artifact.kvzip_keep_masks(model, context, 0.5)
    check("kvzip masks keep the budget", int(masks.sum()) == layers * hkv * n - int(layers * hkv * n * 0.5),
          str(int(masks.sum())))
    check("kvzip masks at ratio 0 keep everything", bool(make_artifact.kvzip_keep_masks(model, context, 0.0).all()))

# 4. The restore pass with a fresh adapter (LoRA B starts at zero) and token embeddings as restore
# embeddings: the keys/values the model gives those tokens after the context.
from peft import LoraConfig, get_peft_model  # noqa: E402

restore_ids = ids[:, n:n + 3]
adapted = get_peft_model(LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation="sdpa").eval(),
                         LoraConfig(r=2, lora_alpha=4, target_modules=make_artifact.RESTORE_LORA_TARGETS))
with torch.no_grad():
    restored = make_artifact.restore_pass(adapted, model.get_input_embeddings()(restore_ids)[0], past)
    reference = [(layer.keys[:, :, n:n + 3], layer.values[:, :, n:n + 3]) for layer in full.past_key_values.layers]
diff = max(max((a - b).abs().max().item() for a, b in zip(r, f)) for r, f in zip(restored, reference))
check("restore pass with a zero adapter = the tokens' own keys/values", diff < 1e-5, f"{diff}")

# 5. The command: a short training lowers the test KL and writes the authors' folder layout.
with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "restore"
    run = subprocess.run([sys.executable, make_artifact_py, "restorekv", "--model", str(model_dir), "--out", str(out),
                          "--steps", "40", "--num-train", "6", "--num-test", "3", "--num-tokens", "4"],
                         capture_output=True, text=True)
    check("restorekv command", run.returncode == 0, run.stderr[-500:])
    if run.returncode == 0:
        fit = json.loads((out / "fit.json").read_text())
        check("training lowers the test KL", fit["test_kl_restore"] < fit["test_kl_restore_untrained"], str(fit))
        embeddings = load_file(str(out / "restore_embeddings.safetensors"))["restore_embeddings"]
        check("restore_embeddings [4, hidden] float32",
              list(embeddings.shape) == [4, model.config.hidden_size] and embeddings.dtype == torch.float32)
        config = json.loads((out / "adapter_config.json").read_text())
        weights = load_file(str(out / "adapter_model.safetensors"))
        check("a PEFT LoRA adapter on every projection",
              config["peft_type"] == "LORA" and config["r"] == 4
              and len(weights) == 2 * len(make_artifact.RESTORE_LORA_TARGETS) * model.config.num_hidden_layers
              and any(w.abs().max() > 0 for k, w in weights.items() if "lora_B" in k))
    bad = subprocess.run([sys.executable, make_artifact_py, "restorekv", "--model", str(model_dir), "--out",
                          str(Path(tmp) / "bad"), "--ratio", "1"], capture_output=True, text=True)
    check("restorekv refuses a ratio of 1", bad.returncode == 2 and "--ratio must be in (0, 1)" in bad.stderr,
          bad.stderr)
    check("nothing half-written", not (Path(tmp) / "bad").exists() and not list(Path(tmp).glob("*.tmp")))

check.finish()
