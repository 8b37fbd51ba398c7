"""Native CPU kernels (AVX2, and AVX-512 VNNI picked at run time where the CPU has it), compiled on first use by
torch's cpp_extension, which caches the build.

They register as torch ops under torch.ops.kvserve: gguf_pack, gguf_select, gguf_rows, gguf_dequantize, gguf_matmul, kernel_isa,
set_kernel_isa, kernel_seconds, attention_seconds, paged_decode_attention, rms_norm, rope_, silu_and_mul; and the classes
torch.classes.kvserve.DecodeLayer (a Llama-family decoder layer for decode steps), DecodeStack (a model's
DecoderLayers bound to their KV stores, run in one call) and FeatureDraft (an EAGLE-style draft's guesses in one call);
and, in its Python module (native_module), WholeStep and DraftStep: a DecodeStack's whole decode step and a
FeatureDraft's guesses as plain pybind11 calls.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCES = ["quant_matmul.cpp", "quant_matmul_avx512.cpp", "decode_layer.cpp", "paged_attention.cpp", "paged_attention_avx512.cpp",
           "pointwise.cpp"]


class Activations(enum.IntEnum):
    """What the kernels multiply a packed weight by (kernels/quants.h): the fp32 rows; the rows quantized to int8 per 32
    values, a step of 32 rows or more in bf16 on AMX's tiles where the CPU has them; or int8 rows at every step size,
    so that a row's numbers never depend on the rows beside it (batch_invariant)."""

    FP32 = 0
    INT8 = 1
    INT8_ONLY = 2


def triton_ops():
    """kernels/pointwise_triton.py (the pointwise ops for CUDA), or None where Triton is not installed."""
    try:
        from kvserve.kernels import pointwise_triton as ops
    except ImportError:  # torch's CUDA builds bring Triton on Linux, not everywhere
        return None
    return ops


@functools.cache
def native_ops():
    """The `torch.ops.kvserve` namespace, or None where the kernels cannot be built (callers use plain torch)."""
    return None if native_module() is None else torch.ops.kvserve


@functools.cache
def native_module():
    """The kernels' Python module (its pybind11 classes: WholeStep), or None where they cannot be built. Loading it
    registers the torch ops and classes."""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        from torch.utils.cpp_extension import load

        here = Path(__file__).parent
        # torch's build cache hashes the sources only; the name carries every file's digest, headers included
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("*.[ch]*")))).hexdigest()[:12]
        announce_build(f"kvserve_kernels_{digest}")
        return load(name=f"kvserve_kernels_{digest}", sources=[str(here / s) for s in SOURCES], is_python_module=True,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler or headers: slower, never wrong
        logger.warning("kvserve kernels unavailable (%s); using plain torch", e)
        return None


def announce_build(name: str) -> None:
    """Say so when the kernels named `name` are not built yet: the build takes minutes on 2 cores, silent otherwise."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # where load() builds and caches them

        built = (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a private function of torch's: a notice is not worth losing the kernels over
        return
    if not built:
        logger.warning("kvserve: compiling the native CPU kernels (once after an install or update; a few minutes on 2 cores)")


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU and the kernels' instruction set, for a benchmark's header (ratios are only comparable on one
    machine), e.g. 'AMD EPYC (family 25, model 1), kernels avx2'. Linux's cpuinfo names the CPU; elsewhere,
    platform.processor()."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():  # the first processor's fields
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    ops = native_ops()
    return f"{name}, kernels {ops.kernel_isa() if ops is not None else 'none (plain torch)'}"
