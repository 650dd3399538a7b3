"""A Python class per press of kvpress-cpp's registry, with kvpress's class name, parameters and
defaults, computing on the library's kernels.

The classes are built from the registry itself (ops.registry_json(): names, kinds, parameters, types,
defaults and help), so they cannot drift from the C++ presses. Each is a dataclass:

    press = SnapKVPress(compression_ratio=0.5, window_size=32)
    keys, values, kept = press.compress(keys, values, queries=queries)   # queries [B, Hq, >=32, D]
    scores = press.score(keys, values, queries=queries)                  # ScorerPress kinds only

Wrappers take their inner press as an instance (or its name), as kvpress does, and by default its
compression ratio: AdaKVPress(SnapKVPress(0.5)). compress()/score() take the layer's inputs as
keyword arguments, named as the LayerInputs fields (ops.press_compress lists them).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional, Tuple, Union

from torch import Tensor

from . import ops

CATALOG: dict = json.loads(ops.registry_json())

_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "path": str, "int?": Optional[int],
          "float?": Optional[float]}


def _default(param: dict):
    """The registry's default text as a Python value of the parameter's type."""
    kind, text = param["type"], param["default"]
    if text == "None":
        return None
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    if kind == "bool":
        return text == "true"
    return text


class Press:
    """Base of every press class: its registry name and kind, and the calls on one layer."""

    name: str = ""  # the registry's (kvpress's) class name
    kind: str = ""  # "scorer", "wrapper", "decoding", "second_pass", "channel", "layer", "query_aware"

    def ratio(self) -> float:
        """The compression ratio the registry builds the press with."""
        own = getattr(self, "compression_ratio", 0.0)
        if own is None:  # a wrapper without its own ratio takes its inner press's, as in kvpress
            inner = getattr(self, "press", None)
            own = inner.ratio() if isinstance(inner, Press) else 0.0
        return float(own)

    def params(self) -> Dict[str, str]:
        """Parameters as the registry takes them (text), inner presses flattened ("press.window_size")."""
        out: Dict[str, str] = {}
        for field in dataclasses.fields(self):
            if field.name == "compression_ratio":
                continue
            value = getattr(self, field.name)
            if isinstance(value, Press):
                out[field.name] = value.name
                out.update({f"{field.name}.{k}": v for k, v in value.params().items()})
            elif isinstance(value, (list, tuple)):
                out[field.name] = ",".join(v.name if isinstance(v, Press) else ops._param_text(v) for v in value)
            else:
                out[field.name] = ops._param_text(value)
        return out

    def compress(self, keys: Tensor, values: Tensor, **inputs) -> Tuple[Tensor, Tensor, Tensor]:
        """keys/values [B, Hkv, S, D] and the layer's other inputs -> (keys [B, Hkv, n, D], values,
        kept positions [B, Hkv, n], ascending)."""
        return ops.press_compress(self.name, self.ratio(), self.params(), keys, values, **inputs)

    def compress_ragged(self, keys: Tensor, values: Tensor, **inputs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """For presses whose heads keep different numbers of tokens: -> (keys [T, D], values [T, D],
        positions [T], lengths [B, Hkv]), every head's kept tokens packed one after another."""
        return ops.press_compress_ragged(self.name, self.ratio(), self.params(), keys, values, **inputs)

    def score(self, keys: Tensor, values: Tensor, **inputs) -> Tensor:
        """The press's scores [B, Hkv, S] (higher = keep); ScorerPress kinds only."""
        if self.kind != "scorer":
            raise TypeError(f"{self.name}.score: only scorer presses have scores, this one is a {self.kind} press")
        return ops.press_scores(self.name, self.ratio(), self.params(), keys, values, **inputs)


def _make_class(info: dict) -> type:
    fields: List[tuple] = []
    wraps = any(p["name"] in ("press", "presses") for p in info["params"])
    if not info["no_ratio"] and not wraps:
        fields.append(("compression_ratio", float, dataclasses.field(default=0.0)))
    for p in info["params"]:
        hint = _TYPES[p["type"]]
        if p["name"] in ("press", "presses", "prefilling_press", "decoding_press"):
            hint = Union[Press, str, list, None]
        fields.append((p["name"], hint, dataclasses.field(default=_default(p))))
    if wraps and not info["no_ratio"]:  # kvpress's wrappers read their inner press's ratio
        fields.append(("compression_ratio", Optional[float], dataclasses.field(default=None, kw_only=True)))
    doc = [f"{info['name']} ({info['kind']}): {info['summary']}", "", f"Reads: {info['needs'] or 'keys, values'}"]
    if info["no_ratio"]:
        doc.append(f"No compression ratio: {info['no_ratio']}")
    if info["params"]:
        doc += ["", "Parameters (kvpress's names and defaults):"]
        doc += [
            f"  {p['name']} ({p['type']}, default {p['default'] or 'none'}"
            + (f"; {p['accepts']}" if p["accepts"] else "")
            + f"): {p['help']}"
            for p in info["params"]
        ]
    cls = dataclasses.make_dataclass(info["name"], fields, bases=(Press,),
                                     namespace={"name": info["name"], "kind": info["kind"], "__doc__": "\n".join(doc)})
    cls.__module__ = __name__
    return cls


PRESSES: Dict[str, type] = {info["name"]: _make_class(info) for info in CATALOG["presses"]}
globals().update(PRESSES)
__all__ = ["Press", "PRESSES", "CATALOG", *PRESSES]
