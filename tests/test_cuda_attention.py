"""GPU only: the fast attention backend (cuDNN) against varlen_attn and against per-segment
SDPA in float32, eagerly and inside captured CUDA graphs replayed with new boundaries, at the
towers' head dims; Qwen2.5-VL's windows, which the backend hands to varlen_attn (bound <= 64); then
whole towers served by it through the graph pool.

Run on the GPU machine: `pytest -m cuda tests/test_cuda_attention.py`. A backend that cannot run
there (cudnn-frontend not installed) is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

from models.attention import check_backend, packed_attention, resolve_backend, sdpa_per_segment

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
FAST = ["cudnn"]
HEADS = 16


def need(backend: str) -> None:
    from models import attention_cudnn

    reason = attention_cudnn.available() if backend == "cudnn" else None
    if reason:
        pytest.skip(f"{backend}: {reason}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bounds_of(lengths: list[int], slots: int) -> list[int]:
    out = [0]
    for n in lengths + [0] * (slots - len(lengths)):
        out.append(out[-1] + n)
    return out


def inputs(rows: int, dim: int, seed: int = 0):
    """q, k as views of one [rows, 2, heads, dim] tensor and v of a [rows, 3, heads, dim] one, as the
    towers hand them over."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qk = torch.randn(rows, 2, HEADS, dim, device=DEV, generator=gen).bfloat16()
    qkv = torch.randn(rows, 3, HEADS, dim, device=DEV, generator=gen).bfloat16()
    return qk[:, 0], qk[:, 1], qkv[:, 2]


def references(q, k, v, bounds: list[int], max_seqlen: int):
    """(varlen_attn in bf16, SDPA per segment in float32) over the rows inside segments."""
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)
    real = bounds[-1]
    fast = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen)[:real]
    exact = sdpa_per_segment(q.float(), k.float(), v.float(), cu)[:real]
    return fast, exact


def capture(call):
    """A CUDA graph of `call()` (run once on a side stream first: plans and compilation happen outside
    the capture) and its static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


# Layouts of one capacity (12 segments, 4096 rows, longest 1024): ragged with zero-length padding,
# the same total with other boundaries, and a small batch after the large ones.
SLOTS, ROWS, MAX = 12, 4096, 1024
LAYOUTS = [
    [1024, 0, 77, 512, 1, 300, 0, 999, 64],
    [64, 64, 1000, 9, 233, 17, 1000, 600, 0, 0, 0, 990],
    [100],
]


@pytest.mark.parametrize("dim", [80, 72])
@pytest.mark.parametrize("backend", FAST)
def test_eager_matches_varlen_and_float32(backend: str, dim: int) -> None:
    need(backend)
    q, k, v = inputs(ROWS, dim)
    for lengths in LAYOUTS:
        bounds = bounds_of(lengths, SLOTS)
        cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)
        got = packed_attention(backend, q, k, v, cu, MAX)[: bounds[-1]]
        fast, exact = references(q, k, v, bounds, MAX)
        assert torch.isfinite(got).all()
        assert rel(got, exact) < max(1e-2, 2 * rel(fast, exact)), (lengths, rel(got, exact), rel(fast, exact))
        assert rel(got, fast) < 1e-2, (lengths, rel(got, fast))


@pytest.mark.parametrize("dim", [80, 72])
@pytest.mark.parametrize("backend", FAST)
def test_captured_graph_reads_new_boundaries(backend: str, dim: int) -> None:
    """One capture, replayed over layouts with equal totals but other boundaries, then a small batch
    after the large ones (the capacity padded with zero-length segments): each replay must match
    eager varlen_attn on its own boundaries."""
    need(backend)
    q, k, v = inputs(ROWS, dim, seed=1)
    cu = torch.tensor(bounds_of(LAYOUTS[0], SLOTS), dtype=torch.int32, device=DEV)
    graph, out = capture(lambda: packed_attention(backend, q, k, v, cu, MAX))
    for lengths in LAYOUTS + LAYOUTS[:1]:
        bounds = bounds_of(lengths, SLOTS)
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        got = out[: bounds[-1]].clone()
        fast, exact = references(q, k, v, bounds, MAX)
        assert rel(got, fast) < 1e-2, (lengths, rel(got, fast))
        assert rel(got, exact) < max(1e-2, 2 * rel(fast, exact))
        eager = packed_attention(backend, q, k, v, cu, MAX)[: bounds[-1]]
        assert torch.equal(got, eager), lengths  # the same kernel on the same data: bit-identical


def test_one_forward_fills_the_lengths_once_per_boundaries_and_a_capture_refills(monkeypatch) -> None:
    """Within one tower forward (`one_forward`) cuDNN's lengths and offsets are computed at the first call
    on a `cu_seqlens` and reused by the next calls on it; another tensor sharing the plan (Qwen2.5-VL's
    windows beside its full layers) refills them, and so does its next call. Captured the same way, every
    replay recomputes them from the replayed boundaries: each call matches the eager call on its own."""
    need("cudnn")
    from models import attention_cudnn
    from models.forward_scope import one_forward

    fills = []
    real_fill = attention_cudnn.fill_ragged_metadata
    monkeypatch.setattr(attention_cudnn, "fill_ragged_metadata", lambda cu, *a: (fills.append(cu), real_fill(cu, *a)))
    q, k, v = inputs(ROWS, 80, seed=2)
    cu = torch.tensor(bounds_of(LAYOUTS[0], SLOTS), dtype=torch.int32, device=DEV)
    other = torch.tensor(bounds_of(LAYOUTS[1], SLOTS), dtype=torch.int32, device=DEV)

    def blocks(order):
        with one_forward(), torch.inference_mode():  # as a tower runs
            return [packed_attention("cudnn", q, k, v, bounds, MAX).clone() for bounds in order]

    blocks([cu, cu, cu])
    assert len(fills) == 1
    fills.clear()
    blocks([cu, other, cu])
    assert len(fills) == 3
    fills.clear()
    packed_attention("cudnn", q, k, v, cu, MAX)
    packed_attention("cudnn", q, k, v, cu, MAX)
    assert len(fills) == 2  # outside a forward every call computes its own
    order = [cu, cu, other, cu]
    graph, outs = capture(lambda: blocks(order))
    for a, b in [(LAYOUTS[1], LAYOUTS[0]), (LAYOUTS[2], LAYOUTS[1]), (LAYOUTS[0], LAYOUTS[2])]:
        cu.copy_(torch.tensor(bounds_of(a, SLOTS), dtype=torch.int32))
        other.copy_(torch.tensor(bounds_of(b, SLOTS), dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for got, bounds in zip(outs, order):
            eager = packed_attention("cudnn", q, k, v, bounds, MAX)
            assert torch.equal(got[: int(bounds[-1])], eager[: int(bounds[-1])]), (a, b)


def windows_of(*frames: tuple[int, int]) -> list[int]:
    """Qwen2.5-VL's window lengths (8 x 8 patches, smaller at the edges) of frames of h x w patches."""
    from models.windows import window_layout

    return [int(n) for h, w in frames for n in window_layout(h, w, 2, 4)[1]]


# Windows in one capacity (192 windows, 10368 rows, bound 64): two 1344x756 images (54 x 96 patches,
# 168 windows), then other frames with other edges, then a small batch after the large one.
WINDOW_SLOTS, WINDOW_ROWS, WINDOW_MAX = 192, 2 * 54 * 96, 64
WINDOW_LAYOUTS = [windows_of((54, 96), (54, 96)), windows_of((32, 32), (20, 34), (54, 96)), windows_of((6, 10))]


@pytest.mark.parametrize("dim", [80, 72])
def test_windows_through_the_cudnn_backend(dim: int) -> None:
    """The cudnn backend hands window layers' calls to varlen_attn: eagerly and from a captured graph
    replayed over other window layouts its output is varlen_attn's, bit for bit. cuDNN's own kernel on
    the same windows (what the backend would run above the bound) stays as close to float32."""
    need("cudnn")
    from models import attention_cudnn
    from models.attention import SHORT_SEQLEN

    assert WINDOW_MAX <= SHORT_SEQLEN
    assert all(max(lengths) <= WINDOW_MAX and len(lengths) <= WINDOW_SLOTS and sum(lengths) <= WINDOW_ROWS
               for lengths in WINDOW_LAYOUTS)
    q, k, v = inputs(WINDOW_ROWS, dim, seed=2)
    cu = torch.tensor(bounds_of(WINDOW_LAYOUTS[0], WINDOW_SLOTS), dtype=torch.int32, device=DEV)
    graph, out = capture(lambda: packed_attention("cudnn", q, k, v, cu, WINDOW_MAX, short=True))
    for lengths in WINDOW_LAYOUTS + WINDOW_LAYOUTS[:1]:
        bounds = bounds_of(lengths, WINDOW_SLOTS)
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        real = bounds[-1]
        fast, exact = references(q, k, v, bounds, WINDOW_MAX)
        assert torch.equal(out[:real], fast), lengths
        assert torch.equal(packed_attention("cudnn", q, k, v, cu, WINDOW_MAX, short=True)[:real], fast), lengths
        assert rel(fast, exact) < 1e-2
        direct = attention_cudnn.cudnn_attention(q, k, v, cu, WINDOW_MAX)[:real]
        assert torch.isfinite(direct).all()
        assert rel(direct, fast) < 1e-2, (lengths, rel(direct, fast))
        assert rel(direct, exact) < max(1e-2, 2 * rel(fast, exact)), (lengths, rel(direct, exact))


@pytest.mark.parametrize("dim", [80, 72, 64])
def test_load_time_check(dim: int) -> None:
    for backend in FAST:
        err, reason = check_backend(backend, DEV, torch.bfloat16, HEADS, dim)
        print(f"{backend} head dim {dim}: relative difference to varlen_attn {err:.2e} {reason}")
    from models import attention_cudnn

    if attention_cudnn.available() is None:
        assert check_backend("cudnn", DEV, torch.bfloat16, HEADS, dim)[0] < 1e-2
        assert resolve_backend("auto", DEV, torch.bfloat16, HEADS, dim) == "cudnn"
    else:
        assert resolve_backend("auto", DEV, torch.bfloat16, HEADS, dim) == "varlen"
    assert resolve_backend("auto", DEV, torch.float32, HEADS, dim) == "sdpa"  # no packed fp32 kernels: dense SDPA


@pytest.mark.parametrize("model", ["random:qwen2.5-vl-7b", "random:qwen3-vl-8b"])
@pytest.mark.parametrize("backend", FAST)
def test_tower_graphs_with_backend(backend: str, model: str) -> None:
    """A whole tower served by the backend through captured graphs (Qwen2.5-VL: windows of up to 64
    patches with smaller edge windows, which run varlen_attn under the short-segment rule) stays as
    close to float32 as the varlen_attn eager forward."""
    need(backend)
    from graphs.runner import GraphRunner, plan_for
    from models import load_tower
    from tests.test_cuda_graphs import float32_copy, make_items, rel_err

    tower = load_tower(model, device="cuda", dtype="bfloat16", attention=backend)
    assert tower.backend == backend
    plan = plan_for(tower, max_batch_tokens=1024)
    runner = GraphRunner(tower, DEV, plan, modalities=("image",))
    runner.capture()
    assert not runner.pool.failed, runner.pool.failed
    exact = GraphRunner(float32_copy(tower), DEV, plan, use_graphs=False)
    m = tower.merge
    batches = [[(1, 16 * m, 12 * m), (1, 6 * m, 9 * m)], [(1, 9 * m, 7 * m)] * 3, [(1, 4 * m, 4 * m)]]
    for seed, grids in enumerate(batches):
        items = make_items(tower, grids, 30 + seed)
        outs = runner.encode(items)
        for item, out in zip(items, outs):
            ref = exact.eager(item.pixels, [item.grid_thw]).embeds
            tower.set_attention("varlen")
            baseline = runner.eager(item.pixels, [item.grid_thw]).embeds
            tower.set_attention(backend)
            err, base = rel_err(out.embeds, ref), rel_err(baseline, ref)
            print(f"{model} {backend} {item.grid_thw}: {err:.2e} (varlen eager {base:.2e})")
            assert err <= max(1e-2, 2 * base)
    del runner, exact
    torch.cuda.empty_cache()
