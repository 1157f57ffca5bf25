"""Fault in an array's memory ahead of the writes that would otherwise fault it in.

A replacement member's rows are allocated as zero pages (``np.zeros`` maps them lazily), so a
rebuild's install of scattered stripes is also the first touch of most of the shard, and pays for the
page faults. Linux's ``MADV_POPULATE_WRITE`` (5.14+) faults a range in
writable without touching its bytes, so it can run in a thread while other threads write the same
rows: the values are never read or written by it, only the page tables. A rebuild starts it on a
replacement when it resets it, and it runs while the survivors' reads travel.

Elsewhere (another OS, a kernel before 5.14) nothing happens: the install's writes fault the pages in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading

import numpy as np

MADV_POPULATE_WRITE = 23  # linux/mman.h, since Linux 5.14
PREFAULT_SLICE_BYTES = 8 << 20  # a multiple of every page size (4 KiB, 2 MiB huge pages)


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()


def prefault(array: np.ndarray) -> bool:
    """Fault in every page of ``array`` for writing, leaving its values as they are. True when the
    kernel did it; False where it cannot (the writes then fault the pages in themselves)."""
    if _MADVISE is None or not array.nbytes:
        return False
    page = mmap.PAGESIZE
    address = array.__array_interface__["data"][0]
    # madvise wants a page-aligned start: bytes before the array in its first page are left as they are too.
    start = address - address % page
    end = address + array.nbytes
    # In slices: the kernel may hold the process's memory-map lock for the whole of one call, and any
    # allocation in this process that maps memory (a large array, a message buffer) waits for it.
    for lo in range(start, end, PREFAULT_SLICE_BYTES):
        if _MADVISE(lo, min(PREFAULT_SLICE_BYTES, end - lo), MADV_POPULATE_WRITE) != 0:  # the GIL is released
            return False
    return True


def prefault_in_background(array: np.ndarray) -> threading.Thread:
    """:func:`prefault` in a daemon thread (which keeps ``array`` alive until it is done).

    At normal priority: at a low one, busy cores starve it and the install faults the pages in itself."""
    thread = threading.Thread(target=prefault, args=(array,), name="dlrmflow-prefault", daemon=True)
    thread.start()
    return thread
