"""The wheel a user installs holds every module and data file of the checkout's package folders."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The design card's top-level folders, installed as subpackages of hybrid_indexpool.
SUBPACKAGE_FOLDERS = ("configuration", "modeling", "kernels", "scripts", "serving")
SHIPPED_SUFFIXES = (".py", ".c", ".h")


def checkout_files() -> set[str]:
    """Installed path of every source and data file in the package folders."""
    files = set()
    for folder in ("hybrid_indexpool", *SUBPACKAGE_FOLDERS):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts:
                relative = path.relative_to(ROOT).as_posix()
                files.add(relative if folder == "hybrid_indexpool" else f"hybrid_indexpool/{relative}")
    return files


def test_the_wheel_ships_every_module_and_data_file(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("hybrid_indexpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = checkout_files()
    assert "hybrid_indexpool/kernels/decode_linear/cpu_impl.py" in expected  # the walk found the nested folders
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert "hybrid_indexpool/model_card.md" in names
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"hybrid_indexpool"}  # no generic top-level modules (`kernels`, `modeling`, ...)
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    # vLLM finds the plugin through this entry point: installing the wheel next to vLLM is all a user does.
    assert "[vllm.general_plugins]\nhybrid_indexpool = hybrid_indexpool.serving:register" in \
        zipfile.ZipFile(wheel).read(entry_points).decode()
