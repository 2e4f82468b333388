"""The ``cb`` application's allocator setting: keep what a step frees for the next step.

Its own module, without torch, so that processes which run no model (``cb
simulate``, ``cb bench --server``) set it without importing torch (1.5 s of
CPU and over 200 MB resident).
"""

from __future__ import annotations

import ctypes
import platform

#: glibc's ``mallopt`` parameters: below this size an allocation comes from the heap; what is freed stays;
#: every thread allocates from the one heap.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
HEAP_BLOCK_BYTES = 32 * 2**20  # glibc's largest heap allocation (HEAP_MAX_SIZE / 2 on 64-bit)


def hold_freed_memory() -> str | None:
    """Keep the memory a step frees for the next step instead of returning it to the kernel; None, else why not.

    glibc gives a freed block of more than its (adaptive) threshold back with
    ``munmap`` and trims the heap's top, so every step's activations are new
    pages: a 16 x 128 prefill of the default model took 128,700 page faults
    (0.43-0.47 s of system time each step, 2-core host). With every block up
    to :data:`HEAP_BLOCK_BYTES` from the heap and no trimming, the pages of one
    step serve the next (0 faults after the first); resident memory stays at
    the largest step's, as with a caching allocator. Process-wide, so set once,
    before the threads that allocate start.

    One arena for every thread: glibc gives a thread other than the main one
    an arena of its own, made of heaps of at most 64 MiB that it unmaps as
    soon as all they hold is freed, whatever the thresholds. ``cb serve``
    steps the engine on such a thread, where a prefill of 14 x 128 tokens
    beside 2 decodes took 1.20 s a step against 0.90 s on the main thread
    (0.90 s with one arena; 2-core AMD EPYC). The threads that allocate are
    few (the engine's and the event loop's), so sharing one arena's lock
    costs nothing measurable.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return f"the C library ({platform.libc_ver()[0] or 'unknown'}) has no mallopt"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    thresholds = ((_M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1))
    if not all(mallopt(param, value) for param, value in thresholds):
        return "mallopt refused the thresholds"
    return None
