"""Prepare transformers' own common model tests for `test_common_hybrid_indexpool.py`.

transformers publishes `tests/test_modeling_common.py` (`ModelTesterMixin`) and `tests/test_configuration_common.py`
(`ConfigTester`) only in its source distribution. This script downloads the sdist of the *installed* transformers
version, extracts those two files into a git-ignored folder as the package `transformers_tests`, and adds our
stand-ins for the modules they import that the sdist does not ship (see `stand_ins/`).

    python tests/transformers_common/prepare.py            # into <repo>/.transformers_tests
    python tests/transformers_common/prepare.py --sdist transformers-5.24.0.tar.gz   # offline, from a local sdist
"""

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TARGET = HERE.parents[1] / ".transformers_tests"
PACKAGE = "transformers_tests"
VERSION_FILE = "TRANSFORMERS_VERSION"

# Files taken from the sdist's `tests/` folder, unchanged.
FROM_SDIST = ("test_modeling_common.py", "test_configuration_common.py")

# Modules those files import that the sdist lacks: path in the package -> our stand-in.
STAND_INS = {
    "exporters/test_export.py": "export_tester.py",
    "generation/test_utils.py": "generation_tester.py",
    "utils/test_configuration_utils.py": "configuration_kwargs.py",
}


def installed_transformers_version() -> str:
    import transformers

    return transformers.__version__


def download_sdist(version: str, directory: Path) -> Path:
    """Download transformers' sdist of `version` into `directory` with pip; returns the archive."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         f"transformers=={version}", "-d", str(directory)],
        check=True,
    )
    archives = sorted(directory.glob("transformers-*.tar.gz"))
    if not archives:
        raise SystemExit(f"pip downloaded no transformers sdist into {directory}")
    return archives[0]


def extract_tests(archive: Path, version: str, package: Path) -> None:
    """Copy the FROM_SDIST files of the archive's `tests/` folder into `package`."""
    with tarfile.open(archive) as tar:
        for name in FROM_SDIST:
            member = f"transformers-{version}/tests/{name}"
            try:
                source = tar.extractfile(member)
            except KeyError:
                raise SystemExit(f"{archive.name} has no {member}; is it the sdist of transformers {version}?")
            (package / name).write_bytes(source.read())


def prepare(target: Path = DEFAULT_TARGET, sdist: Path | None = None) -> Path:
    """Build `target/transformers_tests` for the installed transformers; returns the package folder."""
    version = installed_transformers_version()
    package = target / PACKAGE
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    # Empty on purpose: test_configuration_common runs `direct_transformers_import` on this folder, which executes
    # its `__init__.py` once more under the name "transformers".
    (package / "__init__.py").write_text("")
    with tempfile.TemporaryDirectory() as download:
        archive = sdist if sdist is not None else download_sdist(version, Path(download))
        extract_tests(archive, version, package)
    for destination, stand_in in STAND_INS.items():
        path = package / destination
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").touch()
        shutil.copyfile(HERE / "stand_ins" / stand_in, path)
    (target / VERSION_FILE).write_text(version + "\n")
    return package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="folder to prepare (git-ignored)")
    parser.add_argument("--sdist", type=Path, help="a transformers sdist already on disk (skips the download)")
    args = parser.parse_args()
    package = prepare(args.target.resolve(), args.sdist)
    print(f"transformers {installed_transformers_version()} common tests ready in {package}")


if __name__ == "__main__":
    main()
