"""The plugin picks the QSA cache classes of the vLLM release installed (`serving/vllm_versions.py`): both releases'
module layouts are stood in for by fake modules, so neither wheel is needed; the `vllm` one checks the installed
release."""

import importlib.util
import sys
import types

import pytest

from hybrid_indexpool.serving.vllm_versions import qsa_cache_classes

COMMON = "vllm.models.qwen4_exp.common"


def fake_vllm(monkeypatch, version: str, caches: dict[str, dict[str, type]]):
    """Put a fake `vllm` package in `sys.modules` whose `COMMON` package holds only the modules `caches`
    (module name -> its classes)."""
    for name in ("vllm", "vllm.models", "vllm.models.qwen4_exp", COMMON):
        package = types.ModuleType(name)
        package.__path__ = []  # a package where the import system finds no other module
        monkeypatch.setitem(sys.modules, name, package)
    sys.modules["vllm"].__version__ = version
    for module_name, classes in caches.items():
        module = types.ModuleType(f"{COMMON}.{module_name}")
        for class_name, cls in classes.items():
            setattr(module, class_name, cls)
        monkeypatch.setitem(sys.modules, f"{COMMON}.{module_name}", module)
    for module_name in ("qsa_indexer", "qsa_cache"):  # a real vLLM's modules of these names must not be found
        if module_name not in caches:
            monkeypatch.delitem(sys.modules, f"{COMMON}.{module_name}", raising=False)


def cache_class(name: str) -> type:
    return type(name, (), {})


def test_vllm_034_names_the_ring_qsa_raw_key_cache(monkeypatch):
    compressed, raw = cache_class("QSACompressedKeyCache"), cache_class("QSARawKeyCache")
    fake_vllm(monkeypatch, "0.34.0", {"qsa_indexer": {"QSACompressedKeyCache": compressed, "QSARawKeyCache": raw}})
    assert qsa_cache_classes() == (compressed, raw)


def test_vllm_032_names_the_ring_qsa_key_state_cache(monkeypatch):
    compressed, ring = cache_class("QSACompressedKeyCache"), cache_class("QSAKeyStateCache")
    fake_vllm(monkeypatch, "0.32.0", {"qsa_cache": {"QSACompressedKeyCache": compressed, "QSAKeyStateCache": ring}})
    assert qsa_cache_classes() == (compressed, ring)


def test_a_vllm_without_either_module_is_refused_with_the_releases_named(monkeypatch):
    fake_vllm(monkeypatch, "0.30.1", {})
    with pytest.raises(ImportError, match=r"vLLM 0\.30\.1 has none of the QSA cache modules.*vLLM 0\.34"):
        qsa_cache_classes()


def test_a_broken_qsa_indexer_module_is_not_mistaken_for_an_older_release(monkeypatch):
    """An import error inside the 0.34 module (something it needs is missing) surfaces; it does not fall back to
    0.32's names."""
    fake_vllm(monkeypatch, "0.34.0", {"qsa_cache": {"QSACompressedKeyCache": cache_class("A"),
                                                    "QSAKeyStateCache": cache_class("B")}})

    class BrokenModuleFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == f"{COMMON}.qsa_indexer":
                raise ModuleNotFoundError("No module named 'deep_gemm'", name="deep_gemm")
            return None

    monkeypatch.setattr(sys, "meta_path", [BrokenModuleFinder, *sys.meta_path])
    with pytest.raises(ModuleNotFoundError, match="deep_gemm"):
        qsa_cache_classes()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_installed_vllm_gives_its_own_ring_class():
    import vllm

    _, ring = qsa_cache_classes()
    expected = "QSAKeyStateCache" if vllm.__version__.startswith("0.32") else "QSARawKeyCache"
    assert ring.__name__ == expected and ring.__module__.startswith(COMMON)
