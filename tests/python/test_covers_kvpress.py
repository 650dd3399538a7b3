"""The registry holds every press class the pinned kvpress exports (ours may hold more).

Usage: python test_covers_kvpress.py /path/to/libkvpress.so

kvpress's classes are found, not listed: every class in the `kvpress` package namespace that derives
from its BasePress, except the two abstract bases a user never instantiates (BasePress, ScorerPress),
which the test checks are bases of other presses. README's count ("all N of kvpress 0.5.5's press
classes") must be this number.
"""
import inspect
import json
import re
import sys
from pathlib import Path

import torch

import kvpress
from kvpress.presses.base_press import BasePress
from kvpress.presses.scorer_press import ScorerPress

torch.ops.load_library(sys.argv[1])
ours = {p["name"] for p in json.loads(torch.ops.kvpress.registry_json())["presses"]}

classes = {name: cls for name, cls in vars(kvpress).items() if inspect.isclass(cls) and issubclass(cls, BasePress)}
bases = {BasePress, ScorerPress}
failures = []
for base in bases:
    if not any(cls is not base and issubclass(cls, base) for cls in classes.values()):
        failures.append(f"{base.__name__} is no longer a base of any kvpress press: count it as a press")
theirs = {name for name, cls in classes.items() if cls not in bases}
missing = sorted(theirs - ours)
if missing:
    failures.append(f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else ''} presses missing "
                    f"from the registry: {missing}")

readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
claim = re.search(r"all (\d+) of kvpress 0\.5\.5's press classes", readme)
if not claim:
    failures.append("README.md no longer states how many of kvpress 0.5.5's press classes the registry holds")
elif int(claim.group(1)) != len(theirs):
    failures.append(f"README.md says all {claim.group(1)} of kvpress 0.5.5's press classes; kvpress has {len(theirs)}")

print(f"kvpress press classes: {len(theirs)} (bases left out: {sorted(b.__name__ for b in bases)}); "
      f"registry: {len(ours)}, of which not in kvpress: {sorted(ours - theirs)}")
for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
