"""Decode steps replayed as CUDA graphs. A decode step launches a few hundred small kernels; issuing them one by
one from Python keeps the GPU waiting on the host. Each batch size bucket's forward pass is captured once, at
start-up (as vLLM does: no request waits for a capture or a Triton compile), over fixed input buffers (tokens,
positions, slots, block tables as wide as the longest sequence allows, context lengths); a step copies its
inputs in and replays the bucket's graph. Rows past the step's sequences write no K/V (slot -1)
and attend over nothing. A tree of guesses' rows replay too: each row's mask of the keys it skips is a buffer.
Where the decode kernel would split long contexts (small buckets), a bucket has a second graph over tables only
SPLIT_KEYS keys wide, which does not split: steps whose contexts all fit replay that one."""
from __future__ import annotations

import time

import torch

from kvserve.attention import ForwardContext, QueryGroup, cuda
from kvserve.attention.cuda import CUDABackend, in_place, split_span


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: CUDABackend, max_seqs: int, max_blocks: int):
        self.model, self.backend = model, backend
        self.sizes = sorted({min(n, max_seqs) for n in (1, 2, 4, 8, *range(16, max_seqs + 16, 16))})
        size, groups, dev = self.sizes[-1], len(backend.windows), backend.cache.device
        self.input_ids = torch.zeros(size, dtype=torch.long, device=dev)
        self.positions = torch.zeros(size, dtype=torch.long, device=dev)
        self.slots = torch.full((groups, size), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros((groups, size, max_blocks), dtype=torch.long, device=dev)
        self.lens = torch.zeros((groups, size), dtype=torch.long, device=dev)
        self.hidden = torch.zeros(size, dtype=torch.long, device=dev)  # QueryGroup.hidden: zeros but in a tree's steps
        self.masked = False  # whether some row's mask may be set
        self.rows = torch.arange(size, device=dev)
        self.short = min(cuda.SPLIT_KEYS // backend.cache.block_size, max_blocks)  # tables' width where no context splits
        # (batch size, tables' width) -> graph, its hidden states
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def capture(self) -> None:
        """Every bucket's graphs. The buffers write no K/V (slots -1) and attend over nothing (lengths 0) until a step
        fills them, so capturing touches no block."""
        start, full = time.perf_counter(), self.tables.shape[2]
        for size in reversed(self.sizes):
            self.graphs[size, full] = self._capture(size, full)
            if 0 < self.short < full and self._splits(size, full):
                self.graphs[size, self.short] = self._capture(size, self.short)
        self.capture_seconds = time.perf_counter() - start

    def _splits(self, size: int, width: int) -> bool:
        """Whether some layer's decode kernel splits contexts at this batch size and tables' width."""
        cache = self.backend.cache
        return any(split_span(size, k["data"].shape[2], width * cache.block_size, cache.device) for k in cache.k if k)

    def fits(self, ctx: ForwardContext) -> bool:
        """Whether this step is one a graph runs: one query row a token, all attending in place (guesses count, a
        row each, a tree's too; votes do not), in order, within the buffers."""
        group = ctx.groups[0]
        return (ctx.backend is self.backend and len(ctx.groups) == 1 and in_place(group) and group.in_order and ctx.votes is None
                and len(ctx.positions) <= self.sizes[-1] and max(t.shape[1] for t in group.block_tables) <= self.tables.shape[2])

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The step's hidden states [T, hidden], as the model's forward pass would give them."""
        n, group = len(input_ids), ctx.groups[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = ctx.positions
        self.slots[:, :n] = torch.stack(ctx.slot_mappings)
        self.slots[:, n:size] = -1
        self.lens[:, :n] = torch.stack(group.context_lens)
        self.lens[:, n:size] = 0
        for g, table in enumerate(group.block_tables):
            self.tables[g, :n, :table.shape[1]] = table
        if group.hidden is not None:  # rows past n keep older masks: padding rows, which attend over nothing
            self.hidden[:n] = group.hidden
            self.masked = True
        elif self.masked:
            self.hidden.zero_()
            self.masked = False
        short = max(t.shape[1] for t in group.block_tables) <= self.short
        graph, hidden = (short and self.graphs.get((size, self.short))) or self.graphs[size, self.tables.shape[2]]
        graph.replay()
        return hidden[:n]

    def context(self, size: int, width: int) -> ForwardContext:
        """The step context over the buffers' first `size` rows and `width` table columns: one decode group, in order."""
        rows = self.rows[:size]
        group = QueryGroup(rows[:, None], rows, list(self.tables[:, :size, :width]), [None] * len(self.tables), rows,
                           list(self.lens[:, :size]), in_order=True, hidden=self.hidden[:size])
        return ForwardContext(self.positions[:size], list(self.slots[:, :size]), [group], self.backend)

    def _capture(self, size: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, ctx = self.input_ids[:size], self.context(size, width)
        stream = torch.cuda.Stream()  # warm up outside the capture: Triton compiles, cuBLAS picks its kernels
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(ids, ctx)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = self.model(ids, ctx)
        return graph, hidden
