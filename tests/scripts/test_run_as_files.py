"""Every command in scripts/ runs as a file (`python scripts/NAME.py`), not only as a module (`python -m
hybrid_indexpool.scripts.NAME`): a relative import would fail there with 'attempted relative import'."""

import subprocess
import sys
from pathlib import Path

SCRIPTS = sorted(path for path in (Path(__file__).parents[2] / "scripts").glob("*.py") if path.name != "__init__.py")


def test_every_script_runs_as_a_file_and_explains_itself(tmp_path):
    # All at once: each process spends its time importing torch and transformers.
    processes = {script.name: subprocess.Popen([sys.executable, str(script), "--help"], cwd=tmp_path, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for script in SCRIPTS}
    failures = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=600)
        if process.returncode != 0 or "usage:" not in stdout.lower():
            failures[name] = f"exit {process.returncode}: {stderr[-1500:]}"
    assert len(SCRIPTS) > 10 and not failures, failures
