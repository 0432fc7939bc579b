"""Every command in scripts/ runs as a file (`python scripts/NAME.py`), not only as a module (`python -m
hybrid_indexpool.scripts.NAME`): a relative import would fail there with 'attempted relative import'."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(path for path in (Path(__file__).parents[2] / "scripts").glob("*.py") if path.name != "__init__.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.stem for path in SCRIPTS])
def test_script_runs_as_a_file_and_explains_itself(script, tmp_path):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout.lower()
