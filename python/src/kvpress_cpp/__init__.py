"""kvpress-cpp from Python.

* kvpress_cpp.ops: the library's ops (torch.ops.kvpress.*) with type hints and docstrings.
* kvpress_cpp.presses: a class per press, with kvpress's name, parameters and defaults.
* kvpress_cpp.accelerate(): kvpress's own press classes compute through kvpress-cpp where the press
  and its inputs are supported (kvpress_cpp.accelerated_presses()), kvpress's Python elsewhere.
"""

from . import _library

_library.load()

from . import ops, presses  # noqa: E402  (they need the ops registered)
from .accelerate import accelerate, accelerated_presses, is_accelerated  # noqa: E402
from .presses import Press  # noqa: E402

__version__ = _library.package_version()
__all__ = ["ops", "presses", "Press", "accelerate", "accelerated_presses", "is_accelerated", "__version__"]
