"""kvpress_cpp.accelerate(): kvpress's own press classes compute through kvpress-cpp.

While acceleration is on, `score()` and `compress()` of the supported kvpress presses
(accelerated_presses()) hand the layer to the library's registry press of the same name, parameters
copied from the kvpress instance. Whatever the library cannot take falls back to kvpress's own
Python, silently unless warn=True: keys outside float32/float16/bfloat16, attention modules other
than Llama-like ones (q_proj/k_proj/o_proj without biases, optionally a per-head q_norm/k_norm as in
Qwen3), a batch whose rows have different positions, a subclass overriding a helper of the scores,
random draws for keys outside the CPU, or any input the library refuses (kvpress then raises its own
error, if any). docs/PYTHON.md has the details.

Results are kvpress's: the same kept positions (modulo ties between equal scores), in kvpress's order:
compress() is kvpress's algorithm (score, torch.topk, gather) with the library's scores and gather.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Callable, Dict, List, Optional

import torch

from . import ops
from .presses import PRESSES

# kvpress presses computed here: scorers whose registry press reproduces kvpress's scores
# (tests/python/test_package.py checks each against kvpress with acceleration off).
ACCELERATED = (
    "KnormPress",
    "StreamingLLMPress",
    "KeyDiffPress",
    "LagKVPress",
    "SnapKVPress",
    "TOVAPress",
    "ObservedAttentionPress",
    "NonCausalAttnPress",
    "ExpectedAttentionPress",
    "RandomPress",
    "LeverageScorePress",
    "CompactorPress",
    "CURPress",
)
# These draw random numbers as kvpress does (the default generator, same shapes and dtype), but on
# the CPU: on another device kvpress draws from that device's generator, so those calls fall back.
_DRAWS_ON_CPU = ("RandomPress", "LeverageScorePress", "CompactorPress", "CURPress")
# Presses scoring from the attention of the last few queries, and how many: where the forward's hidden
# states cover only the newest tokens (a decoding press's step), those queries are computed here as
# kvpress computes them (its get_prerope_query_states, then RoPE) and handed over as `queries`.
_WINDOW_QUERIES = {"SnapKVPress": lambda press: int(press.window_size), "TOVAPress": lambda press: 1}
# Inputs left out for a press: given cos/sin, LeverageScorePress inverts RoPE on the cached keys
# (within ~1e-6 of kvpress's scores, enough to swap near-ties); without them it projects the
# pre-RoPE keys from hidden_states + k_proj, as kvpress does.
_LEFT_OUT = {"LeverageScorePress": ("cos", "sin")}

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Unsupported(Exception):
    """Why one call cannot go through the library (the call falls back to kvpress)."""


@dataclasses.dataclass
class Acceleration:
    """The state of kvpress_cpp.accelerate(): on while this handle is active. Also a context manager:
    `with kvpress_cpp.accelerate(): ...` turns it off again on exit. Counts the calls each way."""

    warn: bool = False
    calls: int = 0  # score/compress calls computed by the library
    fallbacks: int = 0  # calls left to kvpress's Python
    fallback_reasons: Dict[str, int] = dataclasses.field(default_factory=dict)
    _originals: Dict[tuple, Optional[Callable]] = dataclasses.field(default_factory=dict, repr=False)

    def __enter__(self) -> "Acceleration":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Restores kvpress's own methods."""
        global _active
        with _lock:
            for (cls, method), original in self._originals.items():
                if original is None:  # inherited before: remove the patch, the base's method shows again
                    delattr(cls, method)
                else:
                    setattr(cls, method, original)
            self._originals.clear()
            if _active is self:
                _active = None

    def _fallback(self, press, reason: str) -> None:
        self.fallbacks += 1
        key = f"{type(press).__name__}: {reason}"
        self.fallback_reasons[key] = self.fallback_reasons.get(key, 0) + 1
        if self.warn:
            warnings.warn(f"kvpress_cpp: {key}; kvpress's Python computes this call", stacklevel=3)


_lock = threading.Lock()
_active: Optional[Acceleration] = None


def accelerated_presses() -> List[str]:
    """The kvpress press classes accelerate() computes through kvpress-cpp."""
    return list(ACCELERATED)


def is_accelerated() -> bool:
    """True while accelerate() is on."""
    return _active is not None


def accelerate(warn: bool = False) -> Acceleration:
    """Makes kvpress's supported press classes compute through kvpress-cpp until the returned
    handle is closed (or its `with` block ends). warn=True warns at each call that falls back to
    kvpress's Python, with the reason. Calling it again while on returns the active handle."""
    global _active
    import kvpress.presses.scorer_press as scorer_press  # kvpress is needed only here
    import kvpress

    with _lock:
        if _active is not None:
            _active.warn = warn
            return _active
        handle = Acceleration(warn=warn)
        for name in ACCELERATED:
            cls = getattr(kvpress, name)
            handle._originals[(cls, "score")] = cls.__dict__.get("score")  # None: inherited
            cls.score = _accelerated_score(cls.score)
            if cls.compress is scorer_press.ScorerPress.compress:  # no compress of its own
                handle._originals[(cls, "compress")] = cls.__dict__.get("compress")
                cls.compress = _accelerated_compress(cls.compress)
        _active = handle
        return handle


# ---- the calls ------------------------------------------------------------------------------------


def _accelerated_score(original: Callable) -> Callable:
    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        handle = _active
        try:
            name, params, inputs = _translate(self, module, hidden_states, keys, attentions, kwargs)
            with torch.no_grad():  # presses select; nothing differentiates through their scores
                scores = ops.press_scores(name, float(self.compression_ratio), params, keys, values, **inputs)
        except (Unsupported, RuntimeError) as e:
            if handle is not None:
                handle._fallback(self, str(e).splitlines()[0])
            return original(self, module, hidden_states, keys, values, attentions, kwargs)
        if handle is not None:
            handle.calls += 1
        return scores

    score.__doc__ = original.__doc__
    score.__wrapped__ = original
    return score


def _accelerated_compress(original: Callable) -> Callable:
    """kvpress's ScorerPress.compress with the library's scores and gather: the kept tokens in
    kvpress's order (torch.topk's, descending score), so the cache is the one kvpress builds."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)  # accelerated
        with torch.no_grad():
            indices = scores.topk(ops.n_kept(keys.shape[2], float(self.compression_ratio)), dim=-1).indices
            if keys.dtype in _SUPPORTED_DTYPES and values.dtype == keys.dtype:
                return ops.gather_kv(keys, values, indices)
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()

    compress.__doc__ = original.__doc__
    compress.__wrapped__ = original
    return compress


def _translate(press, module, hidden_states, keys, attentions, kwargs):
    """(registry name, params, LayerInputs keyword arguments) for a kvpress press's call, or raises
    Unsupported."""
    name = _registry_name(type(press))
    if keys.dtype not in _SUPPORTED_DTYPES:
        raise Unsupported(f"keys of dtype {keys.dtype}")
    if name in _DRAWS_ON_CPU and keys.device.type != "cpu":
        raise Unsupported(f"random draws on {keys.device.type} (kvpress-cpp draws on the CPU)")
    params = _press_params(press, PRESSES[name])
    inputs: dict = {}
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):
        inputs["num_heads"] = int(config.num_attention_heads)
    if getattr(module, "layer_idx", None) is not None and hasattr(config, "num_hidden_layers"):
        inputs["layer_idx"], inputs["num_layers"] = int(module.layer_idx), int(config.num_hidden_layers)
    if attentions is not None:
        inputs["attentions"] = attentions
    # The hidden states and RoPE tables describe the forward pass's new tokens. They go along only
    # when those are every cached token (a prefill); after earlier tokens (decoding, chunked prefill)
    # presses that need them refuse, and kvpress computes the call.
    seq = keys.shape[2]
    if hidden_states is not None and hidden_states.shape[1] == seq and hasattr(module, "q_proj"):
        inputs.update(_projections(module))
        inputs["hidden_states"] = hidden_states
    position_embeddings = (kwargs or {}).get("position_embeddings")
    if position_embeddings is not None:
        cos, sin = position_embeddings
        if cos.dim() == 3:  # [B, S, D]: one table for every row
            if cos.shape[0] > 1 and not (torch.equal(cos, cos[:1].expand_as(cos)) and torch.equal(sin, sin[:1].expand_as(sin))):
                raise Unsupported("batch rows at different positions")
            cos, sin = cos[0], sin[0]
        if cos.shape[0] == seq:
            inputs["cos"], inputs["sin"] = cos, sin
        elif name in _WINDOW_QUERIES and hidden_states is not None:
            window = _WINDOW_QUERIES[name](press)
            rows = min(window, cos.shape[0])
            if hidden_states.shape[1] > window and rows in (1, window):  # else kvpress refuses, or we leave it
                from kvpress.utils import get_prerope_query_states

                # kvpress's own computation: the window's pre-RoPE queries, rotated by the last `window`
                # rows of the forward's RoPE table. A decoding press's forward has one row (the new
                # token's), which kvpress then applies to every buffered query; so does this.
                with torch.no_grad():
                    queries = get_prerope_query_states(module, hidden_states[:, -window:])
                    c, s = cos[-rows:], sin[-rows:]
                    inputs["queries"] = queries * c + ops.rotate_half(queries) * s
    for field in _LEFT_OUT.get(name, ()):
        inputs.pop(field, None)
    return name, params, inputs


def _registry_name(cls: type) -> str:
    """The supported kvpress class that cls is or derives from. A subclass is computed as that class
    when it overrides none of the class's methods but compress (PyramidKVPress: SnapKVPress's scores,
    its own layer budgets); one that overrides a helper of the scores falls back."""
    mro = cls.__mro__
    base = next((c for c in mro if c.__name__ in ACCELERATED and c.__module__.startswith("kvpress.")), None)
    if base is None:
        raise Unsupported("not a press kvpress-cpp accelerates")
    methods = {k for k, v in vars(base).items() if not k.startswith("__") and k != "compress"
               and (callable(v) or isinstance(v, (staticmethod, classmethod, property)))}
    for klass in mro[: mro.index(base)]:
        overridden = sorted(methods & set(vars(klass)))
        if overridden:
            raise Unsupported(f"{cls.__name__} overrides {base.__name__}'s {', '.join(overridden)}")
    return base.__name__


def _projections(module) -> dict:
    """The attention module's projection weights (and Qwen3's q_norm/k_norm), Llama-like modules only."""
    out = {}
    for field in ("q_proj", "k_proj", "o_proj"):
        layer = getattr(module, field, None)
        if layer is None:
            continue
        # Any module computing x W^T alike (nn.Linear, or a class of the same shape): a 2-D weight, no bias.
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise Unsupported(f"{field} ({type(layer).__name__}) has no 2-D weight")
        if getattr(layer, "bias", None) is not None:
            raise Unsupported(f"{field} has a bias")
        out[field] = weight
    for field in ("q_norm", "k_norm"):
        norm = getattr(module, field, None)
        if norm is None:
            continue
        weight = getattr(norm, "weight", None)
        if weight is None or type(norm).__name__ not in ("Qwen3RMSNorm", "LlamaRMSNorm"):
            raise Unsupported(f"{field} is a {type(norm).__name__}")
        out[field] = weight
        out["norm_eps"] = float(getattr(norm, "variance_epsilon", 1e-6))
    return out


def _press_params(press, ours: type) -> Dict[str, str]:
    """The kvpress instance's parameters that the registry press has, as text. Parameters only the
    library has (a `seed` kvpress lacks) keep their defaults, which behave as kvpress does."""
    return {field.name: ops._param_text(getattr(press, field.name)) for field in dataclasses.fields(ours)
            if field.name != "compression_ratio" and hasattr(press, field.name)}
