"""Transparent huge pages for the paged caches (`serving/huge_pages.py`): the advice moves a filled tensor into huge
pages without changing it where the system grants it, says why not where it does not, and never raises; the
synthetic step's caches come advised and compute the same bits as unadvised ones."""

import ctypes
import errno
import logging
import mmap

import pytest
import torch

from hybrid_indexpool.serving import huge_pages
from hybrid_indexpool.serving.huge_pages import (
    HugePageAdvice,
    advise_huge_pages,
    anon_huge_page_bytes,
    transparent_huge_page_mode,
)
from hybrid_indexpool.serving.synthetic_step import StepSizes, synthetic_step

# Enough for several whole huge pages whatever the allocation's alignment.
CACHE_BYTES = 12 << 20


def test_a_filled_tensor_collapses_into_huge_pages_unchanged():
    cache = torch.randn(CACHE_BYTES // 4)
    saved = cache.clone()
    advice = advise_huge_pages(cache)
    assert isinstance(advice, HugePageAdvice)
    assert torch.equal(cache, saved)
    page = huge_pages.huge_page_bytes()
    # The whole huge pages inside the storage, and nothing outside it.
    assert CACHE_BYTES - 2 * page <= advice.advised_bytes <= CACHE_BYTES
    if advice.collapsed:
        assert advice.huge_pages and advice.reason is None
        assert anon_huge_page_bytes(cache) >= advice.advised_bytes
    else:  # a system without THP, or one that had no free huge page: it says which
        assert advice.reason
    if transparent_huge_page_mode() in ("always", "madvise"):  # this machine's setting: madvise, Linux 6.18
        assert advice.collapsed, advice.reason


def test_fresh_memory_advised_before_it_is_filled_is_filled_in_huge_pages():
    """A fresh anonymous mapping (memory the allocator may hand out again could already be in 4 KiB pages), advised
    without the collapse, then filled."""
    mapping = mmap.mmap(-1, CACHE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    cache = torch.frombuffer(mapping, dtype=torch.uint8)
    advice = advise_huge_pages(cache, collapse=False)
    cache.fill_(7)
    assert not advice.collapsed and (advice.reason is None) == advice.huge_pages
    if transparent_huge_page_mode() in ("always", "madvise"):
        assert advice.huge_pages, advice.reason
        assert anon_huge_page_bytes(cache) >= advice.advised_bytes > 0
    assert bool((cache == 7).all())
    del cache
    mapping.close()


def test_what_holds_no_huge_page_is_declined_with_its_reason(caplog):
    with caplog.at_level(logging.DEBUG, logger=huge_pages.__name__):
        small = advise_huge_pages(torch.ones(1000))
        meta = advise_huge_pages(torch.empty(CACHE_BYTES, device="meta"))
    assert small == HugePageAdvice(0, False, False, small.reason)
    assert "no whole huge page" in small.reason
    assert not meta.huge_pages and "meta" in meta.reason
    assert len([record for record in caplog.records if record.levelno == logging.DEBUG]) == 2


@pytest.mark.parametrize("refused", [huge_pages.MADV_HUGEPAGE, huge_pages.MADV_COLLAPSE])
def test_a_refusal_is_reported_not_raised(refused, monkeypatch):
    """A system that refuses either advice (an old kernel has no MADV_COLLAPSE: EINVAL) gets a status, the tensor
    stays as it was."""
    calls = []

    def madvise(address, length, advice):
        calls.append(advice)
        if advice == refused:
            ctypes.set_errno(errno.EINVAL)
            return -1
        return 0

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    cache = torch.randn(CACHE_BYTES // 4)
    saved = cache.clone()
    advice = advise_huge_pages(cache)
    assert torch.equal(cache, saved)
    assert not advice.collapsed and "EINVAL" in advice.reason
    assert advice.huge_pages == (refused == huge_pages.MADV_COLLAPSE)
    assert calls == [huge_pages.MADV_HUGEPAGE, huge_pages.MADV_COLLAPSE][:1 + (refused == huge_pages.MADV_COLLAPSE)]


def test_a_system_without_madvise_is_declined(monkeypatch):
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)
    advice = advise_huge_pages(torch.randn(CACHE_BYTES // 4))
    assert advice == HugePageAdvice(0, False, False, "libc has no madvise")


def test_the_synthetic_step_is_the_same_in_huge_pages():
    """The bench's step with its main and pooled-key caches in huge pages (the default) computes the same bits, and
    its caches hold the same values, as with 4 KiB pages; the advice is recorded per cache."""
    # 16K tokens of 2 x 64 bfloat16 keys and values: an 8 MiB main cache.
    sizes = StepSizes(heads=4, kv_heads=2, head_dim=64, index_heads=2, index_head_dim=32, topk=64)
    steps = [synthetic_step([16384, 3000], [1, 1], sizes, seed=2, huge_pages=advised) for advised in (True, False)]
    assert set(steps[0].huge_pages) == {"main", "pooled_keys"} and steps[1].huge_pages == {}
    assert steps[0].huge_pages["main"].collapsed == (transparent_huge_page_mode() in ("always", "madvise"))
    if steps[0].huge_pages["main"].collapsed:
        assert anon_huge_page_bytes(steps[0].caches.main) >= steps[0].huge_pages["main"].advised_bytes > 0
    assert torch.equal(steps[0].caches.main, steps[1].caches.main)
    assert torch.equal(steps[0].caches.pooled_keys, steps[1].caches.pooled_keys)
    with torch.no_grad():
        outputs = [step.run() for step in steps]
    assert torch.equal(outputs[0], outputs[1])
