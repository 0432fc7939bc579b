"""Building, caching, switching off and falling back of the CPU C kernels (`kernels.cpu_build.CpuKernel`)."""

import logging
import os
import shutil
import stat

import pytest
import torch
import torch.nn.functional as F
from fresh_process import run_in_fresh_process

from hybrid_indexpool.kernels import cpu_build
from hybrid_indexpool.kernels.cpu_build import CACHE_VARIABLE, ENABLE_VARIABLE, CpuKernel, cpu_kernels_enabled
from hybrid_indexpool.kernels.decode_linear import cpu_impl as linear_impl
from hybrid_indexpool.kernels.pooled_index_topk import cpu_impl as topk_impl
from hybrid_indexpool.kernels.pooled_index_topk.reference import paged_pooled_index_topk_torch

COMPILER = shutil.which("cc") or shutil.which("gcc")
requires_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler on this machine")


def fresh_linear_kernel() -> CpuKernel:
    kernel = linear_impl.KERNEL
    return CpuKernel(kernel.name, kernel.source, kernel.declare, kernel.defines)


def fake_compiler(folder, name: str, version: str, without_openmp: bool = False) -> str:
    """A compiler script that reports `version` and passes everything else to the real compiler (refusing
    `-fopenmp` when `without_openmp`, as Apple's clang does)."""
    script = folder / name
    refuse = 'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "unsupported option -fopenmp" >&2; exit 1; }; done\n'
    script.write_text("#!/bin/sh\n"
                      f'if [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n'
                      + (refuse if without_openmp else "")
                      + f'exec {COMPILER} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache" / "cpu_kernels"


def test_a_failed_build_is_logged_once_with_its_reason_and_not_retried(monkeypatch, tmp_path, empty_cache, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernel = fresh_linear_kernel()
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert kernel.load() is None
        assert kernel.load() is None
        assert not kernel.usable()
    warnings = [record for record in caplog.records if record.name == cpu_build.__name__]
    assert len(warnings) == 1
    assert "linear_rows" in warnings[0].getMessage() and "no-such-compiler" in warnings[0].getMessage()
    assert "no-such-compiler" in kernel.error


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_the_environment_variable_turns_every_cpu_kernel_off(monkeypatch, value):
    monkeypatch.setenv(ENABLE_VARIABLE, value)
    assert not cpu_kernels_enabled()
    hidden_states, weight = torch.randn(1, 32), torch.randn(8, 32)
    assert not linear_impl.decode_linear_applies(hidden_states, weight)
    assert not topk_impl.fused_topk_applies(4, torch.randn(1, 100, 32))


def test_an_unknown_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv(ENABLE_VARIABLE, "maybe")
    with pytest.raises(ValueError, match="HYBRID_INDEXPOOL_CPU_KERNELS='maybe'.*set it to 1"):
        cpu_kernels_enabled()


@requires_compiler
def test_the_compiler_version_is_part_of_the_cache_key(monkeypatch, tmp_path, empty_cache):
    built = []
    for name, version in (("cc-one", "fake cc 1.0"), ("cc-two", "fake cc 2.0")):
        monkeypatch.setenv("CC", fake_compiler(tmp_path, name, version))
        assert fresh_linear_kernel().load() is not None
        built.append(set(empty_cache.glob("linear_rows_*.so")))
    assert len(built[0]) == 1 and len(built[1]) == 2  # the second compiler did not reuse the first one's library
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "cc-one", "fake cc 1.0"))
    assert fresh_linear_kernel().load() is not None
    assert set(empty_cache.glob("linear_rows_*.so")) == built[1]  # same compiler again: the cached library


@requires_compiler
def test_a_compiler_without_openmp_builds_a_single_threaded_kernel(monkeypatch, tmp_path, empty_cache, caplog):
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "cc-no-openmp", "fake clang", without_openmp=True))
    kernel = fresh_linear_kernel()
    monkeypatch.setattr(linear_impl, "KERNEL", kernel)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert kernel.load() is not None
    assert any("no OpenMP" in record.getMessage() for record in caplog.records)
    input, weight = torch.randn(3, 40), torch.randn(12, 40)
    torch.testing.assert_close(linear_impl.run_linear_rows(input, weight, None), F.linear(input, weight))


def test_a_kernel_without_its_source_says_so(tmp_path, empty_cache):
    kernel = CpuKernel("missing", tmp_path / "missing.c", lambda library: None)
    assert kernel.load() is None
    assert "missing.c" in kernel.error


def check_the_ops_fall_back_when_the_build_fails(missing_compiler: str) -> None:
    """Both custom ops, in a process whose C compiler does not exist, give the reference's results, no error."""
    os.environ["CC"] = missing_compiler
    assert linear_impl.KERNEL.load() is None and missing_compiler in linear_impl.KERNEL.error
    input, weight, bias = torch.randn(2, 24), torch.randn(10, 24), torch.randn(10)
    torch.testing.assert_close(linear_impl.linear_rows(input, weight, bias), F.linear(input, weight, bias))
    assert topk_impl.KERNEL.load() is None and missing_compiler in topk_impl.KERNEL.error
    queries, keys, weights = torch.randn(1, 4, 16), torch.randn(1, 50, 16), torch.rand(1, 1, 4)
    visible = torch.tensor([[40]])
    expected = topk_impl.select_with_keys(queries.reshape(1, 1, 4, 16), keys, visible, 8, weights, 0, 0)
    assert torch.equal(topk_impl.pooled_topk_windows(queries, keys, weights, visible, 8, 1, 0, 0), expected)
    queries, pages, table, weights = torch.randn(2, 4, 16), torch.randn(5, 4, 1, 16), torch.tensor([[3, 1, 4]]), \
        torch.rand(2, 4)
    tiles, visible = (torch.tensor([[0, 1]]), torch.tensor([0])), torch.tensor([9, 12])
    expected = paged_pooled_index_topk_torch(queries, pages, table, *tiles, None, visible, 16, 5, weights, 1, 0)
    assert torch.equal(topk_impl.paged_pooled_topk(queries, pages, table, *tiles, visible, weights, 16, 5, 1, 0),
                       expected)


def test_the_op_falls_back_to_the_reference_when_the_build_fails(tmp_path):
    # What a compiled graph that chose the op runs if the build then fails. In a fresh process (as a cold compiled
    # step is), so that no kernel library another test loaded is there.
    run_in_fresh_process(__file__, "check_the_ops_fall_back_when_the_build_fails", str(tmp_path / "no-such-compiler"))


def test_a_checkpoint_without_the_package_says_how_to_install_it_from_a_checkout(monkeypatch, tmp_path):
    # As in a checkpoint's remote code: no C source beside the module, sources saved with digests, no package.
    monkeypatch.setattr(cpu_build, "SOURCE_DIGESTS", {"decode_linear.c": "0" * 64})
    monkeypatch.setattr(cpu_build, "installed_kernels_folder", lambda: None)
    kernel = CpuKernel("missing", tmp_path / "decode_linear.c", linear_impl.KERNEL.declare)
    with pytest.raises(RuntimeError, match=r"install it from a checkout of this project's repository "
                                           r"\(`pip install <path to the checkout>`; it is not on the package index\)"):
        kernel._sources()
