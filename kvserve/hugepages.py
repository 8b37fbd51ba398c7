"""Large CPU buffers on transparent huge pages. A decode step streams every weight and much of the KV cache: on
4 KiB pages that is a TLB miss every 4 KiB (in a VM, a walk of two page tables), on 2 MiB pages one per 2 MiB.
Linux backs anonymous memory with huge pages where a program asks (THP "madvise", a common default) or always."""
from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device); on the CPU, a buffer of 2 MiB or more is mapped on its own, its
    whole 2 MiB spans advised onto huge pages (plain pages where the OS says no, and for the tail, so that no page
    holds more than the buffer), and committed now, as torch.zeros commits it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # fresh pages: none faulted in yet
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until the tensor goes
    start = -raw.data_ptr() % HUGE_PAGE  # huge pages cover 2 MiB-aligned spans only
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP "never", or a kernel without it
        pass
    return raw[start:start + nbytes].view(dtype).view(shape).zero_()


def return_freed_memory() -> None:
    """Hand the heap memory freed so far back to the OS (glibc keeps it; loading frees about a model's worth:
    the file's blocks once packed, parts once fused or gathered). Elsewhere, nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError, TypeError):  # not glibc
        pass
