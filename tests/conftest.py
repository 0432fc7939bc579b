import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be chosen before any kernel module is
# imported (Triton reads it when the kernels are decorated), hence here, before the tests import the package.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same random state."""
    torch.manual_seed(1234)
    yield


@pytest.fixture
def without_c_compiler(monkeypatch, tmp_path):
    """`without_c_compiler(cpu_impl)`: that CPU kernel module rebuilds its library from an empty cache with a C
    compiler that does not exist, so it must fall back; asserts the build failed and says why."""
    from hybrid_indexpool.kernels.cpu_build import CACHE_VARIABLE, CompiledLibrary

    def disable(cpu_impl):
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
        library = cpu_impl.LIBRARY
        monkeypatch.setattr(cpu_impl, "LIBRARY", CompiledLibrary(library.name, library.source, library.declare))
        assert cpu_impl.load_library() is None
        assert "no-such-compiler" in cpu_impl.library_error()

    return disable
