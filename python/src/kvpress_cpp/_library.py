"""Loads libkvpress (installed beside this file) into torch, once."""

import os

import torch

from . import _build_info

LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libkvpress.so")


def _torch_release(version: str) -> str:
    """'2.11.0+cu130' -> '2.11.0': the local build tag does not change the C++ ABI's version."""
    return version.split("+")[0]


def load() -> None:
    """Registers torch.ops.kvpress.* (idempotent). Raises ImportError when the torch of this process is
    not the one the library was compiled against: libtorch has no stable C++ ABI across versions."""
    if _torch_release(torch.__version__) != _torch_release(_build_info.TORCH_VERSION):
        raise ImportError(
            f"kvpress_cpp was built against torch {_build_info.TORCH_VERSION}, but this process has torch "
            f"{torch.__version__}: reinstall kvpress_cpp (pip install ./python) after changing torch"
        )
    if LIBRARY_PATH in torch.ops.loaded_libraries or _registered():
        return  # loaded already (by this package, or another copy of libkvpress the process loaded first)
    torch.ops.load_library(LIBRARY_PATH)


def _registered() -> bool:
    try:
        torch.ops.kvpress.registry_json
        return True
    except (AttributeError, RuntimeError):
        return False


def package_version() -> str:
    """The installed distribution's version (the C++ project's, pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpress-cpp")
    except PackageNotFoundError:  # imported from a source tree
        return "unknown"
