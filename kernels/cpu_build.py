"""Build and load the small C kernels of the CPU decode path.

Each kernel is a C source string compiled on first use with the system C compiler (`$CC`, else `cc` or `gcc`;
`-O3 -march=native -fopenmp`) into a per-user cache folder (`$HYBRID_INDEXPOOL_CACHE`, else
`$XDG_CACHE_HOME/hybrid_indexpool` or `~/.cache/hybrid_indexpool`), one file per source, compiler and CPU model, and
loaded with `ctypes`. Without a compiler the library is None and the caller runs its PyTorch path.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

CACHE_VARIABLE = "HYBRID_INDEXPOOL_CACHE"


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
    return platform.machine() + "".join(lines)


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return compiler


def _compile(compiler: str, source: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        source_file = Path(scratch) / (target.stem + ".c")
        source_file.write_text(source)
        built = Path(scratch) / target.name
        command = [compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
                   str(source_file), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent process sees the old file or the whole new one


class CompiledLibrary:
    """A C source compiled and loaded once, on first use. `declare(library)` sets the functions' ctypes signatures.

    `load()` returns the `ctypes.CDLL`, or None when it cannot be built; `error` then says why."""

    def __init__(self, name: str, source: str, declare: Callable[[ctypes.CDLL], None]):
        self.name, self.source, self.declare = name, source, declare
        self.error: str | None = None
        self._library = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        if self._library is not None or self.error is not None:
            return self._library
        with self._lock:
            if self._library is None and self.error is None:
                try:
                    compiler = _compiler()
                    digest = hashlib.sha256((self.source + compiler + _cpu_signature()).encode()).hexdigest()[:16]
                    target = cache_folder() / f"{self.name}_{digest}.so"
                    if not target.exists():
                        _compile(compiler, self.source, target)
                    library = ctypes.CDLL(str(target))
                    self.declare(library)
                    self._library = library
                except (OSError, RuntimeError) as error:
                    self.error = f"{type(error).__name__}: {error}"
        return self._library


# What every kernel source starts with: eight float32 lanes (GCC/Clang vector extension: AVX registers where the CPU
# has them) and their loads from float32 and bfloat16 memory (the bfloat16 bits are the high half of the float32 bits).
C_PRELUDE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float lanes __attribute__((vector_size(32)));
typedef uint16_t halves __attribute__((vector_size(16)));
typedef uint32_t words __attribute__((vector_size(32)));

static inline lanes load_lanes(const float *p) {
    lanes v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline lanes load_bf16_lanes(const uint16_t *p) {
    halves half;
    memcpy(&half, p, sizeof half);
    words word = __builtin_convertvector(half, words) << 16;
    lanes v;
    memcpy(&v, &word, sizeof v);
    return v;
}

static inline float bf16_to_float(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
"""
