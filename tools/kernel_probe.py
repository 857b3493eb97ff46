"""Kernel studies behind the performance notes (H200): what an eager forward's time is made of, how fast
attention at head dims 72/80 can go with the kernels this machine has, and whether a matrix product with
QuickGELU in its epilogue beats cuBLAS followed by the activation kernel.

    python3 tools/kernel_probe.py eager-kernels [MODEL] [WORKLOAD]   # kernel table of one eager forward
    python3 tools/kernel_probe.py eager-gaps [MODEL] [WORKLOAD]      # where its device sits idle
    python3 tools/kernel_probe.py cudnn-plans      # every cuDNN SDPA plan for the towers' ragged problems
    python3 tools/kernel_probe.py attention        # a Triton flash-attention kernel against cuDNN, varlen_attn
    python3 tools/kernel_probe.py gemm-act         # QuickGELU in a Triton product's epilogue against cuBLAS

Each prints one JSON object per case and appends it to `$OUT/kernel_probe.jsonl` when OUT is set. The
Triton kernels here are measuring instruments, not serving code: nothing in `models/` uses them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOG2E = 1.4426950408889634
# (segments, length, head dim): 8 and 1 images 1344x756 (5184 patches), small images, Qwen3-VL's windows-free
# small inputs (head dim 72), and mid-size images.
ATTENTION_CASES = [(8, 5184, 80), (8, 5184, 72), (1, 5184, 80), (32, 256, 80), (64, 256, 72), (4, 1024, 80)]


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kernel_probe.jsonl"), "a") as f:
            f.write(line + "\n")


def bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return round(do_bench(fn, warmup=25, rep=100, return_mode="median"), 4)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- eager forward, by kernel ---------------------------------------------------------------------------
def eager_workload(model: str, workload: str) -> tuple[Any, list]:
    """An eager GraphRunner of the random-weight preset and the workload's seeded inputs."""
    from graphs.runner import GraphRunner, plan_for
    from models import load_tower
    from service.bench.towers import random_items, workloads

    tower = load_tower(model, device="cuda", dtype="bfloat16")
    runner = GraphRunner(tower, torch.device("cuda"), plan_for(tower), use_graphs=False)
    return runner, random_items(tower, workloads(tower.processor.patch_size)[workload])


def eager_kernels(model: str, workload: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from service.bench.towers import cuda_time

    runner, items = eager_workload(model, workload)
    with torch.inference_mode():
        ms = cuda_time(lambda: runner.encode(items))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.encode(items)
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda r: -r[1])
    emit({"what": "eager-kernels", "model": model, "workload": workload, "eager_ms": round(ms, 2),
          "kernel_ms": round(sum(r[1] for r in rows), 2),
          "top": [{"name": k[:100], "ms": round(t, 3), "calls": c} for k, t, c in rows[:15]]})


def eager_gaps(model: str, workload: str) -> None:
    """The device's idle time during one `encode` (wall, from CUDA events around the call, against the
    span and sum of its kernels and copies) and the largest gaps between them, with their neighbours."""
    from torch.profiler import ProfilerActivity, profile

    from service.bench.towers import cuda_time

    runner, items = eager_workload(model, workload)
    with torch.inference_mode():
        wall = cuda_time(lambda: runner.encode(items))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.encode(items)
            torch.cuda.synchronize()
    device = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in device) / 1e3
    gaps = [(b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(device, device[1:])]
    emit({"what": "eager-gaps", "model": model, "workload": workload, "wall_ms": round(wall, 3),
          "span_ms": round((device[-1].time_range.end - device[0].time_range.start) / 1e3, 3),
          "busy_ms": round(busy, 3), "device_events": len(device),
          "gaps_over_5us_ms": round(sum(g for g, _, _ in gaps if g > 5) / 1e3, 3),
          "gaps_under_5us_ms": round(sum(g for g, _, _ in gaps if 0 < g <= 5) / 1e3, 3),
          "largest": [{"us": round(g, 1), "after": a[:70], "before": b[:70]}
                      for g, a, b in sorted(gaps, key=lambda x: -x[0])[:12]]})


# ---- attention ---------------------------------------------------------------------------------------------
def ragged_problem(segs: int, length: int, d: int, heads: int = 16) -> tuple[torch.Tensor, ...]:
    """q, k as views of a rotary output [tokens, 2, heads, d], v of a qkv product, as the towers lay them out."""
    n = segs * length
    qkv = torch.randn(n, 3, heads, d, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :2].contiguous().unbind(1)
    cu = torch.arange(0, n + 1, length, device="cuda", dtype=torch.int32)
    return q, k, qkv[:, 2], cu


def cudnn_plans() -> None:
    from models import attention_cudnn as ac
    from models.attention import packed_attention

    cudnn = ac._cudnn()
    for segs, length, d in ATTENTION_CASES:
        q, k, v, cu = ragged_problem(segs, length, d)
        key = ac.plan_key(q, k, v, cu, length)
        base = ac.get_plan(key)
        ref = packed_attention("varlen", q, k, v, cu, length)
        flops = 4 * segs * length * length * d * q.shape[1]
        record: dict[str, Any] = {"what": "cudnn-plans", "segs": segs, "length": length, "d": d, "plans": []}
        for mode in (cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK):
            try:
                g = ac.build_graph(cudnn, key, base.handle, ac.offsets_dtype(cudnn.backend_version()))
                g.validate()
                g.build_operation_graph()
                g.deselect_engines([ac.PYTHON_ENGINES])
                g.create_execution_plans([mode])
                count = g.get_execution_plan_count()
            except Exception as exc:  # noqa: BLE001 - a mode with no plan for this graph
                record["plans"].append({"mode": str(mode), "error": str(exc)[:160]})
                continue
            for i in range(count):
                entry: dict[str, Any] = {"mode": str(mode), "index": i, "name": g.get_plan_name_at_index(i)}
                g.build_plan_at_index(i)
                ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device="cuda")
                out = torch.empty_like(q)
                ac.fill_ragged_metadata(cu, base.seq_len, base.offsets, base.row_strides)
                pack = dict(base.pack)
                pack.update({ac._Q: q.data_ptr(), ac._K: k.data_ptr(), ac._V: v.data_ptr(), ac._O: out.data_ptr()})
                cudnn.set_stream(base.handle, torch.cuda.current_stream().cuda_stream)

                def run(g: Any = g, pack: dict = pack, ws: torch.Tensor = ws, i: int = i) -> None:
                    g.execute_plan_at_index(pack, ws.data_ptr(), index=i, handle=base.handle)  # noqa: B023

                run()
                entry["rel_to_varlen"] = rel(out, ref)
                entry["ms"] = bench(run)
                entry["tflops"] = round(flops / entry["ms"] / 1e9, 1)
                record["plans"].append(entry)
        emit(record)


def attention() -> None:
    from models import attention_cudnn as ac
    from models.attention import packed_attention

    pointer_configs = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3)]  # (BM, BN, warps, stages)
    tma_configs = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)]
    for segs, length, d in ATTENTION_CASES:
        q, k, v, cu = ragged_problem(segs, length, d)
        flops = 4 * segs * length * length * d * q.shape[1]
        ref = packed_attention("varlen", q, k, v, cu, length)
        plan = ac.get_plan(ac.plan_key(q, k, v, cu, length))
        record: dict[str, Any] = {"what": "attention", "segs": segs, "length": length, "d": d,
                                  "cudnn_ms": bench(lambda: plan(q, k, v, cu)),  # noqa: B023
                                  "varlen_ms": bench(lambda: packed_attention("varlen", q, k, v, cu, length)),  # noqa: B023
                                  "triton": {}}
        record["cudnn_tflops"] = round(flops / record["cudnn_ms"] / 1e9, 1)
        for label, fn, configs in (("pointer", triton_attention, pointer_configs),
                                   ("tma", triton_attention_tma, tma_configs)):
            for cfg in configs:
                try:
                    out = fn(q, k, v, cu, length, cfg)
                    ms = bench(lambda: fn(q, k, v, cu, length, cfg))  # noqa: B023
                    record["triton"][f"{label}{cfg}"] = {"ms": ms, "tflops": round(flops / ms / 1e9, 1),
                                                         "rel_to_varlen": rel(out, ref)}
                except Exception as exc:  # noqa: BLE001 - a configuration Triton cannot compile
                    record["triton"][f"{label}{cfg}"] = {"error": str(exc)[:160]}
        emit(record)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
                     cfg: tuple[int, int, int, int]) -> torch.Tensor:
    """Ragged attention, one program per (query block, segment, head), pointer loads; the head dim is split
    as 64 + a power of two of at least 16 (80 = 64 + 16; 72 = 64 + 16 with 8 masked)."""
    import triton

    n, h, d = q.shape
    bm, bn, warps, stages = cfg
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
    _kernels()["pointer"][(triton.cdiv(max_seqlen, bm), cu.numel() - 1, h)](
        q, k, v, out, cu, q.stride(0), k.stride(0), v.stride(0), out.stride(0), d ** -0.5 * LOG2E, D=d, D0=64,
        D1=max(16, triton.next_power_of_2(d - 64)), BM=bm, BN=bn, num_warps=warps, num_stages=stages)
    return out


def triton_attention_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
                         cfg: tuple[int, int, int, int]) -> torch.Tensor:
    """As `triton_attention`, with q, k, v read through host-built TMA descriptors."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, h, d = q.shape
    bm, bn, warps, stages = cfg
    d1 = max(16, triton.next_power_of_2(d - 64))
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)

    def desc(t: torch.Tensor, rows: int, width: int) -> Any:
        return TensorDescriptor(t, [n, h * d], [t.stride(0), 1], [rows, width])

    _kernels()["tma"][(triton.cdiv(max_seqlen, bm), cu.numel() - 1, h)](
        desc(q, bm, 64), desc(q, bm, d1), desc(k, bn, 64), desc(k, bn, d1), desc(v, bn, 64), desc(v, bn, d1),
        out, cu, out.stride(0), d ** -0.5 * LOG2E, D=d, D0=64, D1=d1, BM=bm, BN=bn, num_warps=warps,
        num_stages=stages)
    return out


# ---- matrix product with QuickGELU in its epilogue ----------------------------------------------------------
def gemm_act() -> None:
    import triton

    from models import kernels

    kernels.enable_triton(torch.device("cuda"))
    configs = [(128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 128, 64, 4, 4, 8)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (41472, 16384, 4096, 1024):
        k, n = 1280, 5120  # Qwen2-VL's fc1
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
        ref = kernels.quick_gelu(x.double() @ w.double().T + b.double())
        record: dict[str, Any] = {
            "what": "gemm-act", "m": m, "k": k, "n": n,
            "cublas_ms": bench(lambda: torch.nn.functional.linear(x, w, b)),  # noqa: B023
            "cublas_then_act_ms": bench(lambda: kernels.activate(torch.nn.functional.linear(x, w, b), "quick_gelu")),  # noqa: B023
            "triton": {}}
        for bm, bn, bk, warps, stages, group in configs:
            from triton.tools.tensor_descriptor import TensorDescriptor

            out = torch.empty((m, n), dtype=x.dtype, device=x.device)
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            args = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]), b,
                    TensorDescriptor.from_tensor(out, [bm, bn]), m, n, k)

            def run(args: tuple = args, bm: int = bm, bn: int = bn, bk: int = bk, group: int = group,
                    warps: int = warps, stages: int = stages, tiles: int = tiles) -> None:
                _kernels()["gemm_act"][(min(sms, tiles),)](*args, BM=bm, BN=bn, BK=bk, GROUP_M=group, NUM_SMS=sms,
                                                           num_warps=warps, num_stages=stages)

            run()
            ms = bench(run)
            record["triton"][str((bm, bn, bk, warps, stages, group))] = {
                "ms": ms, "tflops": round(2 * m * n * k / ms / 1e9, 1), "rel_to_fp64": rel(out, ref)}
        emit(record)


_KERNELS: dict[str, Any] = {}


def _kernels() -> dict[str, Any]:
    """The Triton kernels, compiled on first use (importing this tool needs no Triton)."""
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def attn_pointer(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, sq, sk, sv, so, qk_scale, D: tl.constexpr,
                     D0: tl.constexpr, D1: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        mblk, seg, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(cu_ptr + seg)
        length = tl.load(cu_ptr + seg + 1) - start
        if mblk * BM >= length:
            return
        rows = mblk * BM + tl.arange(0, BM)
        row_ok = rows < length
        d0 = tl.arange(0, D0)
        d1 = D0 + tl.arange(0, D1)
        d1_ok = d1 < D
        base = start.to(tl.int64)
        qrow = q_ptr + (base + rows[:, None]) * sq + head * D
        q0 = tl.load(qrow + d0[None, :], mask=row_ok[:, None], other=0.0)
        q1 = tl.load(qrow + d1[None, :], mask=row_ok[:, None] & d1_ok[None, :], other=0.0)
        m_i = tl.full((BM,), -float("inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc0 = tl.zeros((BM, D0), tl.float32)
        acc1 = tl.zeros((BM, D1), tl.float32)
        for n in range(0, length, BN):
            cols = n + tl.arange(0, BN)
            col_ok = cols < length
            krow = k_ptr + (base + cols[None, :]) * sk + head * D
            s = tl.dot(q0, tl.load(krow + d0[:, None], mask=col_ok[None, :], other=0.0))
            s = tl.dot(q1, tl.load(krow + d1[:, None], mask=col_ok[None, :] & d1_ok[:, None], other=0.0), s)
            s = tl.where(col_ok[None, :], s * qk_scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vrow = v_ptr + (base + cols[:, None]) * sv + head * D
            v0 = tl.load(vrow + d0[None, :], mask=col_ok[:, None], other=0.0)
            v1 = tl.load(vrow + d1[None, :], mask=col_ok[:, None] & d1_ok[None, :], other=0.0)
            acc0 = tl.dot(p.to(v0.dtype), v0, acc0 * alpha[:, None])
            acc1 = tl.dot(p.to(v0.dtype), v1, acc1 * alpha[:, None])
            m_i = m_new
        orow = o_ptr + (base + rows[:, None]) * so + head * D
        tl.store(orow + d0[None, :], (acc0 / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(orow + d1[None, :], (acc1 / l_i[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d1_ok[None, :])

    @triton.jit
    def attn_tma(q0_desc, q1_desc, k0_desc, k1_desc, v0_desc, v1_desc, o_ptr, cu_ptr, so, qk_scale,
                 D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        mblk, seg, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(cu_ptr + seg)
        length = tl.load(cu_ptr + seg + 1) - start
        if mblk * BM >= length:
            return
        col = head * D
        d1 = D0 + tl.arange(0, D1)
        d1_ok = d1 < D
        q0 = q0_desc.load([start + mblk * BM, col])
        q1 = q1_desc.load([start + mblk * BM, col + D0])
        q1 = tl.where(d1_ok[None, :], q1, tl.zeros_like(q1))  # a narrow head reads its neighbour's first columns
        m_i = tl.full((BM,), -float("inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc0 = tl.zeros((BM, D0), tl.float32)
        acc1 = tl.zeros((BM, D1), tl.float32)
        for n in range(0, length, BN):
            s = tl.dot(q0, k0_desc.load([start + n, col]).T)
            s = tl.dot(q1, k1_desc.load([start + n, col + D0]).T, s)
            s = tl.where((n + tl.arange(0, BN))[None, :] < length, s * qk_scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v0 = v0_desc.load([start + n, col])
            acc0 = tl.dot(p.to(v0.dtype), v0, acc0 * alpha[:, None])
            acc1 = tl.dot(p.to(v0.dtype), v1_desc.load([start + n, col + D0]), acc1 * alpha[:, None])
            m_i = m_new
        rows = mblk * BM + tl.arange(0, BM)
        row_ok = rows < length
        orow = o_ptr + (start.to(tl.int64) + rows[:, None]) * so + head * D
        tl.store(orow + tl.arange(0, D0)[None, :], (acc0 / l_i[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(orow + d1[None, :], (acc1 / l_i[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d1_ok[None, :])

    @triton.jit
    def gemm_act_tma(a_desc, w_desc, b_ptr, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
        """Persistent: quick_gelu(a @ w.T + b), rounding the product to bf16 first as nn.Linear does."""
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
            group = GROUP_M * num_n
            first_m = (tile // group) * GROUP_M
            size_m = min(num_m - first_m, GROUP_M)
            om = (first_m + (tile % group) % size_m) * BM
            on = ((tile % group) // size_m) * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(tl.cdiv(K, BK)):
                acc = tl.dot(a_desc.load([om, ki * BK]), w_desc.load([on, ki * BK]).T, acc)
            rn = on + tl.arange(0, BN)
            h = (acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]).to(tl.bfloat16)
            h = h.to(tl.float32)
            c_desc.store([om, on], (h * tl.sigmoid(1.702 * h)).to(tl.bfloat16))

    _KERNELS.update(pointer=attn_pointer, tma=attn_tma, gemm_act=gemm_act_tma)
    return _KERNELS


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what in ("eager-kernels", "eager-gaps"):
        model = sys.argv[2] if len(sys.argv) > 2 else "random:qwen2-vl-7b"
        workload = sys.argv[3] if len(sys.argv) > 3 else "8x1344x756"
        (eager_kernels if what == "eager-kernels" else eager_gaps)(model, workload)
    elif what in ("cudnn-plans", "attention", "gemm-act"):
        {"cudnn-plans": cudnn_plans, "attention": attention, "gemm-act": gemm_act}[what]()
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
