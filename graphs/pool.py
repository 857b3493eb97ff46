"""The graph pool: one captured forward per graph key, replayed over refreshed static buffers.

Replay pattern, for every batch:
  1. build the batch's metadata on the CPU at the key's capacity (padding = empty segments; kept for
     batches that recur, such as a lone image of a common size);
  2. copy the pixels, then all metadata arrays at once, into the static input buffers (pinned, async);
     metadata the device already holds (the same batch layout as the graph's region last took) is
     not copied again;
  3. replay, then copy the item rows out of the static outputs before any other graph runs.
All graphs share one memory pool, captured largest first, one pixel buffer and one output buffer
sized for the largest capacity (each graph reads a prefix view). The metadata buffers of the graphs
of one patch count (one budget) are regions of one device allocation of their own, laid out like a
page-locked host staging buffer, so a replay uploads them in one copy: every torch call releases and
retakes the GIL, which under a busy server costs up to a switch interval each, and each copy the
device waits for delays a lone batch. Nothing a graph reads is reallocated after its capture. On the
CPU there is no graph: "replay" re-runs the fixed-shape forward on the same static buffers, so the
packing, refresh and padding logic is exercised everywhere.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from graphs.budgets import BudgetPlan, GraphKey
from graphs.stats import PoolStats
from models.protocol import Capacity, Grid, VisionTower

log = logging.getLogger("vitserve.graphs")


@dataclass
class CapturedGraph:
    key: GraphKey
    capacity: Capacity
    inputs: dict[str, torch.Tensor]  # static views: the shared pixel buffer, its budget's metadata region
    output: torch.Tensor  # static joined output rows (outside the pool, overwritten by later replays)
    graph: torch.cuda.CUDAGraph | None  # None on the CPU backend


class GraphPool:
    def __init__(self, tower: VisionTower, device: torch.device, plan: BudgetPlan, stats: PoolStats) -> None:
        self.tower = tower
        self.device = device
        self.plan = plan
        self.stats = stats
        self.graphs: dict[GraphKey, CapturedGraph] = {}
        self.failed: dict[GraphKey, str] = {}
        self._pixels: torch.Tensor | None = None
        self._regions: dict[int, MetadataRegion] = {}  # by the capacity's patch count
        self._meta_dtypes: dict[str, np.dtype] = {}
        # Packed metadata of recent batches by (key, grids): a lone image of a common size recurs, and
        # building its metadata (0.24 ms for Qwen2.5-VL's windows, H200 host) delays its replay.
        self._meta_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._meta_cache_bytes = 0
        self._joined: torch.Tensor | None = None
        self._mempool = None
        self._warmup: torch.cuda.Stream | None = None

    # ---- capture ------------------------------------------------------------------------
    def capture(self, keys: list[GraphKey], stop_at_out_of_memory: bool = False) -> None:
        """Capture `keys`, largest first; a key that fails is served eagerly. With `stop_at_out_of_memory`
        (a memory budget: the caller captures again with smaller budgets), the first key that runs out
        of memory ends the capture: every later one would run short in what the failure left behind."""
        start = time.perf_counter()
        is_cuda = self.device.type == "cuda"
        if is_cuda:
            torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device) if is_cuda else 0
        if is_cuda:
            self._mempool = torch.cuda.graph_pool_handle()
            self._warmup = self._warmup_stream()
        keys = sorted(keys, key=lambda k: -self.plan.capacity(k).patches)
        self._allocate_inputs([self.plan.capacity(k) for k in keys])
        self._allocate_outputs(max((self.tower.geometry.output_rows(self.plan.capacity(k)) for k in keys), default=0))
        self._capture_keys(keys, stop_at_out_of_memory)
        if is_cuda:
            torch.cuda.synchronize(self.device)
            # The warm-up runs' activations sit cached in the ordinary allocator (gigabytes for the
            # largest budget); hand them back so that what stays taken is the graphs' own pool and
            # the shared buffers, which is what pool_bytes reports (the allocator's own count: other
            # processes on the device do not move it).
            torch.cuda.empty_cache()
            self.stats.pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved_before)
        self._recount()
        self.stats.capture_seconds = time.perf_counter() - start
        if is_cuda:
            self.stats.graph_mode, self.stats.no_graphs_reason = "cuda_graphs", None
            log.info("graph pool: %d CUDA graphs in %.1fs, %.1f MiB, %d failed", self.stats.captured,
                     self.stats.capture_seconds, self.stats.pool_bytes / 2**20, len(self.failed))
        else:
            self.stats.graph_mode, self.stats.no_graphs_reason = "cpu_fixed_shape", CPU_NO_GRAPHS
            log.info("running on the CPU: no CUDA graphs; each of the %d graph keys runs as a fixed-shape eager "
                     "forward (the same packing and padding, for trying the API, not for speed)", len(self.graphs))

    def _capture_keys(self, keys: list[GraphKey], stop_at_out_of_memory: bool = False) -> dict[GraphKey, str]:
        """Capture `keys` in this order into the pool's memory and buffers; the failures, by key."""
        is_cuda = self.device.type == "cuda"
        failures = {}
        for key in keys:
            cap = self.plan.capacity(key)
            t0 = time.perf_counter()
            try:
                self.graphs[key] = self._capture_one(key, cap)
                log.debug("%s %s %s in %.3fs", "captured" if is_cuda else "prepared", key, cap,
                          time.perf_counter() - t0)
            except Exception as exc:  # a failed key is served eagerly, never fatal
                failures[key] = self.failed[key] = f"{type(exc).__name__}: {exc}"
                self.stats.capture_failures[str(key)] = self.failed[key]
                log.error("capture of %s failed, it will run eagerly: %s", key, self.failed[key])
                if is_cuda:
                    torch.cuda.synchronize(self.device)
                    # A capture that raised leaves its private pool unusable (PyTorch's allocator then
                    # asserts on every later capture into it): the keys after it get a new one.
                    self._mempool = torch.cuda.graph_pool_handle()
                if stop_at_out_of_memory and isinstance(exc, torch.OutOfMemoryError):
                    break
        return failures

    def capture_more(self, keys: list[GraphKey]) -> dict[GraphKey, str]:
        """Capture `keys` after start-up, into the memory pool and the input and output buffers the others
        use (the live graphs read those buffers: nothing is reallocated). The device must be idle: nothing
        else may run or wait on it meanwhile from any thread of this process (a capture then fails, or
        breaks theirs). A key whose capacity the buffers cannot hold is refused; the failures, by key."""
        if self._pixels is None or self._joined is None:
            raise RuntimeError("capture_more needs a pool captured at start-up")
        is_cuda = self.device.type == "cuda"
        failures: dict[GraphKey, str] = {}
        fitting = []
        for key in sorted(keys, key=lambda k: -self.plan.capacity(k).patches):
            why = self._overflow(self.plan.capacity(key))
            if why:
                failures[key] = why
            elif key not in self.graphs:
                fitting.append(key)
        reserved_before = torch.cuda.memory_reserved(self.device) if is_cuda else 0
        start = time.perf_counter()
        self._add_regions([self.plan.capacity(key) for key in fitting])  # live graphs read none of the new ones
        failures.update(self._capture_keys(fitting))
        if is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.stats.pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved_before)
        self._recount()
        log.info("graph pool: %d more graph(s) in %.2fs, %d failed", sum(k in self.graphs for k in fitting),
                 time.perf_counter() - start, len(failures))
        return failures

    def _overflow(self, cap: Capacity) -> str | None:
        """Why the buffers live graphs share cannot hold a capacity's inputs and output, or None."""
        assert self._pixels is not None and self._joined is not None
        if cap.patches > self._pixels.shape[0]:
            return f"pixels: {cap.patches} rows, the buffers hold {self._pixels.shape[0]}"
        region = self._regions.get(cap.patches)
        for name, arr in (self.tower.build_metadata([], cap).items() if region else ()):
            if arr.shape[0] > region.buffers[name].shape[0]:
                return f"{name}: {arr.shape[0]} rows, the buffers hold {region.buffers[name].shape[0]}"
        rows = self.tower.geometry.output_rows(cap)
        if rows > self._joined.shape[0]:
            return f"output: {rows} rows, the buffer holds {self._joined.shape[0]}"
        return None

    def drop(self, keys: list[GraphKey]) -> None:
        """Forget graphs (and failures) of these keys: their batches run eagerly."""
        for key in keys:
            self.graphs.pop(key, None)
            self.failed.pop(key, None)
            self.stats.capture_failures.pop(str(key), None)
        self._recount()

    def fail(self, keys: list[GraphKey], reason: str) -> None:
        """Drop these keys' graphs as failed: their batches run eagerly, with the reason in the stats."""
        for key in keys:
            self.graphs.pop(key, None)
            self.failed[key] = self.stats.capture_failures[str(key)] = reason
        self._recount()

    def _recount(self) -> None:
        self.stats.captured = sum(g.graph is not None for g in self.graphs.values())
        self.stats.graph_keys = len(self.graphs)

    def _warmup_stream(self) -> torch.cuda.Stream:
        """The one side stream every capture's warm-up runs on, its cuBLAS workspace made first.

        cuBLAS gives each stream a workspace from the caching allocator, carved from whatever free
        segment fits. Made lazily by a warm-up's first product after gigabytes of activations on that
        stream, it pins a mostly free segment that emptying the cache cannot return: with a new pooled
        stream per key, 31 such segments held 7.6 GiB on an H200 (Qwen2.5-VL, 126 graphs)."""
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream), torch.inference_mode():
            x = torch.zeros(8, 8, device=self.device, dtype=self.tower.dtype)
            torch.nn.functional.linear(x, x, x[0])  # the workspace of the product with bias (cuBLASLt)
            x @ x
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return stream

    def _allocate_inputs(self, caps: list[Capacity]) -> None:
        """The pixel buffer, as long as the longest capacity needs, and the metadata regions, before any capture."""
        patches = max((cap.patches for cap in caps), default=0)
        self._pixels = torch.zeros((patches, self.tower.processor.patch_dim), dtype=torch.uint8, device=self.device)
        self._regions.clear()
        self._add_regions(caps)

    def _add_regions(self, caps: list[Capacity]) -> None:
        """A metadata region for each patch count of `caps` the pool has none for: each buffer as long as the longest
        of those capacities needs, back to back in one device allocation."""
        longest: dict[int, dict[str, np.ndarray]] = {}
        for cap in caps:
            if cap.patches in self._regions:
                continue
            group = longest.setdefault(cap.patches, {})
            for name, arr in self.tower.build_metadata([], cap).items():
                if name not in group or arr.shape[0] > group[name].shape[0]:
                    group[name] = arr
        for patches, group in longest.items():
            offsets, size = {}, 0
            for name, arr in group.items():
                offsets[name] = size
                self._meta_dtypes[name] = arr.dtype
                size += -(-arr.nbytes // META_ALIGN) * META_ALIGN
            flat = torch.zeros(size, dtype=torch.uint8, device=self.device)
            buffers = {name: flat[offsets[name]:offsets[name] + arr.nbytes].view(torch.from_numpy(arr).dtype)
                       .view(arr.shape) for name, arr in group.items()}
            self._regions[patches] = MetadataRegion(flat, offsets, buffers)

    def _allocate_outputs(self, tokens: int) -> None:
        """Every graph writes its result here, outside the graph memory pool, so no graph output
        lives in memory that another graph's replay overwrites, and the pool holds only scratch. One
        [tokens, out_hidden * (1 + DeepStack layers)] buffer: the main embedding, then each DeepStack
        level, side by side (vLLM's layout), so a batch's result leaves the device in one copy."""
        hidden = self.tower.out_hidden_size
        self._joined = torch.zeros((tokens, hidden * (1 + self.tower.num_deepstack)), dtype=self.tower.dtype,
                                   device=self.device)

    def _forward_into_outputs(self, inputs: dict[str, torch.Tensor], cap: Capacity) -> torch.Tensor:
        meta = {k: v for k, v in inputs.items() if k != "pixels"}
        out = self.tower(inputs["pixels"], meta, cap)
        tokens = self.tower.geometry.output_rows(cap)
        hidden = self.tower.out_hidden_size
        for j, src in enumerate([out.embeds, *out.deepstack]):
            self._joined[:tokens, j * hidden:(j + 1) * hidden].copy_(src)
        return self._joined[:tokens]

    def _input_views(self, cap: Capacity) -> dict[str, torch.Tensor]:
        """Static inputs for a capacity: prefixes of the pixel buffer and of its region's metadata buffers,
        holding an empty batch."""
        assert self._pixels is not None
        region = self._regions[cap.patches]
        region.loaded = None  # written here, not by an upload
        views = {"pixels": self._pixels[: cap.patches]}
        for name, arr in self.tower.build_metadata([], cap).items():
            view = region.buffers[name][: arr.shape[0]]
            view.copy_(torch.from_numpy(arr))
            views[name] = view
        return views

    def _capture_one(self, key: GraphKey, cap: Capacity) -> CapturedGraph:
        inputs = self._input_views(cap)
        if self.device.type != "cuda":
            return CapturedGraph(key, cap, inputs, torch.empty(0), None)
        stream = self._warmup
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            self._forward_into_outputs(inputs, cap)  # warm-up: lazy init and autotuning outside capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # The warm-up's activations, cached on its stream, would otherwise stay reserved beside the memory
        # the capture takes for the same activations: twice the peak under a --gpu-memory cap.
        stream.synchronize()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._mempool):
            output = self._forward_into_outputs(inputs, cap)
        return CapturedGraph(key, cap, inputs, output, graph)

    # ---- replay -------------------------------------------------------------------------
    def replay(self, key: GraphKey, pixels: np.ndarray | torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Run one batch through its graph. Returns the joined output rows of the batch's real tokens:
        a view of the static output, valid until the next replay; copy it out (on this stream) first."""
        g = self.graphs[key]
        cap = g.capacity
        _upload(g.inputs["pixels"][: len(pixels)], pixels)
        self._regions[cap.patches].load(self._staged_metadata(key, grids, g))
        tokens = sum(self.tower.geometry.tokens(grid, key.modality) for grid in grids)
        if g.graph is not None:
            g.graph.replay()  # no autograd state to set: a replay only launches (entering a mode costs a lone batch)
            out = g.output
        else:
            with torch.inference_mode():
                out = self._forward_into_outputs(g.inputs, cap)
        self.stats.record_replay(str(key), len(grids))
        return out[:tokens]

    def _staged_metadata(self, key: GraphKey, grids: list[Grid], g: CapturedGraph) -> StagedMetadata:
        """The batch's metadata arrays, packed for upload into the static buffers; cached, never written
        again once made."""
        cache_key = (key, tuple(tuple(grid) for grid in grids))
        staged = self._meta_cache.get(cache_key)
        if staged is not None:
            self._meta_cache.move_to_end(cache_key)
            return staged
        staged = self._pack_metadata(self.tower.build_metadata(grids, g.capacity), g.inputs,
                                     self._regions[g.capacity.patches])
        self._meta_cache[cache_key] = staged
        self._meta_cache_bytes += staged.nbytes
        while self._meta_cache_bytes > META_CACHE_BYTES:
            _, old = self._meta_cache.popitem(last=False)
            self._meta_cache_bytes -= old.nbytes
        return staged

    def _pack_metadata(self, meta: dict[str, np.ndarray], views: dict[str, torch.Tensor], region: MetadataRegion
                       ) -> StagedMetadata:
        """Every metadata array back to back in one (page-locked) buffer, with the runs that copy them to
        their offsets in the region. A region's buffers are as long as its longest capacity needs, so one
        graph's arrays may lie apart: arrays closer than `META_GAP_BYTES` share one copy (stale bytes
        between them belong to longer capacities' views, never read by this graph), the rest get a copy each."""
        spans = []
        for name, arr in meta.items():
            view = views[name]  # the graph reads exactly this prefix: the array must fill it
            if arr.shape != tuple(view.shape) or arr.dtype != self._meta_dtypes[name]:
                raise ValueError(f"metadata {name}: {arr.dtype}{arr.shape} for a {view.dtype}{tuple(view.shape)} "
                                 "buffer")
            spans.append((region.offsets[name], np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))
        spans.sort(key=lambda span: span[0])
        runs: list[tuple[int, int, list]] = []  # (device start, device end, arrays) of each copy
        for start, data in spans:
            if runs and start - runs[-1][1] < META_GAP_BYTES:
                first, _, members = runs.pop()
                runs.append((first, start + data.nbytes, [*members, (start, data)]))
            else:
                runs.append((start, start + data.nbytes, [(start, data)]))
        host = torch.zeros(sum(end - first for first, end, _ in runs), dtype=torch.uint8,
                           pin_memory=self.device.type == "cuda")
        packed = host.numpy()
        copies, at = [], 0
        for first, end, members in runs:
            for start, data in members:
                packed[at + start - first:at + start - first + data.nbytes] = data
            copies.append((first, at, end - first))
            at += end - first
        return StagedMetadata(host, tuple(copies))


@dataclass
class MetadataRegion:
    """The metadata buffers of the graphs of one patch count, in one device allocation (`flat`)."""

    flat: torch.Tensor
    offsets: dict[str, int]  # byte offset of each buffer in flat
    buffers: dict[str, torch.Tensor]  # views of flat
    loaded: StagedMetadata | None = None  # the packed batch the region holds, while nothing else has written it

    def load(self, staged: StagedMetadata) -> bool:
        """Copy a packed batch's metadata in (asynchronously), unless the region holds it already (a packed batch is
        never written again: the same object, the same bytes). True when it copied."""
        if self.loaded is staged:
            return False
        for dst, src, size in staged.runs:
            self.flat[dst:dst + size].copy_(staged.host[src:src + size], non_blocking=True)
        self.loaded = staged
        return True


@dataclass(frozen=True)
class StagedMetadata:
    """A batch's metadata packed on the host: `runs` of (device offset, host offset, bytes) to copy."""

    host: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.host.numel()


META_ALIGN = 256  # bytes: every metadata buffer starts aligned for any dtype
META_CACHE_BYTES = 8 << 20  # of packed metadata kept for batches that recur
# Closer arrays share one upload: a copy costs about as long to issue and run as 64 KiB take to move.
META_GAP_BYTES = 64 << 10
CPU_NO_GRAPHS = ("CUDA graphs need a CUDA device: on the CPU each graph key runs as a fixed-shape eager forward "
                 "over the same static buffers (for trying the API)")


def _upload(dst: torch.Tensor, arr: np.ndarray | torch.Tensor) -> None:
    """Host array -> static device buffer, through pinned memory so the copy is asynchronous."""
    if isinstance(arr, torch.Tensor):
        dst.copy_(arr, non_blocking=True)
        return
    src = torch.from_numpy(np.ascontiguousarray(arr))
    if dst.device.type == "cuda":
        src = src.pin_memory()
        dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(src)
