"""The small C kernels of the CPU decode path: where their sources are, how they are built and loaded, when they run.

Each kernel is a `.c` file beside its `cpu_impl.py` (shipped as package data, with the shared `cpu_prelude.h`),
compiled on first use with the system C compiler (`$CC`, else `cc` or `gcc`; `-O3 -march=native -fopenmp`, and
without `-fopenmp`, single-threaded, where the compiler has no OpenMP, as Apple's clang) into a cache folder
(`$HYBRID_INDEXPOOL_CACHE`, else `$XDG_CACHE_HOME/hybrid_indexpool` or `~/.cache/hybrid_indexpool`), one file per
source, limits, compiler version and CPU model, and loaded with `ctypes`.

[`CpuKernel`] owns all of it: a failed build is logged once with its reason (and not retried in the process), and
`HYBRID_INDEXPOOL_CPU_KERNELS=0` turns every CPU kernel off. It also owns the switch between a direct call (eager
code: a custom op's dispatch costs tens of microseconds) and the custom op (compiled graphs). Nothing here builds,
loads or locks inside a traced region: a compiled graph routes to the op unless the build is known to have failed,
and the op builds the library on its first run, outside the trace, falling back to the PyTorch reference if the
build fails there.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
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
        """Whether a call should go to this kernel: CPU kernels on, the PyTorch backend not forced, and the library
        built. In a traced region the library is not built (that happens when the op first runs): there only a
        build known to have failed says no."""
        if not cpu_kernels_enabled() or kernel_backend() != "auto":
            return False
        if torch.compiler.is_compiling():
            return self.error is None
        return self.load() is not None

    def dispatch(self, direct: Callable, op: Callable) -> Callable:
        """`op` (the custom op) in a traced region, so that a compiled step keeps one graph; `direct` in eager code,
        which saves the op's dispatch cost."""
        return op if torch.compiler.is_compiling() else direct

    def _build_and_load(self) -> ctypes.CDLL:
        if not self.source.is_file():
            raise RuntimeError(f"its C source {self.source} is missing (a checkpoint's remote code carries only Python "
                               "files; `pip install hybrid-indexpool` brings the kernels' sources)")
        compiler, version = _compiler()
        source = self.source.read_text()
        defines = _define_flags(self.defines)
        key = "\0".join([source, PRELUDE.read_text(), *defines, *BASE_FLAGS, compiler, version, _cpu_signature()])
        target = cache_folder() / f"{self.name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        if not target.exists():
            self._compile(compiler, defines, target)
        library = ctypes.CDLL(str(target))
        self.declare(library)
        return library

    def _compile(self, compiler: str, defines: list[str], target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            common = [compiler, *BASE_FLAGS, f"-I{PRELUDE.parent}", *defines, str(self.source), "-o", str(built)]
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
