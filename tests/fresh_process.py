"""Run a test's body in a new Python process: nothing that an earlier test imported, compiled or loaded is there.

Compiled code must work as the first thing a process does (no C kernel built or loaded yet, no graph cached), so the
compile tests run their checks through `run_in_fresh_process`, each with an empty CPU-kernel cache folder. The child's
standard input is closed, as in a batch job: a prompt (transformers' remote-code `[y/N]`) reads end-of-file at once.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS_FOLDER = Path(__file__).resolve().parent


def run_in_fresh_process(test_file: str, function: str, *args, timeout: float = 900) -> str:
    """Call `function(*args)` (plain Python values) from the module `test_file` in a fresh interpreter with an empty
    kernel cache; fails with the child's output unless it exits 0. Returns its standard output."""
    code = (f"import runpy, sys; sys.path.insert(0, {str(TESTS_FOLDER)!r}); "
            f"runpy.run_path({str(Path(test_file).resolve())!r})[{function!r}](*{args!r})")
    with tempfile.TemporaryDirectory(prefix="hybrid_indexpool_cold_") as cache:
        environment = dict(os.environ, HYBRID_INDEXPOOL_CACHE=cache, PYTHONUNBUFFERED="1")
        result = subprocess.run([sys.executable, "-c", code], env=environment, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, (f"{function}{args} failed in a fresh process (exit {result.returncode}):\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result.stdout
