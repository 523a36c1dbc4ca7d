"""The C library's allocator in a process that computes on the CPU: freed memory kept for the next pass, as a GPU's
caching allocator keeps it, and counted as free.

glibc hands every allocation above its mmap threshold (at most 32 MiB, adjusted as it goes) its own mapping and
unmaps it on free, and gives the heap's freed top back past its trim threshold: a training pass's large tensors
(logits, a MoE layer's rows) then fault in every page again, pass after pass. Measured on 2 CPU cores, one thread:
multiplying a 2,048 × 8,192 float32 tensor took 35 ms, its ``exp`` 48 ms; with the thresholds raised (``keep_freed``)
6 and 17 ms; a whole training step of ``bench/moe_lora.py``'s ``cpu-128x8`` shape 1.02–1.10 s against 0.81–0.86 s.

What is kept stays this process's resident memory, free to its own allocations: ``heap_free_bytes`` is what a pass
may count on beside what the system calls available (``adapters.trainer.memory``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("compat_server.cpu_memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_BELOW = 2**31 - 1
"""Allocations below this many bytes come from the heap, which keeps them when freed (the most ``mallopt`` takes)."""


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "mallinfo2") else None
    except OSError:
        return None


_LIBC = _libc()


def keep_freed() -> bool:
    """Keep freed memory in this process for its next allocations (glibc; elsewhere nothing changes). Returns
    whether both settings took."""
    if _LIBC is None:
        log.info("this C library has no mallopt: freed memory is handled as it handles it")
        return False
    return all(_LIBC.mallopt(ctypes.c_int(option), ctypes.c_int(KEEP_BELOW)) == 1
               for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD))


def heap_free_bytes() -> int:
    """Bytes the allocator holds free in this process (glibc's ``mallinfo2().fordblks``; 0 where unknown)."""
    if _LIBC is None:
        return 0
    _LIBC.mallinfo2.restype = _Mallinfo2
    return int(_LIBC.mallinfo2().fordblks)
