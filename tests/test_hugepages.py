"""Weights and the KV pool on transparent huge pages (kvserve/hugepages.py): zeroed like torch.zeros, aligned to
2 MiB, backed by huge pages where the OS allows, and a model's packed weights gathered into one such buffer."""
from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from kvserve import hugepages
from kvserve.kernels import Activations, native_ops
from kvserve.layers.quantized import GGUFTensor, QuantizedWeight, gather_on_huge_pages
from tests.test_kernels import T, random_blocks

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, in KiB (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_are_zeros_of_the_shape_and_dtype_asked_for():
    for shape, dtype in (((3, 5), torch.float32), ((700, 16, 3, 64), torch.float16), ((1 << 21,), torch.uint8)):
        t = hugepages.zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
    big = hugepages.zeros((700, 16, 3, 64), torch.float16)
    assert big.data_ptr() % hugepages.HUGE_PAGE == 0  # huge pages cover aligned 2 MiB spans only


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off on this machine")
def test_a_large_buffer_lies_on_huge_pages_and_its_tail_on_small_ones():
    t = hugepages.zeros((5 * hugepages.HUGE_PAGE + 4096,), torch.uint8)  # five huge pages and a 4 KiB tail
    t.fill_(1)
    assert huge_kib(t.data_ptr()) == 5 * 2048
    assert huge_kib(t.data_ptr() + t.numel() - 1) == 0  # the tail's span is not advised: no page holds memory past the buffer
    if "[madvise]" in THP.read_text():  # where only an advised mapping gets them, a fresh unadvised one does not
        plain = mmap.mmap(-1, 3 * hugepages.HUGE_PAGE)  # (not torch.zeros: the allocator may hand back freed, advised memory)
        plain.write(b"\1" * len(plain))
        view = torch.frombuffer(plain, dtype=torch.uint8)
        assert huge_kib(view.data_ptr()) == 0
        del view
        plain.close()


@pytest.mark.skipif(native_ops() is None, reason="no AVX2 CPU or no C++ compiler")
def test_gathered_weights_lie_in_one_buffer_in_order_and_multiply_as_before():
    weights = [QuantizedWeight.pack(GGUFTensor(torch.from_numpy(random_blocks(qtype, rows, 256, seed=rows)), qtype.name, (rows, 256)))
               for qtype, rows in ((T.Q4_1, 3000), (T.Q8_0, 40), (T.Q6_K, 7))]
    x = torch.randn(3, 256)
    before = [w.matmul(x, Activations.INT8) for w in weights]
    gather_on_huge_pages(weights)
    parts = [rows for w in weights for _, rows in w.parts]
    assert all(a.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr() for a in parts)
    assert all(a.data_ptr() + a.nbytes <= b.data_ptr() and b.data_ptr() % 64 == 0 for a, b in zip(parts, parts[1:]))
    for w, expected in zip(weights, before):
        assert torch.equal(w.matmul(x, Activations.INT8), expected)
