"""Which kernels make an item's output bytes depend on what it is batched with (GPU).

    python tools/invariance_probe.py gemm [--out FILE]       # matrix products: rows of M vs rows of a larger M
    python tools/invariance_probe.py attention [--out FILE]  # one segment alone vs among others, per kernel
    python tools/invariance_probe.py tower MODEL [--out FILE]  # first module whose item rows differ
    python tools/invariance_probe.py cost MODEL [--out FILE]   # graph and eager ms, batch-invariant or not

`gemm` runs twice, in fresh interpreters: with cuBLAS's default workspaces and with none
(`CUBLAS_WORKSPACE_CONFIG=:0:0`, `CUBLASLT_WORKSPACE_SIZE=0`: no split-K nor stream-K partial sums, what
models/blas.py sets), and times the towers' shapes both ways. Each report is one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.blas import NO_WORKSPACE  # noqa: E402

# Rows of one matrix product in the towers (M) and the (K, N) of their weights, Qwen2.5-VL-7B and Qwen3-VL-8B.
ROWS = [1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 31, 32, 48, 64, 100, 128, 196, 256, 500, 512, 784, 1000, 1024, 2048,
        4096, 8192, 16384]
SHAPES = {"qkv": (1280, 3840), "proj": (1280, 1280), "gate_up": (1280, 6912), "down": (3456, 1280),
          "q3_qkv": (1152, 3456), "q3_fc1": (1152, 4304), "q3_fc2": (4304, 1152), "merge_fc1": (5120, 5120),
          "merge_fc2": (5120, 3584), "q3_merge_fc1": (4608, 4608)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gemm_once() -> dict:
    from models.blas import batch_invariant_products

    torch.manual_seed(0)
    dev = torch.device("cuda")
    # the child given no workspace runs under models/blas.py's whole setting (its reductions in float32 too)
    batch_invariant_products(dev, all(os.environ.get(k) == v for k, v in NO_WORKSPACE.items()))
    report: dict = {"mismatched_rows": {}, "ms": {}}
    big = 32768
    for dname, dt in DTYPES.items():
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            b = torch.randn(n, device=dev, dtype=dt) * 0.02
            x = torch.randn(big, k, device=dev, dtype=dt)
            ops = {"linear": lambda a, w=w, b=b: F.linear(a, w, b), "mm": lambda a, w=w: a @ w.t()}
            if name == "q3_fc1":
                ops["gelu_epilogue"] = lambda a, w=w, b=b: torch._addmm_activation(b, a, w.t(), use_gelu=True)
            for op, fn in ops.items():
                full = fn(x)
                bad = [m for m in ROWS if not torch.equal(fn(x[7:7 + m]), full[7:7 + m])]
                report["mismatched_rows"][f"{dname}/{name}/{op}"] = bad
            if dname == "bfloat16":
                for m in (256, 1024, 16384):
                    report["ms"][f"{name}/M{m}"] = round(ms(lambda a=x[:m], w=w, b=b: F.linear(a, w, b)), 4)
    return report


def gemm(out: Path | None) -> None:
    for label, env in (("default", {}), ("no_workspace", NO_WORKSPACE)):
        proc = subprocess.run([sys.executable, __file__, "gemm-once"], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=600)
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
        emit({"probe": "gemm", "mode": label, "result": json.loads(line) if line.startswith("{") else line}, out)


def attention(out: Path | None) -> None:
    """A target segment's rows computed alone and among other segments, under each kernel and bound."""
    from torch.nn.attention.varlen import varlen_attn

    dev = torch.device("cuda")
    from models.attention import dense_attention

    kernels = {"varlen": lambda q, k, v, cu, mx: varlen_attn(q, k, v, cu, cu, mx, mx), "dense": dense_attention}
    try:
        from models.attention_cudnn import cudnn_attention

        kernels["cudnn"] = cudnn_attention
    except Exception as exc:  # noqa: BLE001
        emit({"probe": "attention", "cudnn": f"unavailable: {exc}"}, out)
    import inspect

    emit({"probe": "attention", "varlen_signature": str(inspect.signature(varlen_attn))}, out)
    torch.manual_seed(0)
    for dname in ("bfloat16", "float16", "float32"):
        dt = DTYPES[dname]
        for heads, d in ((16, 80), (16, 72), (16, 64)):
            n = 20000
            q, k, v = (torch.randn(n, heads, d, device=dev, dtype=dt) for _ in range(3))
            for name, fn in kernels.items():
                if dname == "float32" and name != "dense":
                    continue
                bad = []
                for target in (16, 64, 256, 784, 1024, 4096):
                    t0 = 3000  # the target's rows start here in every layout
                    alone = fn(q[t0:t0 + target], k[t0:t0 + target], v[t0:t0 + target],
                               torch.tensor([0, target], dtype=torch.int32, device=dev), target)
                    t1 = t0 + target
                    # (rows the call covers from, boundaries relative to that, bound): the target at t0..t1
                    layouts = {
                        "bound_x2": (t0, [0, target, target], 2 * target),  # a zero-length pad, a larger bound
                        "among": (0, [0, 1000, t0, t1, t1 + 5000], 5000),
                        "among_small": (0, [0, t0, t1] + [t1 + 16 * i for i in range(1, 60)], max(target, t0)),
                    }
                    for label, (base, bounds, bound) in layouts.items():
                        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
                        got = fn(q[base:], k[base:], v[base:], cu, bound)
                        rows = got[t0 - base:t1 - base]
                        if not torch.equal(rows, alone):
                            diff = (rows.float() - alone.float()).abs().max().item()
                            bad.append(f"{target}/{label}:{diff:.1e}")
                emit({"probe": "attention", "kernel": name, "dtype": dname, "head_dim": d, "differs": bad}, out)
    # Odd head dims: zero-padded to a multiple of 8 with the original scale, against SDPA in float32.
    for d in (36, 52, 90):
        q, k, v = (torch.randn(2048, 8, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        pad = (-d) % 8
        qp, kp, vp = (F.pad(t, (0, pad)) for t in (q, k, v))
        cu = torch.tensor([0, 1000, 2048], dtype=torch.int32, device=dev)
        row = {"probe": "attention_pad", "head_dim": d}
        try:
            got = varlen_attn(qp, kp, vp, cu, cu, 1048, 1048, scale=d**-0.5)[..., :d]
            ref = torch.cat([F.scaled_dot_product_attention(*(t[a:b].float().transpose(0, 1) for t in (q, k, v)))
                             .transpose(0, 1) for a, b in ((0, 1000), (1000, 2048))])
            row["rel_err"] = ((got.float() - ref).norm() / ref.norm()).item()
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
        emit(row, out)
    # The dense path's cost against varlen_attn: 8 frames of 1024 patches, 16 heads of 80.
    q, k, v = (torch.randn(8192, 16, 80, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, 8193, 1024, dtype=torch.int32, device=dev)
    timing = {"varlen_bf16": ms(lambda: varlen_attn(q, k, v, cu, cu, 1024, 1024)),
              "dense_bf16": ms(lambda: dense_attention(q, k, v, cu, 1024)),
              "dense_fp32": ms(lambda: dense_attention(q.float(), k.float(), v.float(), cu, 1024))}
    emit({"probe": "attention_ms", **{key: round(val, 4) for key, val in timing.items()}}, out)


def tower(model: str, out: Path | None, device: str = "cuda") -> None:
    """An item's rows after every module: alone, and third of five items of mixed sizes (eager forwards)."""
    import numpy as np

    from graphs.runner import GraphRunner, concat_pixels, plan_for
    from models import VisualInput, load_tower

    tw = load_tower(model, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    runner = GraphRunner(tw, torch.device(device), plan_for(tw, 4096), use_graphs=False)
    m = tw.merge
    rng = np.random.default_rng(0)
    grids = [(1, 8 * m, 12 * m), (1, 14 * m, 14 * m), (1, 14 * m, 14 * m), (2, 10 * m, 6 * m), (1, 4 * m, 4 * m)]
    items = [VisualInput("image", rng.integers(0, 256, (t * h * w, tw.processor.patch_dim), np.uint8), (t, h, w))
             for t, h, w in grids]
    target = 2
    start = sum(t * h * w for t, h, w in grids[:target])
    rows = grids[target][0] * grids[target][1] * grids[target][2]

    def record(batch):
        seen: dict[str, torch.Tensor] = {}
        hooks = [mod.register_forward_hook(lambda _m, _i, o, n=name: seen.__setitem__(n, o))
                 for name, mod in tw.named_modules() if name]
        try:
            runner.eager(concat_pixels([it.pixels for it in batch]), [it.grid_thw for it in batch])
        finally:
            for h in hooks:
                h.remove()
        return seen

    alone, batched = record([items[target]]), record(items)
    first = []
    for name, a in alone.items():
        b = batched.get(name)
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() == 0:
            continue
        if a.shape[0] == rows:
            part = b[start:start + rows]
        elif a.shape[0] == rows // tw.merge_unit:
            part = b[start // tw.merge_unit:(start + rows) // tw.merge_unit]
        else:
            continue
        if part.shape == a.shape and not torch.equal(part, a):
            first.append(f"{name}:{(part.float() - a.float()).abs().max().item():.1e}")
    emit({"probe": "tower", "model": model, "modules_that_differ": first[:40], "count": len(first)}, out)


def cost(model: str, out: Path | None) -> None:
    """What batch-invariant products cost (models/blas.py): the same workloads through graphs captured with
    and without them, and eagerly, in one process (bf16). One setting after the other: a change of setting
    drops the cuBLAS workspaces that graphs captured before it point into."""
    from graphs.runner import GraphRunner, plan_for
    from models import load_tower
    from models.blas import batch_invariant_products
    from service.bench.towers import random_items, workloads

    dev = torch.device("cuda")
    tw = load_tower(model, device="cuda", dtype="bfloat16")
    loads = workloads(tw.processor.patch_size)
    names = ("1x448", "32x224", "128x224", "8x1344x756", "video16f448")
    rows = {name: {"probe": "cost", "model": model, "workload": name} for name in names}
    for label, enabled in (("invariant", True), ("default", False)):
        batch_invariant_products(dev, enabled)
        runner = GraphRunner(tw, dev, plan_for(tw, 16384))
        runner.capture()
        for name in names:
            items = random_items(tw, loads[name])
            grids, pixels = [it.grid_thw for it in items], torch.cat([it.pixels for it in items])
            rows[name][f"graphs_{label}_ms"] = round(ms(lambda r=runner, i=items: r.encode(i), iters=10), 3)
            modality = items[0].modality
            rows[name][f"eager_{label}_ms"] = round(
                ms(lambda r=runner, p=pixels, g=grids, m=modality: r.eager(p, g, m), iters=5), 3)
        runner.pool.graphs.clear()
        del runner
        torch.cuda.empty_cache()
    for row in rows.values():
        emit(row, out)


def emit(row: dict, out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with out.open("a") as f:
            f.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["gemm", "gemm-once", "attention", "tower", "cost"])
    parser.add_argument("model", nargs="?", default="random:qwen3-vl-8b")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.probe == "gemm-once":
        print(json.dumps(gemm_once()))
        return
    probes = {"gemm": lambda: gemm(args.out), "attention": lambda: attention(args.out),
              "tower": lambda: tower(args.model, args.out, args.device), "cost": lambda: cost(args.model, args.out)}
    probes[args.probe]()
    print(f"# {args.probe} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
