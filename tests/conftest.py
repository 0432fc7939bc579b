import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be chosen before any kernel module is
# imported (Triton reads it when the kernels are decorated), hence here, before the tests import the package.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CPU kernels are built into a folder of this test session (subprocesses inherit it), not the user's cache.
if "HYBRID_INDEXPOOL_CACHE" not in os.environ:
    _kernel_cache = tempfile.mkdtemp(prefix="hybrid_indexpool_test_kernels_")
    os.environ["HYBRID_INDEXPOOL_CACHE"] = _kernel_cache
    atexit.register(shutil.rmtree, _kernel_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same random state."""
    torch.manual_seed(1234)
    yield


@pytest.fixture
def without_c_compiler(monkeypatch, tmp_path):
    """`without_c_compiler(cpu_impl)`: that CPU kernel module rebuilds its library from an empty cache with a C
    compiler that does not exist, so it must fall back; asserts the build failed and says why."""
    from hybrid_indexpool.kernels.cpu_build import CACHE_VARIABLE, CpuKernel

    def disable(cpu_impl):
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
        kernel = cpu_impl.KERNEL
        monkeypatch.setattr(cpu_impl, "KERNEL", CpuKernel(kernel.name, kernel.source, kernel.declare, kernel.defines))
        assert cpu_impl.KERNEL.load() is None
        assert "no-such-compiler" in cpu_impl.KERNEL.error

    return disable


# The node ids a run of the whole default selection collected, for tests/docs/test_documented_numbers.py: the
# documentation gives their count, and a run that collects everything anyway need not collect a second time.
DEFAULT_SELECTION = pytest.StashKey[list]()


def default_marker_expression(config) -> str | None:
    """The `-m` expression of the `addopts` in setup.cfg (which tests the default suite runs)."""
    addopts = config.getini("addopts")
    return addopts[addopts.index("-m") + 1] if "-m" in addopts else None


def pytest_collection_finish(session):
    config = session.config
    if (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
            and config.option.markexpr == default_marker_expression(config) and not config.option.deselect
            and not config.option.ignore and not config.option.ignore_glob):  # --ignore: only a part collected
        config.stash[DEFAULT_SELECTION] = [item.nodeid for item in session.items]


@pytest.fixture
def collected_in_this_run(request) -> list[str] | None:
    """The node ids of the whole default selection when this run collected exactly that, else None."""
    return request.config.stash.get(DEFAULT_SELECTION, None)
