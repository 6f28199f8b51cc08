"""How the C heap hands large blocks to a process that trains on the CPU: kept for reuse, not returned each step.

glibc's malloc serves every block of 32 MiB or more (and, after a few frees, smaller ones too) with a fresh `mmap`
and unmaps it on `free`. A training step allocates and frees the same large activations and gradients at every
step (the sampled softmax's scores alone are positions x 8192 floats, 109 MB for 64 sentences), so each step the
kernel faults every page of them in again and zeroes it: on the 2-core AMD EPYC of benchmarks/README.md, 2,300
against 2,740 tokens/s on the recipe config. `keep_freed_blocks()` asks malloc to serve large blocks from its heap
and to keep freed memory there, where later steps reuse it without a page fault. The cost is memory: what is freed
stays with the process, and blocks of many sizes can fragment the heap (+450 MiB peak RSS there, before the sampled
softmax stopped making most of those blocks). Allocators such as jemalloc and tcmalloc behave so by default, and
PyTorch's CPU tuning guide recommends preloading one; glibc's own `mallopt` does it here without another library.
On another C library (musl, macOS, Windows) nothing changes.

Its own module, without torch, because it changes the whole process: `hf-elmo pretrain` calls it on a CPU, and
nothing else in the library does.
"""

import ctypes

# glibc's `mallopt` parameters (malloc.h).
M_TRIM_THRESHOLD = -1  # free memory at the top of the heap beyond this many bytes is returned to the system
M_MMAP_MAX = -4  # how many blocks may be served by mmap at once; 0 serves every block from the heap
# The largest trim threshold `mallopt` takes (an int): in practice, never trim.
NEVER_TRIM = 2**31 - 1


def keep_freed_blocks() -> bool:
    """Serve large blocks from the heap and keep freed memory for reuse, process-wide (glibc only). Returns
    whether the C library took both settings."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.gnu_get_libc_version  # noqa: B018  glibc's own symbol: the mallopt parameters above are glibc's
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Trim first: the threshold must stand before the first block that mmap would have served lands in the heap.
    return mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1 and mallopt(M_MMAP_MAX, 0) == 1
