"""cbcore's own C kernels for the CPU and their Python wrappers: the speed path, not the engine.

Each kernel is one C file here (``simd.h`` holds their shared vector helpers),
compiled on first use for this CPU and loaded with ctypes by :mod:`.native`.
The ``sdpa`` backend reads the paged KV pool with ``paged_decode`` and runs a
step's whole prompts with ``prompt_attention``; the fused forward
(:mod:`cbcore.models`) multiplies decode-sized products with ``small_gemm.c``
and runs its elementwise glue in ``decoder_ops.c``. Where a kernel cannot be
built, its caller says why and runs torch's operators instead, so the engine
never depends on this folder to be correct.
"""
