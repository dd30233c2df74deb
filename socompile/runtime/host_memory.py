"""Host buffers for optimizer state, backed by 2 MB transparent huge pages where the kernel allows it.

NOTE: why. The CPU Adam step streams seven buffers (weights, gradients, two moments, and with ping-pong
state three more it writes) through memory at the bandwidth limit. With 4 KB pages those streams touch a new
page every 1024 floats, and the TLB misses and page walks become visible: on the 2-core AVX-512 machine of
docs/kernel.md, 2 MB pages made the 128M-parameter step several percent faster and closed most of the
gap between the ping-pong step and the in-place one. torch's CPU allocator only does this when
``THP_MEM_ALLOC_ENABLE=1`` is set before it first allocates, which a library cannot arrange, so large bucket
buffers are allocated here: 2 MB-aligned, ``madvise(MADV_HUGEPAGE)`` before the first touch (Linux with THP
in "madvise" or "always" mode), then zeroed, which faults the huge pages in.

``SOCOMPILE_HUGE_PAGES=0`` turns it off. Anywhere it cannot apply (not Linux, THP "never", a small buffer,
madvise refused) the buffer is an ordinary ``torch.zeros``.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

import torch

log = logging.getLogger("socompile")

HUGE_PAGE = 2 * 2**20
MIN_BYTES = 2 * HUGE_PAGE      # below this, at most one huge page: not worth the padding
_MADV_HUGEPAGE = 14            # <sys/mman.h> on Linux (x86-64 and aarch64 alike)


@functools.cache
def huge_pages_available() -> bool:
    """True when this process may ask for transparent huge pages (Linux, THP not 'never', not turned off)."""
    if os.environ.get("SOCOMPILE_HUGE_PAGES", "1").lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def host_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed, contiguous 1-D CPU tensor of ``numel`` elements; large ones on 2 MB pages when possible.
    The result is a view into a slightly larger allocation (up to 2 MB of alignment padding)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * esize
    if nbytes < MIN_BYTES or not huge_pages_available():
        return torch.zeros(numel, dtype=dtype)
    pad = HUGE_PAGE // esize
    raw = torch.empty(numel + pad, dtype=dtype)           # not touched yet: no page is faulted in
    start = raw.data_ptr()
    aligned = -(-start // HUGE_PAGE) * HUGE_PAGE
    offset = (aligned - start) // esize
    length = nbytes // HUGE_PAGE * HUGE_PAGE              # advise whole huge pages only
    if _madvise()(aligned, length, _MADV_HUGEPAGE) != 0:
        log.debug("socompile: madvise(MADV_HUGEPAGE) failed (errno %d); 4 KB pages", ctypes.get_errno())
    view = raw[offset:offset + numel]
    view.zero_()
    return view
