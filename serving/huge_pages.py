"""Transparent huge pages for the paged caches on a CPU: the kernels of a long-context decode step read each selected
window (a ~2 KB run of one head's keys and values) somewhere in a cache of hundreds of megabytes, so with 4 KiB pages
every window is a TLB miss and a page walk; in 2 MiB pages the walks mostly hit the caches.

vLLM's CPU worker allocates all layers' caches as one zeroed tensor (`torch.zeros`), in 4 KiB pages where the
system's THP setting is `madvise` (the usual default). `advise_huge_pages` asks Linux to back a tensor's storage with
huge pages from now on (`madvise(MADV_HUGEPAGE)`) and to move what is already there into them at once
(`MADV_COLLAPSE`, Linux 6.1 and later): best effort, it reports what the system granted and never raises.
`anon_huge_page_bytes` reads how much of a tensor's memory is in huge pages (`AnonHugePages` of
`/proc/self/smaps`).
"""

import ctypes
import ctypes.util
import errno
import logging
import os
import sys
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Linux's madvise advice values (<asm-generic/mman-common.h>).
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
# The PMD-sized huge page where sysfs does not say (x86-64 and arm64 with 4 KiB pages).
DEFAULT_HUGE_PAGE_BYTES = 2 << 20


@dataclass(frozen=True)
class HugePageAdvice:
    """What `advise_huge_pages` asked and was granted: `advised_bytes` (the whole huge pages inside the storage, 0
    where there are none), whether `MADV_HUGEPAGE` and `MADV_COLLAPSE` succeeded, and `reason` (the first refusal, or
    why nothing was asked), None when both succeeded."""

    advised_bytes: int
    huge_pages: bool
    collapsed: bool
    reason: str | None = None


def huge_page_bytes() -> int:
    """The size of a transparent huge page (sysfs `hpage_pmd_size`; 2 MiB where it cannot be read)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as file:
            return int(file.read())
    except (OSError, ValueError):
        return DEFAULT_HUGE_PAGE_BYTES


def transparent_huge_page_mode() -> str:
    """The system's THP setting (`always`, `madvise` or `never`: the bracketed word of sysfs `enabled`), '' where
    there is none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as file:
            return file.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


def _madvise():
    """libc's `madvise(void *, size_t, int)` with errno kept, or None where there is none."""
    path = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(path, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _storage_range(tensor: torch.Tensor) -> tuple[int, int]:
    """(first byte, end) of the whole storage under `tensor` (a view of vLLM's cache may stride over all of it)."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def advise_huge_pages(tensor: torch.Tensor, collapse: bool = True) -> HugePageAdvice:
    """Ask Linux to back the storage of CPU tensor `tensor` with transparent huge pages: `MADV_HUGEPAGE` on the whole
    huge pages inside it (pages filled from now on come in huge pages), then, with `collapse`, `MADV_COLLAPSE` on the
    same range (what is already filled moves into huge pages now; the contents are unchanged). Best effort: returns
    what was granted (`HugePageAdvice`), never raises; a refusal is logged at debug level."""

    def declined(reason: str, advised: int = 0, huge_pages: bool = False) -> HugePageAdvice:
        logger.debug("hybrid_indexpool: no huge pages for a cache of %d bytes: %s", tensor.nbytes, reason)
        return HugePageAdvice(advised, huge_pages, False, reason)

    if tensor.device.type != "cpu":
        return declined(f"the tensor is on {tensor.device.type}, not the CPU")
    if not sys.platform.startswith("linux"):
        return declined(f"transparent huge pages are Linux's ({sys.platform} has none)")
    madvise = _madvise()
    if madvise is None:
        return declined("libc has no madvise")
    page = huge_page_bytes()
    start, end = _storage_range(tensor)
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return declined(f"the storage ({end - start} bytes) holds no whole huge page of {page} bytes")
    length = last - first
    if madvise(first, length, MADV_HUGEPAGE) != 0:
        code = ctypes.get_errno()
        return declined(f"madvise(MADV_HUGEPAGE) failed: {errno.errorcode.get(code, code)} ({os.strerror(code)})",
                        length)
    if not collapse:
        return HugePageAdvice(length, True, False)
    if madvise(first, length, MADV_COLLAPSE) != 0:
        code = ctypes.get_errno()
        # EINVAL: a kernel before 6.1; EAGAIN/ENOMEM: no free huge page for some of the range (the rest collapsed).
        return declined(f"madvise(MADV_COLLAPSE) failed: {errno.errorcode.get(code, code)} ({os.strerror(code)})",
                        length, huge_pages=True)
    return HugePageAdvice(length, True, True)


def anon_huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the mappings holding `tensor`'s storage that are in transparent huge pages (the `AnonHugePages` of
    each mapping of `/proc/self/smaps` that overlaps it; mappings can be larger than the tensor). 0 where smaps
    cannot be read."""
    start, end = _storage_range(tensor)
    total, overlaps = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                first = line.split(maxsplit=1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping's header: `begin-end perms ...`
                    low, high = (int(address, 16) for address in first.split("-"))
                    overlaps = low < end and start < high
                elif overlaps and first == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
