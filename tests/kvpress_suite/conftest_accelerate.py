"""pytest plugin (-p conftest_accelerate) for kvpress's own test suite: acceleration on for the
whole session, and its counts written at the end (KVPRESS_CPP_ACCELERATION_REPORT, JSON: totals, per
press and reason, each fallback's detail, and the named reasons and accelerated presses of this
kvpress_cpp, for run.py to judge)."""
import json
import os

import pytest

import kvpress_cpp

_handle = None


def pytest_configure(config):
    global _handle
    if os.environ.get("KVPRESS_CPP_ACCELERATE", "1") == "1":
        _handle = kvpress_cpp.accelerate()


def pytest_unconfigure(config):
    report = os.environ.get("KVPRESS_CPP_ACCELERATION_REPORT")
    if _handle is not None and report:
        with open(report, "w") as f:
            json.dump({"calls": _handle.calls, "fallbacks": _handle.fallbacks, "per_press": _handle.counts(),
                       "fallback_reasons": _handle.fallback_reasons, "reasons": sorted(kvpress_cpp.REASONS),
                       "accelerated": kvpress_cpp.accelerated_presses()}, f, indent=2)
    if _handle is not None:
        _handle.close()


@pytest.fixture(autouse=True)
def _acceleration_stays_on():
    """A test that closes the session's handle would silently turn acceleration off for the rest."""
    yield
    if _handle is not None:
        assert _handle.active and kvpress_cpp.is_accelerated(), "acceleration was turned off during the test"
