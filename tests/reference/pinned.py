"""The kvpress version every fixture script reproduces, checked before torch/kvpress are imported.

Usage (first lines of a fixture script):  from pinned import PINNED_KVPRESS, require_pinned_kvpress
                                          _kvpress_version = require_pinned_kvpress("make_x.py")
"""
import importlib.metadata
import sys

PINNED_KVPRESS = "0.5.5"


def require_pinned_kvpress(script: str) -> str:
    """Returns the installed kvpress version; exits with a message naming `script` otherwise."""
    try:
        version = importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{script}: kvpress {PINNED_KVPRESS} is not installed in {sys.executable}")
    if version != PINNED_KVPRESS:
        sys.exit(f"{script}: the parity target is kvpress {PINNED_KVPRESS}, but {sys.executable} has kvpress "
                 f"{version}; run scripts/setup.sh and use its virtual environment")
    return version
