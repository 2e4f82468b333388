"""The ``cb`` application keeps the memory a step frees for the next step (``hold_freed_memory``); the library does not.

The allocator setting is process-wide, so a library constructor must not
make it for its host: building an engine leaves glibc as it was, and the
``cb`` commands opt in (:func:`cbcore.cli.main.opt_in_process_settings`).
What the opt-in guarantees, checked through the C library's own accounting
(``mallinfo2``) rather than through how many pages some allocation pattern
happens to touch: once it is made, blocks just under ``HEAP_BLOCK_BYTES``
come from the heap (glibc's defaults would map them with ``mmap`` and unmap
them on free), freeing them returns nothing to the kernel, and allocating
them again touches no new page, on the main thread and on one started
after the opt-in (``cb serve`` steps the engine on its own thread, where
glibc would give it an arena of its own, whose heaps it unmaps once
empty). Page faults per engine
step depended on glibc's adaptive thresholds and on the machine (a control
run with the defaults faulted 200+ times a step on one host and 0-2 times
on another), so they are not asserted.
"""

from __future__ import annotations

import platform
import sys

import pytest
from support.script_processes import last_line_of_each

SCRIPT = """
import ctypes, resource, sys, threading
from cbcore import Engine
from cbcore.cli.main import opt_in_process_settings
from cbcore.kernels.heap import HEAP_BLOCK_BYTES
from cbcore.testing.tiny_models import tiny_model

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt

Engine(tiny_model("llama"))  # a library user's engine: glibc's defaults stay
if sys.argv[1] == "application":
    opt_in_process_settings()  # what every `cb` command does first
size = HEAP_BLOCK_BYTES - 2**20
found = []

def measure():  # three blocks: more than one of glibc's 64 MiB thread heaps holds
    before = libc.mallinfo2()
    blocks = [libc.malloc(size) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    allocated = libc.mallinfo2()
    for block in blocks:
        libc.free(block)
    freed = libc.mallinfo2()
    start = faults()
    blocks = [libc.malloc(size) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 2, size)
    again = faults() - start
    for block in blocks:
        libc.free(block)
    found.extend([allocated.hblkhd - before.hblkhd, allocated.arena - freed.arena, again])

measure()
thread = threading.Thread(target=measure)
thread.start()
thread.join()
print(size, *found)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and mallinfo2"
)
def test_the_cb_applications_freed_memory_stays_with_the_process_and_an_engine_alone_changes_nothing():
    (size, *application), library = last_line_of_each(SCRIPT, "application", "library")
    assert library[1] > 0, "building an engine changed glibc's allocator: that is the application's choice"
    for where, (mapped, returned, faults) in zip(("main", "another"), (application[:3], application[3:]), strict=True):
        assert mapped == 0, f"{where} thread: a block of {size} bytes was mapped ({mapped} bytes), not from the heap"
        assert returned <= 0, f"{where} thread: freeing it gave {returned} bytes of the heap back to the kernel"
        pages = 3 * size // 4096
        assert faults < pages // 100, f"{where} thread: allocating it again took {faults} page faults (of {pages})"
