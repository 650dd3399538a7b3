#!/usr/bin/env python3
"""Every parity fixture of the test suite, each script of this folder in its own forked process.

    python make_all_fixtures.py --out DIR --smollm2 GGUF

Runs the make_*_fixtures.py scripts below one after the other, as `python <script> --out DIR/<sub>`
would, but imports torch, transformers and kvpress once: each script runs in a child forked from a
process that has imported them (about 6 s of imports a script, 14 scripts), so it starts from the
same state as a fresh interpreter that has imported them, and no script sees what another changed
(seeds, thread counts, patched modules). Each script still checks the pinned kvpress version
(common.py) before it writes anything. Stops at the first script that fails, naming it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (script, sub-folder of --out, extra arguments), in the order they must run.
SCRIPTS = [
    ("make_fixtures.py", ".", []),
    ("make_model_fixtures.py", "llama", []),
    ("make_decoding_fixtures.py", "decoding", []),
    ("make_ragged_fixtures.py", "ragged", []),
    ("make_kvcompose_fixtures.py", "kvcompose", []),
    ("make_kvzip_fixtures.py", "kvzip", []),
    ("make_dms_fixtures.py", "dms", []),
    ("make_cam_fixtures.py", "cam", []),
    ("make_pipeline_fixtures.py", "pipeline", []),
    ("make_tokenizer_fixtures.py", "tokenizers", []),
    ("make_chat_fixtures.py", "chat", []),  # after tokenizers: reads them
    ("make_architecture_fixtures.py", "architectures", []),
    ("make_family_fixtures.py", "families", []),
    ("make_gguf_fixtures.py", "gguf", ["--smollm2", "{smollm2}"]),
]


def run_forked(script: Path, argv: list[str]) -> int:
    """Runs `script` as __main__ with sys.argv = [script, *argv] in a child; returns its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            sys.argv = [str(script), *argv]
            sys.path.insert(0, str(script.parent))
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                status = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                status = 1
        except BaseException:
            import traceback
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # no atexit handlers or finalizers of the parent's state
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the fixtures folder (build/fixtures)")
    parser.add_argument("--smollm2", required=True, help="SmolLM2-135M-Instruct's GGUF file (make_gguf_fixtures.py)")
    args = parser.parse_args()

    start = time.time()
    # What every script imports, imported once before the forks (no computation: no thread pool yet).
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import kvpress  # noqa: F401
    print(f"make_all_fixtures: imported torch, transformers and kvpress in {time.time() - start:.1f} s", flush=True)

    for script, sub, extra in SCRIPTS:
        argv = ["--out", str(args.out / sub), *(a.format(smollm2=args.smollm2) for a in extra)]
        status = run_forked(HERE / script, argv)
        if status != 0:
            sys.exit(f"make_all_fixtures: {script} {' '.join(argv)} failed (exit status {status})")
    print(f"make_all_fixtures: {len(SCRIPTS)} scripts in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
