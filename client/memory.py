"""Allocator tuning for processes that move multi-megabyte messages (actors and servers).

glibc's malloc serves a request above a *dynamic* threshold (128 KiB at first)
with a fresh ``mmap`` and gives freed memory at the top of a heap back to the
kernel once more than twice that threshold is free.  A process that allocates
and frees a 1 MB message buffer hundreds of times a second (protobuf's
serialised bytes, gRPC's receive buffer, numpy's copies) then takes hundreds of
page faults per message: the kernel zeroes every page again.  In ``duelq bench``
on a 2-core VM that was more than half of an actor's CPU time per TrainStream
step at B = 1024.

:func:`tune_malloc` fixes both thresholds so that such buffers are reused from
the heap.  It is opt-in and process-wide (call it once, early); the same can be
had without code by setting ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` in the environment.  The cost is memory: up to
``trim_threshold`` bytes of freed heap per arena stay with the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep buffers up to ``mmap_threshold`` bytes in the heap; True when it took effect.

    False where the C library is not glibc (musl, macOS) or refuses the values.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = (mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
            and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1)
    log.debug("malloc thresholds: mmap %d, trim %d: %s", mmap_threshold, trim_threshold,
              "set" if done else "not set")
    return done
