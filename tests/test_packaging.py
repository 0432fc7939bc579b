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


def test_run_from_the_checkout_root_transformers_finds_the_pypi_kernels_package():
    """`python -m ...` from the checkout's root puts it first on `sys.path`, where the `kernels/` folder would hide the
    PyPI package `kernels` that transformers imports (its hub-kernel integration): the folder hands the import over,
    and the package still imports under its own name."""
    code = ("import importlib.util, transformers.modeling_utils, hybrid_indexpool.kernels as ours\n"
            "try:\n    import kernels\nexcept ModuleNotFoundError:\n    print('absent', ours.__file__)\n"
            "else:\n    print(kernels.__file__, ours.__file__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    pypi_kernels, ours = result.stdout.split()
    assert Path(ours).resolve() == ROOT / "kernels" / "__init__.py"
    assert pypi_kernels == "absent" or Path(pypi_kernels).resolve() != Path(ours).resolve()
