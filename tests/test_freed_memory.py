"""The ``cb`` application keeps the memory a step frees for the next step (``hold_freed_memory``); the library does not.

The allocator setting is process-wide, so a library constructor must not
make it for its host: building an engine leaves glibc as it was, and the
``cb`` commands opt in (:func:`cbcore.cli.main.opt_in_process_settings`).
What the opt-in guarantees, checked through the C library's own accounting
(``mallinfo2``) rather than through how many pages some allocation pattern
happens to touch: once it is made, a block just under
``HEAP_BLOCK_BYTES`` comes from the heap (glibc's defaults would map it
with ``mmap`` and unmap it on free), freeing it returns nothing to the
kernel, and allocating it again touches no new page. Page faults per engine
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
import ctypes, resource, sys
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
before = libc.mallinfo2()
block = libc.malloc(size)
ctypes.memset(block, 1, size)
allocated = libc.mallinfo2()
libc.free(block)
freed = libc.mallinfo2()
start = faults()
block = libc.malloc(size)
ctypes.memset(block, 2, size)
again = faults() - start
libc.free(block)
print(size, allocated.hblkhd - before.hblkhd, allocated.arena - freed.arena, again)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and mallinfo2"
)
def test_the_cb_applications_freed_memory_stays_with_the_process_and_an_engine_alone_changes_nothing():
    (size, mapped, returned, faults), library = last_line_of_each(SCRIPT, "application", "library")
    assert library[1] > 0, "building an engine changed glibc's allocator: that is the application's choice"
    assert mapped == 0, f"a block of {size} bytes was mapped with mmap ({mapped} bytes), not taken from the heap"
    assert returned <= 0, f"freeing it gave {returned} bytes of the heap back to the kernel"
    assert faults < size // 4096 // 100, f"allocating it again took {faults} page faults (of {size // 4096} pages)"
