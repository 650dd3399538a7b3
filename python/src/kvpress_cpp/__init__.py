"""kvpress-cpp from Python.

* kvpress_cpp.ops: the library's ops (torch.ops.kvpress.*) with type hints and docstrings.
* kvpress_cpp.presses: a class per press, with kvpress's name, parameters and defaults.
* kvpress_cpp.accelerate(): kvpress's own press classes compute through kvpress-cpp where the press
  and its inputs are supported (kvpress_cpp.accelerated_presses()), kvpress's Python elsewhere, for a
  reason it names (kvpress_cpp.Unsupported, kvpress_cpp.REASONS) and counts (the handle's report()).
"""

from . import _library

_library.load()

from . import ops, presses  # noqa: E402  (they need the ops registered)
from .accelerate import (REASONS, Acceleration, Unsupported, accelerate, accelerated_presses,  # noqa: E402
                         is_accelerated)
from .presses import Press  # noqa: E402

__version__ = _library.package_version()
__all__ = ["ops", "presses", "Press", "accelerate", "accelerated_presses", "is_accelerated", "Acceleration",
           "Unsupported", "REASONS", "__version__"]
