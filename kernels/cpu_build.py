"""The small C kernels of the CPU decode path: where their sources are, how they are built and loaded, when they run.

Each kernel is a `.c` file beside its `cpu_impl.py` (shipped as package data, with the shared `cpu_prelude.h`),
compiled on first use with the system C compiler (`$CC`, else `cc` or `gcc`; `-O3 -march=native -fopenmp`, and
without `-fopenmp`, single-threaded, where the compiler has no OpenMP, as Apple's clang) into a cache folder
(`$HYBRID_INDEXPOOL_CACHE`, else `$XDG_CACHE_HOME/hybrid_indexpool` or `~/.cache/hybrid_indexpool`), one file per
source, limits, compiler version and CPU model, and loaded with `ctypes`.

A checkpoint's remote code (flat Python modules, see `modeling/hub_export.py`) carries no C sources: beside an
installed package it builds the installed package's sources, when they are the ones the checkpoint was saved with
(`SOURCE_DIGESTS`, filled in when the remote code is generated), and otherwise runs the PyTorch paths.

[`CpuKernel`] owns all of it: a failed build is logged once with its reason (and not retried in the process), and
`HYBRID_INDEXPOOL_CPU_KERNELS=0` turns every CPU kernel off. It also owns the switch between a direct call (eager
code: a custom op's dispatch costs tens of microseconds) and the custom op (compiled graphs). Nothing here builds,
loads or locks inside a traced region: a compiled graph routes to the op unless the build is known to have failed,
and the op builds the library on its first run, outside the trace, falling back to the PyTorch reference if the
build fails there.
"""

import ctypes
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Callable

import torch

from .dispatch import kernel_backend

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "HYBRID_INDEXPOOL_CACHE"
ENABLE_VARIABLE = "HYBRID_INDEXPOOL_CPU_KERNELS"
PRELUDE = Path(__file__).with_name("cpu_prelude.h")
BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")
PACKAGE = "hybrid_indexpool"
# C file name -> sha256 of its text, for the sources of the package that a checkpoint's remote code was generated
# from. Empty in the package itself, whose sources lie beside its modules; `hub_export` fills it in the remote code.
SOURCE_DIGESTS: dict[str, str] = {}


def source_digests(folder: Path = PRELUDE.parent) -> dict[str, str]:
    """C file name -> sha256 of its text, for the prelude and every kernel source under `folder` (names are unique)."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted([*folder.glob("*.h"), *folder.glob("*/*.c")])}


def installed_kernels_folder() -> Path | None:
    """The `kernels` folder of the installed `hybrid_indexpool` package, found without importing the package (whose
    import registers its classes with transformers); None when the package is not installed."""
    try:
        package = importlib.util.find_spec(PACKAGE)
        if package is None or not package.submodule_search_locations:
            return None
        # The finder that found the package finds its subpackage (an editable install maps it outside the package).
        for finder in sys.meta_path:
            spec = finder.find_spec(f"{PACKAGE}.kernels", list(package.submodule_search_locations))
            if spec is not None:
                return Path(spec.origin).parent if spec.origin else None
    except (ImportError, ValueError, AttributeError):  # a finder that refuses the name: not installed for us
        return None
    return None

def op_namespace(module_name: str) -> str:
    """Namespace of the custom ops a CPU kernel module registers. A checkpoint's remote code carries copies of these
    modules, imported beside the package (one per checkpoint folder): each copy registers its ops under a namespace of
    its own, so that no copy replaces another's registration, which torch's dispatcher loses when that copy is freed
    (a later call of the op then crashed the process)."""
    if module_name.startswith("hybrid_indexpool."):
        return "hybrid_indexpool"
    return f"hybrid_indexpool_{zlib.crc32(module_name.encode()):08x}"



def cpu_kernels_enabled() -> bool:
    """False when `HYBRID_INDEXPOOL_CPU_KERNELS` turns the CPU kernels off (`0`, `false`, `off`, `no`)."""
    value = os.environ.get(ENABLE_VARIABLE, "1").strip().lower()
    if value in ("1", "true", "on", "yes", ""):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENABLE_VARIABLE}={value!r} is neither on nor off; set it to 1 (default) or 0.")


def cache_folder() -> Path:
    """Where the compiled kernels are kept."""
    root = os.environ.get(CACHE_VARIABLE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hybrid_indexpool")
    return Path(root) / "cpu_kernels"


def _cpu_signature() -> str:
    # `-march=native` code runs only on CPUs with the same instruction sets: the cached library is per CPU model.
    try:
        with open("/proc/cpuinfo") as handle:
            lines = [line for line in handle if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + platform.processor() + "".join(lines)


def _compiler() -> tuple[str, str]:
    """The C compiler and its version line (part of the cache key: another compiler makes another library)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler: none of $CC, cc or gcc is on PATH")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"the C compiler {compiler!r} does not run: {error}") from None
    if version.returncode != 0:
        raise RuntimeError(f"`{compiler} --version` failed: {version.stderr.strip()[-500:]}")
    return compiler, version.stdout.strip().splitlines()[0] if version.stdout.strip() else ""


def _define_flags(defines: dict[str, int]) -> list[str]:
    return [f"-D{name}=({value}LL)" for name, value in sorted(defines.items())]


class CpuKernel:
    """One C kernel: its source, its compiled library and the choice between a direct call and its custom op.

    Args:
        name: the library's name (the cached file starts with it).
        source: the `.c` file; it includes `cpu_prelude.h`.
        declare: sets the ctypes signatures of the library's functions.
        defines: integer macros the source is built with (limits that the Python side owns).
    """

    def __init__(self, name: str, source: Path, declare: Callable[[ctypes.CDLL], None],
                 defines: dict[str, int] | None = None):
        self.name, self.source, self.declare = name, Path(source), declare
        self.defines = dict(defines or {})
        self.error: str | None = None
        self._library: ctypes.CDLL | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, built on the first call; None when it cannot be built (`error` says why)."""
        if self._library is not None or self.error is not None:
            return self._library
        with self._lock:
            if self._library is None and self.error is None:
                try:
                    self._library = self._build_and_load()
                except (OSError, RuntimeError) as error:
                    self.error = f"{type(error).__name__}: {error}"
                    logger.warning("hybrid_indexpool: the CPU kernel %r could not be built, so its PyTorch path "
                                   "runs instead (slower decoding on CPU). %s", self.name, self.error)
        return self._library

    @property
    def is_loaded(self) -> bool:
        """Whether the library has been built and loaded in this process."""
        return self._library is not None

    def usable(self) -> bool:
        """Whether a call should go to this kernel: CPU kernels on, the PyTorch backend not forced, not exporting,
        and the library built. In a traced region the library is not built (that happens when the op first runs):
        there only a build known to have failed says no."""
        if not cpu_kernels_enabled() or kernel_backend() != "auto" or torch.compiler.is_exporting():
            return False  # an exported program keeps to PyTorch's operators: it runs wherever PyTorch does
        if torch.compiler.is_compiling():
            return self.error is None
        return self.load() is not None

    def dispatch(self, direct: Callable, op: Callable) -> Callable:
        """`op` (the custom op) in a traced region, so that a compiled step keeps one graph; `direct` in eager code,
        which saves the op's dispatch cost."""
        return op if torch.compiler.is_compiling() else direct

    def _sources(self) -> tuple[Path, Path]:
        """The kernel's C source and the prelude it includes: beside this module in the package; for a checkpoint's
        remote code, the installed package's, when they match the ones the checkpoint was saved with."""
        if self.source.is_file() and PRELUDE.is_file():
            return self.source, PRELUDE
        # The package is not on the package index: the hints say to install it from a checkout.
        if not SOURCE_DIGESTS:
            raise RuntimeError(f"its C source {self.source} is missing; reinstall the package from a checkout of this "
                               "project's repository (`pip install --force-reinstall <path to the checkout>`; it is "
                               "not on the package index) to get it back")
        installed = installed_kernels_folder()
        if installed is None:
            raise RuntimeError("this model runs from a checkpoint's remote code, which carries only Python files, and "
                               "the kernels' C sources come with the hybrid_indexpool package, which is not installed "
                               "here; for the faster CPU kernels install it from a checkout of this project's "
                               "repository (`pip install <path to the checkout>`; it is not on the package index)")
        found = {path.name: path for path in [*installed.glob("*.h"), *installed.glob("*/*.c")]}
        source, prelude = found.get(self.source.name), found.get(PRELUDE.name)
        installed_digests = source_digests(installed)
        for name in (self.source.name, PRELUDE.name):
            if name not in SOURCE_DIGESTS or installed_digests.get(name) != SOURCE_DIGESTS[name]:
                raise RuntimeError(f"the installed hybrid_indexpool package ({installed}) has another {name} than the "
                                   "package this checkpoint's remote code was saved with; install that version of "
                                   "hybrid-indexpool, or load the checkpoint without trust_remote_code, to use the "
                                   "faster CPU kernels")
        return source, prelude

    def _build_and_load(self) -> ctypes.CDLL:
        source_path, prelude = self._sources()
        compiler, version = _compiler()
        source = source_path.read_text()
        defines = _define_flags(self.defines)
        key = "\0".join([source, prelude.read_text(), *defines, *BASE_FLAGS, compiler, version, _cpu_signature()])
        target = cache_folder() / f"{self.name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        if not target.exists():
            self._compile(compiler, source_path, prelude, defines, target)
        library = ctypes.CDLL(str(target))
        self.declare(library)
        return library

    def _compile(self, compiler: str, source: Path, prelude: Path, defines: list[str], target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            common = [compiler, *BASE_FLAGS, f"-I{prelude.parent}", *defines, str(source), "-o", str(built)]
            result = subprocess.run(common[:1] + ["-fopenmp"] + common[1:], capture_output=True, text=True)
            if result.returncode != 0:
                # Compilers without OpenMP (Apple's clang, clang without libomp) reject -fopenmp: build the kernel
                # single-threaded rather than not at all.
                serial = subprocess.run(common[:1] + ["-Wno-unknown-pragmas"] + common[1:], capture_output=True,
                                        text=True)
                if serial.returncode != 0:
                    raise RuntimeError(f"{' '.join(common)} failed:\n{serial.stderr[-2000:]}")
                logger.warning("hybrid_indexpool: %s has no OpenMP (-fopenmp failed: %s); the CPU kernel %r runs "
                               "on one thread.", compiler, result.stderr.strip()[-300:], self.name)
            os.replace(built, target)  # atomic: a concurrent process sees the old file or the whole new one
