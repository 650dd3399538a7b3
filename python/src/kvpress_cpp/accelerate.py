"""kvpress_cpp.accelerate(): kvpress's own press classes compute through kvpress-cpp.

While acceleration is on, `score()` and `compress()` of the supported kvpress presses
(accelerated_presses()) hand the layer to the library's registry press of the same name, parameters
copied from the kvpress instance. A call falls back to kvpress's own Python only for a reason named
in REASONS, found by checks made here before the library is called: keys outside
float32/float16/bfloat16, random draws off the CPU, an attention module that is not Llama-like, batch
rows at different positions, a subclass overriding a helper of the scores, a field value the library
cannot honour, inputs the library press needs and the call lacks, or an input kvpress's own method
refuses (kvpress then raises its own error). Each fallback is counted per press and reason on the
handle (report(), counts()); strict=True (or KVPRESS_CPP_STRICT=1) raises Unsupported instead. Any
other error, the library's included, reaches the caller. docs/PYTHON.md has the details.

Results are kvpress's: the same kept positions (modulo ties between equal scores), in kvpress's order:
compress() is kvpress's algorithm (score, torch.topk, gather) with the library's scores and gather.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import sys
import threading
import warnings
from typing import Callable, Dict, List, Optional, TextIO, Tuple

import torch

from . import ops
from .presses import CATALOG

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

# The only reasons a call falls back to kvpress's Python (Unsupported.reason), and what each means.
REASONS: Dict[str, str] = {
    "dtype": "keys or values outside float32/float16/bfloat16, or of two dtypes",
    "device": "keys on a device other than the CPU and CUDA, or off the CPU for a press drawing random numbers",
    "module": "an attention module that is not Llama-like (a projection with a bias or without a 2-D weight, "
              "another norm than Llama's/Qwen3's RMSNorm, no q_proj/k_proj)",
    "batch_positions": "rows of one batch at different positions (kvpress-cpp takes one RoPE table per call)",
    "variant": "a subclass overriding a helper of the scores",
    "parameter": "a field value kvpress-cpp cannot honour (the detail names the field)",
    "inputs": "inputs the library press needs and the call lacks (a decoding step's or chunk's hidden states "
              "cover only the newest tokens)",
    "kvpress_refuses": "an input kvpress's own method refuses (kvpress then raises its own error)",
}

# These draw random numbers as kvpress does (the default generator, same shapes and dtype), but on
# the CPU: on another device kvpress draws from that device's generator, so those calls fall back.
_DRAWS_ON_CPU: Dict[str, Callable[[object], bool]] = {
    "RandomPress": lambda press: True,
    "LeverageScorePress": lambda press: True,
    "CompactorPress": lambda press: True,
    "CURPress": lambda press: bool(press.use_random_leverage),
}
# Presses scoring from the attention of the last few queries, and how many: where the forward's hidden
# states cover only the newest tokens (a decoding press's step), those queries are computed here as
# kvpress computes them (its get_prerope_query_states, then RoPE) and handed over as `queries`.
_WINDOW_QUERIES = {"SnapKVPress": lambda press: int(press.window_size), "TOVAPress": lambda press: 1}
# Inputs left out for a press: given cos/sin, LeverageScorePress inverts RoPE on the cached keys
# (within ~1e-6 of kvpress's scores, enough to swap near-ties); without them it projects the
# pre-RoPE keys from hidden_states + k_proj, as kvpress does.
_LEFT_OUT = {"LeverageScorePress": ("cos", "sin")}
# Presses whose kvpress code rotates the queries by the last rows of a longer RoPE table
# (NonCausalAttnPress: cos[:, -q_len:]), as under ChunkPress, whose chunks get the whole forward's
# table: those rows go along. The others refuse such a table ("inputs").
_LAST_ROPE_ROWS = ("NonCausalAttnPress",)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DEVICES = ("cpu", "cuda")  # the devices the library is built and tested for
_INT64_MAX = 2**63 - 1


class Unsupported(Exception):
    """A call kvpress-cpp does not compute: the press's class name, the reason (a key of REASONS)
    and a detail. Without strict, the call falls back to kvpress's Python; with it, this is raised."""

    def __init__(self, press, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"Unsupported: reason must be one of {sorted(REASONS)}, got {reason!r}")
        self.press = press if isinstance(press, str) else type(press).__name__
        self.reason = reason
        self.detail = detail
        super().__init__(f"{self.press}: {reason}" + (f": {detail}" if detail else ""))

    def __reduce__(self):  # the three arguments, not the message (pickling, multiprocessing)
        return type(self), (self.press, self.reason, self.detail)


# ---- every kvpress field, mapped or a named fallback ------------------------------------------------
# A check takes a field's value and the press and returns what the library cannot honour about it
# (None: fine). A failing check makes the call fall back with reason "parameter", naming the field.


def _integer(low: int) -> Callable[[object, object], Optional[str]]:
    def check(value, press):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return "is not an integer"
        if not low <= value <= _INT64_MAX:
            return f"is outside [{low}, 2**63)"
        return None
    return check


def _odd_positive(value, press) -> Optional[str]:
    return _integer(1)(value, press) or (None if value % 2 == 1 else "is even (the pooling needs an odd width)")


def _flag(value, press) -> Optional[str]:
    return None if isinstance(value, bool) else "is not a bool"


def _real(low: Optional[float] = None, optional: bool = False) -> Callable[[object, object], Optional[str]]:
    def check(value, press):
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return "is not a finite number"
        if low is not None and value < low:
            return f"is below {low}"
        return None
    return check


def _ratio(value, press) -> Optional[str]:
    return _real(0.0)(value, press) or (None if value < 1 else "is not below 1")


def _seed(value, press) -> Optional[str]:
    # kvpress seeds torch.Generator with any integer; the library's seed is a non-negative int64
    # (its -1 means unset).
    return None if value is None else _integer(0)(value, press)


def _choice(*options: str) -> Callable[[object, object], Optional[str]]:
    def check(value, press):
        return None if value in options else f"is not one of {', '.join(options)}"
    return check


def _derived(cls_name: str, **same_as) -> Callable[[object, object], Optional[str]]:
    """CompactorPress's inner presses: the library builds them from the outer press's fields, as
    kvpress's __post_init__ does; one the caller replaced or changed is not the one it would build."""
    def check(value, press):
        import kvpress

        cls = getattr(kvpress, cls_name)
        if type(value) is not cls:
            return f"is a {type(value).__name__}, not the {cls_name} built from the press's fields"
        built = cls(**{inner: getattr(press, outer) for inner, outer in same_as.items()})
        differ = [f.name for f in dataclasses.fields(cls)
                  if f.name != "compression_ratio" and getattr(value, f.name) != getattr(built, f.name)]
        return f"has {', '.join(differ)} unlike the press's own" if differ else None
    return check


# Every dataclass field of each accelerated kvpress press, with the check of its value. A field is
# handed to the registry press's parameter of the same name (compression_ratio: the ratio argument)
# unless it is in _NOT_PASSED, where its check accepts only what the library computes anyway.
# tests/python/test_package.py fails if a field of kvpress's classes is missing here; at run time a
# field missing here (a newer kvpress) makes the call fall back unless it holds its default.
_FIELDS: Dict[str, Dict[str, Callable[[object, object], Optional[str]]]] = {
    "KnormPress": {"compression_ratio": _ratio},
    "StreamingLLMPress": {"compression_ratio": _ratio, "n_sink": _integer(0)},
    "KeyDiffPress": {"compression_ratio": _ratio},
    "LagKVPress": {"compression_ratio": _ratio, "n_sink": _integer(0), "lag_size": _integer(1),
                   "cross_scoring": _flag},
    "SnapKVPress": {"compression_ratio": _ratio, "window_size": _integer(1), "kernel_size": _odd_positive},
    "TOVAPress": {"compression_ratio": _ratio},
    "ObservedAttentionPress": {"compression_ratio": _ratio},
    "NonCausalAttnPress": {"compression_ratio": _ratio, "chunk_size": _integer(1)},
    "ExpectedAttentionPress": {"compression_ratio": _ratio, "n_future_positions": _integer(1), "n_sink": _integer(0),
                               "use_covariance": _flag, "use_vnorm": _flag, "epsilon": _real(0.0)},
    "RandomPress": {"compression_ratio": _ratio, "seed": _seed},
    "LeverageScorePress": {"compression_ratio": _ratio, "sketch_dimension": _integer(1)},
    "CompactorPress": {"compression_ratio": _ratio, "sink_size_start": _integer(0), "sink_size_end": _integer(0),
                       "chunk_size": _integer(1), "sketch_dimension": _integer(1),
                       "blending": _real(optional=True),
                       "_leverage_press": _derived("LeverageScorePress", sketch_dimension="sketch_dimension"),
                       "_non_causal_press": _derived("NonCausalAttnPress", chunk_size="chunk_size")},
    "CURPress": {"compression_ratio": _ratio, "num_sinks": _integer(0),
                 "leverage_type": _choice("kv_product", "key", "value", "kv_avg"),
                 "use_random_leverage": _flag, "use_local_approximation": _flag, "local_window_size": _integer(1)},
}
_NOT_PASSED = {"CompactorPress": ("_leverage_press", "_non_causal_press")}
# Registry parameters kvpress lacks, left at their defaults, which behave as kvpress does: seeds of
# the library's own generators (unset: torch's default generator, as kvpress draws), and Compactor's
# per-head selection (kvpress's).
CPP_ONLY: Dict[str, Tuple[str, ...]] = {"LeverageScorePress": ("seed",), "CompactorPress": ("seed", "selection"),
                                        "CURPress": ("seed",)}


def mapped_fields(name: str) -> Dict[str, str]:
    """For an accelerated press: kvpress field -> the registry parameter it is handed to
    ("compression_ratio": the ratio argument). The other fields of _FIELDS only decide fallbacks."""
    return {field: field for field in _FIELDS[name] if field not in _NOT_PASSED.get(name, ())}


def fallback_fields(name: str) -> List[str]:
    """For an accelerated press: the kvpress fields not handed to the library, whose values other than
    the ones the library computes anyway make a call fall back."""
    return list(_NOT_PASSED.get(name, ()))


# ---- the handle -------------------------------------------------------------------------------------


def _strict_from_env() -> bool:
    """KVPRESS_CPP_STRICT: unset, "" or "0" off, "1" on; anything else is an error."""
    value = os.environ.get("KVPRESS_CPP_STRICT", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"KVPRESS_CPP_STRICT must be unset, empty, 0 or 1, got {value!r}")
    return value == "1"


@dataclasses.dataclass(eq=False)  # handles compare by identity: close() finds this one among equals
class Acceleration:
    """One accelerate() call: acceleration stays on while any handle is open. A context manager too:
    `with kvpress_cpp.accelerate(): ...` closes this handle on exit. Counts the calls made while it is
    open, per press and per fallback reason; warn/strict apply while it is the innermost handle."""

    warn: bool = False
    strict: bool = False
    calls: int = 0  # score calls computed by the library
    fallbacks: int = 0  # calls left to kvpress's Python (or raised, with strict)
    fallback_reasons: Dict[str, int] = dataclasses.field(default_factory=dict)  # "Press: reason: detail" -> n
    _per_press: Dict[str, Dict[str, int]] = dataclasses.field(default_factory=dict, repr=False)

    def __enter__(self) -> "Acceleration":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def active(self) -> bool:
        """True until close()."""
        return self in _stack

    def close(self) -> None:
        """Ends this handle (idempotent). The outer handle's options apply again; closing the last open
        handle restores kvpress's own methods."""
        with _lock:
            if self not in _stack:
                return
            _stack.remove(self)
            if not _stack:
                _restore()

    def counts(self) -> Dict[str, Dict[str, object]]:
        """Per kvpress class (the instance's): {"calls": n, "fallbacks": n, "reasons": {reason: n}}."""
        with _lock:
            return {press: {"calls": c.get("calls", 0), "fallbacks": sum(n for r, n in c.items() if r != "calls"),
                            "reasons": {r: n for r, n in sorted(c.items()) if r != "calls"}}
                    for press, c in sorted(self._per_press.items())}

    def report(self, file: Optional[TextIO] = None, quiet: bool = False) -> str:
        """A table of calls and fallbacks per press and reason, then each fallback's detail; returned,
        and written to `file` (None: sys.stdout at the time of the call) unless quiet."""
        counts = self.counts()
        rows = [("press", "calls", "fallbacks", "reasons")]
        rows += [(press, str(c["calls"]), str(c["fallbacks"]),
                  ", ".join(f"{r} {n}" for r, n in c["reasons"].items()) or "-") for press, c in counts.items()]
        rows.append(("total", str(self.calls), str(self.fallbacks), ""))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows]
        if self.fallback_reasons:
            lines.append("fallbacks:")
            lines += [f"  {n:6d}  {key}" for key, n in sorted(self.fallback_reasons.items(), key=lambda kv: -kv[1])]
        text = "\n".join(lines) + "\n"
        if not quiet:
            (file or sys.stdout).write(text)
        return text

    def _record_call(self, press: str) -> None:
        self.calls += 1
        entry = self._per_press.setdefault(press, {})
        entry["calls"] = entry.get("calls", 0) + 1

    def _record_fallback(self, error: Unsupported) -> None:
        self.fallbacks += 1
        entry = self._per_press.setdefault(error.press, {})
        entry[error.reason] = entry.get(error.reason, 0) + 1
        key = str(error)
        self.fallback_reasons[key] = self.fallback_reasons.get(key, 0) + 1


_lock = threading.RLock()
_stack: List[Acceleration] = []  # the open handles, innermost last
_originals: Dict[tuple, Optional[Callable]] = {}  # (class, method) -> kvpress's own (None: inherited)


def accelerated_presses() -> List[str]:
    """The kvpress press classes accelerate() computes through kvpress-cpp."""
    return list(ACCELERATED)


def is_accelerated() -> bool:
    """True while any accelerate() handle is open."""
    return bool(_stack)


def accelerate(warn: bool = False, strict: Optional[bool] = None) -> Acceleration:
    """Makes kvpress's supported press classes compute through kvpress-cpp until the returned handle
    is closed (or its `with` block ends). warn=True warns at each call that falls back to kvpress's
    Python, with the reason; strict=True raises Unsupported instead of falling back (None: the
    KVPRESS_CPP_STRICT environment variable, "1" on). Calls nest: an inner handle's warn/strict apply
    until it closes, every open handle counts the calls, and kvpress's methods come back when the last
    one closes."""
    strict = _strict_from_env() if strict is None else bool(strict)
    handle = Acceleration(warn=bool(warn), strict=strict)
    with _lock:
        if not _stack:
            _patch()
        _stack.append(handle)
    return handle


def _patch() -> None:
    import kvpress.presses.scorer_press as scorer_press  # kvpress is needed only here
    import kvpress

    for name in ACCELERATED:
        cls = getattr(kvpress, name)
        _originals[(cls, "score")] = cls.__dict__.get("score")  # None: inherited
        cls.score = _accelerated_score(cls.score)
        if cls.compress is scorer_press.ScorerPress.compress:  # no compress of its own
            _originals[(cls, "compress")] = cls.__dict__.get("compress")
            cls.compress = _accelerated_compress(cls.compress)


def _restore() -> None:
    for (cls, method), original in _originals.items():
        if original is None:  # inherited before: remove the patch, the base's method shows again
            delattr(cls, method)
        else:
            setattr(cls, method, original)
    _originals.clear()


# ---- the calls ------------------------------------------------------------------------------------


def _accelerated_score(original: Callable) -> Callable:
    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        with _lock:
            handles = list(_stack)
        if not handles:  # a reference kept past the last close()
            return original(self, module, hidden_states, keys, values, attentions, kwargs)
        try:
            name, params, inputs = _translate(self, module, hidden_states, keys, values, attentions, kwargs)
        except Unsupported as e:
            with _lock:
                for handle in handles:
                    handle._record_fallback(e)
            if handles[-1].strict:
                raise
            if handles[-1].warn:
                warnings.warn(f"kvpress_cpp: {e}; kvpress's Python computes this call", stacklevel=2)
            return original(self, module, hidden_states, keys, values, attentions, kwargs)
        with torch.no_grad():  # presses select; nothing differentiates through their scores
            scores = ops.press_scores(name, float(self.compression_ratio), params, keys, values, **inputs)
        with _lock:
            for handle in handles:
                handle._record_call(type(self).__name__)
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
            if keys.dtype in _SUPPORTED_DTYPES and values.dtype == keys.dtype and keys.device.type in _DEVICES:
                return ops.gather_kv(keys, values, indices)
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()

    compress.__doc__ = original.__doc__
    compress.__wrapped__ = original
    return compress


def _translate(press, module, hidden_states, keys, values, attentions, kwargs):
    """(registry name, params, LayerInputs keyword arguments) for a kvpress press's call, or raises
    Unsupported. The inputs the library would refuse and kvpress accepts (or refuses itself) are
    checked here first; whatever else the library refuses raises its error to the caller."""
    name, base = _registry_name(press)
    if keys.dtype not in _SUPPORTED_DTYPES or values.dtype != keys.dtype:
        raise Unsupported(press, "dtype", f"keys of dtype {keys.dtype}" if values.dtype == keys.dtype
                          else f"keys of dtype {keys.dtype}, values of dtype {values.dtype}")
    if keys.device.type not in _DEVICES:
        raise Unsupported(press, "device", f"keys on {keys.device.type}")
    if keys.device.type != "cpu" and _DRAWS_ON_CPU.get(name, lambda p: False)(press):
        raise Unsupported(press, "device", f"random draws on {keys.device.type} (kvpress-cpp draws on the CPU)")
    params = _press_params(press, name, base)
    _kvpress_refuses(press, name, hidden_states, keys, attentions)
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
    # presses that need them fall back ("inputs"), and kvpress computes the call.
    seq = keys.shape[2]
    module_problem: Optional[Unsupported] = None  # raised only if the press needs the projections
    if hidden_states is not None and hidden_states.shape[1] == seq:
        inputs["hidden_states"] = hidden_states
        try:
            inputs.update(_projections(press, module))
        except Unsupported as e:
            module_problem = e
    position_embeddings = (kwargs or {}).get("position_embeddings")
    if position_embeddings is not None:
        cos, sin = position_embeddings
        if cos.dim() == 3:  # [B, S, D]: one table for every row
            if cos.shape[0] > 1 and not (torch.equal(cos, cos[:1].expand_as(cos)) and torch.equal(sin, sin[:1].expand_as(sin))):
                raise Unsupported(press, "batch_positions", "the RoPE tables differ between the batch's rows")
            cos, sin = cos[0], sin[0]
        if cos.shape[0] == seq:
            inputs["cos"], inputs["sin"] = cos, sin
        elif name in _LAST_ROPE_ROWS and cos.shape[0] > seq and "hidden_states" in inputs:
            inputs["cos"], inputs["sin"] = cos[-seq:], sin[-seq:]
        elif name in _WINDOW_QUERIES and hidden_states is not None:
            window = _WINDOW_QUERIES[name](press)
            rows = min(window, cos.shape[0])
            if hidden_states.shape[1] > window and rows in (1, window):  # else the needs check refuses
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
    rope_rows = None if position_embeddings is None else position_embeddings[0].shape[-2]
    _check_needs(press, name, inputs, seq, hidden_states, rope_rows, module_problem)
    return name, params, inputs


def _registry_name(press) -> Tuple[str, type]:
    """(name, class): the supported kvpress class that the press's class is or derives from. A
    subclass is computed as that class when it overrides none of the class's methods but compress
    (PyramidKVPress: SnapKVPress's scores, its own layer budgets); one that overrides a helper of
    the scores falls back."""
    cls = type(press)
    mro = cls.__mro__
    base = next((c for c in mro if c.__name__ in ACCELERATED and c.__module__.startswith("kvpress.")), None)
    if base is None:
        raise Unsupported(press, "variant", "not derived from a press kvpress-cpp accelerates")
    methods = {k for k, v in vars(base).items() if not k.startswith("__") and k != "compress"
               and (callable(v) or isinstance(v, (staticmethod, classmethod, property)))}
    for klass in mro[: mro.index(base)]:
        overridden = sorted(methods & set(vars(klass)))
        if overridden:
            raise Unsupported(press, "variant", f"{cls.__name__} overrides {base.__name__}'s {', '.join(overridden)}")
    return base.__name__, base


def _press_params(press, name: str, base: type) -> Dict[str, str]:
    """The registry parameters from the kvpress instance's fields (those of `base`, the accelerated
    class: a subclass's own fields serve its own methods, not the scores), as text. Raises
    Unsupported ("parameter") for a value the library cannot honour, naming the field."""
    checks = _FIELDS[name]
    params: Dict[str, str] = {}
    for field in _dataclass_fields(base):
        value = getattr(press, field.name)
        if field.name not in checks:  # a field this version does not know: only its default is safe
            if field.default is dataclasses.MISSING or not _same(value, field.default):
                raise Unsupported(press, "parameter", f"{field.name}={value!r} (a field kvpress-cpp does not map)")
            continue
        problem = checks[field.name](value, press)
        if problem:
            raise Unsupported(press, "parameter", f"{field.name}={_short(value)} {problem}")
        if field.name != "compression_ratio" and field.name not in _NOT_PASSED.get(name, ()):
            params[field.name] = _param_text(value)
    return params


def _kvpress_refuses(press, name: str, hidden_states, keys, attentions) -> None:
    """kvpress's own assertions on the call's inputs: the library refuses these too, and falling back
    lets kvpress raise its own error (which kvpress's tests may expect)."""
    seq = keys.shape[2]
    if name in ("StreamingLLMPress", "ExpectedAttentionPress") and seq <= press.n_sink:
        raise Unsupported(press, "kvpress_refuses", "no more tokens than n_sink")
    if name == "SnapKVPress" and (hidden_states is None or hidden_states.shape[1] <= press.window_size):
        raise Unsupported(press, "kvpress_refuses", "hidden states no longer than window_size")
    if name == "ObservedAttentionPress" and attentions is None:
        raise Unsupported(press, "kvpress_refuses", "no attention weights (attn_implementation must be eager)")
    if name in ("LeverageScorePress", "NonCausalAttnPress", "CompactorPress") and (
            hidden_states is None or hidden_states.shape[-2] != seq):
        raise Unsupported(press, "kvpress_refuses", "prefill only: the hidden states do not cover every cached token")
    if name == "ExpectedAttentionPress" and keys.shape[-1] % 2:
        raise Unsupported(press, "kvpress_refuses", "an odd head_dim (RoPE needs an even one)")


def _check_needs(press, name: str, inputs: dict, seq: int, hidden_states, rope_rows: Optional[int],
                 module_problem: Optional[Unsupported]) -> None:
    """The registry's own statement of the inputs a press reads: one of its alternatives, and its
    required fields, must all be in `inputs` (queries/attentions covering every position where the
    alternative says so). Raises Unsupported ("module" or "inputs") otherwise."""
    spec = _INPUTS[name]

    def covers(alternative: dict) -> bool:
        if not all(f in inputs for f in alternative["fields"]):
            return False
        return not alternative["all_positions"] or all(
            inputs[f].shape[-2] == seq for f in alternative["fields"] if f in ("queries", "attentions"))

    alternatives = spec["alternatives"]
    if all(f in inputs for f in spec["required"]) and (not alternatives or any(covers(a) for a in alternatives)):
        return
    if module_problem is not None:
        raise module_problem
    if hidden_states is not None and hidden_states.shape[1] != seq:
        detail = "the hidden states cover only the newest tokens (a decoding step or a chunk)"
    elif rope_rows is not None and rope_rows != seq and any("cos" in a["fields"] for a in alternatives):
        detail = "the RoPE table's rows are not the call's tokens (a chunk of a longer forward: ChunkPress)"
    else:
        detail = f"no {' or '.join('+'.join(a['fields']) for a in alternatives) or ', '.join(spec['required'])}"
    raise Unsupported(press, "inputs", detail)


def _projections(press, module) -> dict:
    """The attention module's projection weights and biases (Qwen2's), and Qwen3's q_norm/k_norm,
    Llama-like modules only."""
    out = {}
    if not hasattr(module, "q_proj") or not hasattr(module, "k_proj"):
        raise Unsupported(press, "module", f"{type(module).__name__} has no q_proj/k_proj")
    for field in ("q_proj", "k_proj", "o_proj"):
        layer = getattr(module, field, None)
        if layer is None:
            continue
        # Any module computing x W^T + b alike (nn.Linear, or a class of the same shape): a 2-D weight.
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise Unsupported(press, "module", f"{field} ({type(layer).__name__}) has no 2-D weight")
        out[field] = weight
        bias = getattr(layer, "bias", None)
        # o_proj's bias is not an input: the presses that read o_proj (kvpress's CriticalKV) read its weight only.
        if bias is not None and field != "o_proj":
            out[field[0] + "_bias"] = bias
    for field in ("q_norm", "k_norm"):
        norm = getattr(module, field, None)
        if norm is None:
            continue
        weight = getattr(norm, "weight", None)
        if weight is None or type(norm).__name__ not in ("Qwen3RMSNorm", "LlamaRMSNorm"):
            raise Unsupported(press, "module", f"{field} is a {type(norm).__name__}")
        out[field] = weight
        out["norm_eps"] = float(getattr(norm, "variance_epsilon", 1e-6))
    return out


# The registry's inputs per accelerated press (alternatives, required), from the library itself.
_INPUTS = {p["name"]: p["inputs"] for p in CATALOG["presses"] if p["name"] in ACCELERATED}
_FIELD_CACHE: Dict[type, tuple] = {}


def _dataclass_fields(cls: type) -> tuple:
    if cls not in _FIELD_CACHE:
        _FIELD_CACHE[cls] = dataclasses.fields(cls)
    return _FIELD_CACHE[cls]


def _same(value, default) -> bool:
    try:
        return bool(value == default)
    except Exception:  # a tensor or another value without a plain equality: not the default
        return False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _param_text(value) -> str:
    """A checked field value as the registry parses it (numpy scalars as plain numbers)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return ops._param_text(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return repr(float(value))
