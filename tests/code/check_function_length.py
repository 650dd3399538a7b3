"""No function of the library, its tools, scripts or Python package is longer than 100 lines
(docs/ARCHITECTURE.md, "Conventions"; tests, examples and benchmarks aside). Lengths are lizard's:
from the signature's first line to the closing brace, comments and blank lines included.

usage: check_function_length.py REPO
"""
import sys
from pathlib import Path

import lizard

LIMIT = 100
FOLDERS = ("src", "include", "tools", "python/src", "scripts")
SUFFIXES = {".cpp", ".h", ".cu", ".cuh", ".py"}


def functions(repo: Path):
    for folder in FOLDERS:
        for path in sorted((repo / folder).rglob("*")):
            if path.suffix not in SUFFIXES or "build" in path.relative_to(repo).parts[:2]:
                continue
            code = path.read_text(encoding="utf-8")
            # lizard reads CUDA as C++ (it does not know the .cu/.cuh endings).
            name = path.with_suffix(".cpp").name if path.suffix in (".cu", ".cuh") else path.name
            for f in lizard.analyze_file.analyze_source_code(name, code).function_list:
                yield str(path.relative_to(repo)), f


def main() -> int:
    repo = Path(sys.argv[1]).resolve()
    failures, count = [], 0
    for file, f in functions(repo):
        count += 1
        if f.length > LIMIT:
            failures.append(f"{file}:{f.start_line} {f.name} is {f.length} lines (at most {LIMIT}): split it")
    print(f"check_function_length: {count} functions in {', '.join(FOLDERS)}, none over {LIMIT} lines"
          if not failures else f"check_function_length: {count} functions in {', '.join(FOLDERS)}")
    for failure in failures:
        print("FAIL:", failure)
    if count < 1000:
        print(f"FAIL: only {count} functions found: is {repo} the repository?")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
