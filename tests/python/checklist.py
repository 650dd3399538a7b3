"""The Python test scripts' one way to record checks: `check(name, ok, detail)` prints ok/FAIL per
check, `check.finish()` prints the count and exits non-zero if any failed."""
import sys


class Checklist:
    def __init__(self):
        self.failures: list[str] = []
        self.passed = 0

    def __call__(self, name: str, ok: bool, detail: str = "") -> None:
        print(("ok   " if ok else "FAIL ") + name + ("" if ok or not detail else f": {detail}"))
        if ok:
            self.passed += 1
        else:
            self.failures.append(name)

    def finish(self) -> None:
        print(f"{self.passed} passed, {len(self.failures)} failed")
        sys.exit(1 if self.failures else 0)
