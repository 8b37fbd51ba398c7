"""Native CPU kernels, compiled on first use by torch's cpp_extension (which caches the build)."""
from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@functools.cache
def gguf_ops():
    """The compiled GGUF-block matmul, or None where it cannot be built; callers then use fp32 weights."""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="kvserve_gguf_matmul", sources=[str(Path(__file__).with_name("gguf_matmul.cpp"))],
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler or headers: slower, never wrong
        logger.warning("GGUF matmul kernel unavailable (%s); using fp32 weights", e)
        return None
