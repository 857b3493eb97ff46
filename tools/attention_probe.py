"""Attention backends on the GPU, side by side: varlen_attn (FlashAttention-2), cuDNN's ragged
attention through cudnn-frontend (eager, with the plan build timed, and captured in a CUDA graph
replayed after the boundaries change), and dense SDPA (cuDNN and flash backends) where every
segment has one length, as references. Head dims 80 (Qwen2/2.5-VL) and 72 (Qwen3-VL), 16 heads,
bf16, on the towers' workloads. The cuDNN candidates call models/attention_cudnn.py directly, so
they measure cuDNN on Qwen2.5-VL's windows too, which the cudnn backend hands to varlen_attn
(`SHORT_SEQLEN` in models/attention.py): a run re-checks that rule.

    python tools/attention_probe.py [OUT.json]        (default: $OUT/attention_probe.json)

Use it on a new GPU, a new torch or cuDNN, or before changing `--attention auto`'s rule: it says which
backend wins per workload and whether the cuDNN plans still capture.

Each family of candidates runs in a child process of its own with a time budget, so a crash, a
poisoned CUDA context or a hang in one costs only its own results; inside a child every candidate
is guarded (its error and traceback are recorded and the run goes on) and a deadline skips what is
left. The whole run ends within about two minutes. Times are CUDA-event medians of 15 samples
after warm-up (several calls per sample for short kernels); TFLOP/s counts 4 * sum(L_i^2) * H * D;
differences are to varlen_attn over the rows inside segments.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS = 16
HEAD_DIMS = (80, 72)
DEVICE = "cuda"
# child -> seconds it may spend measuring (its process is killed GRACE_S after that)
CHILDREN = {"reference": 20, "cudnn": 45}
GRACE_S = 20


def workloads() -> dict[str, dict]:
    """name -> lengths, segment capacity (slots), max_seqlen bound and rows of the packed tensors."""
    import numpy as np

    from models.windows import window_layout

    # Qwen2.5-VL: 1344x756 px -> 54 x 96 patches, windows of 8x8 patches (4x4 merged tokens), the last
    # row of windows 6 patches high: 84 windows per image, 8 images.
    _, frame_windows = window_layout(54, 96, 2, 4)
    windows = [int(n) for n in frame_windows] * 8
    rng = np.random.default_rng(0)
    mixed = [int(n) for n in rng.integers(16, 1025, 20)]
    specs = {
        "8x5184": dict(lengths=[5184] * 8),
        "32x256": dict(lengths=[256] * 32),
        "1x1024": dict(lengths=[1024]),
        "windows_8x1344x756": dict(lengths=windows, max_seqlen=64),
        "mixed20_in64": dict(lengths=mixed, slots=64, max_seqlen=1024, extra_rows=256),
    }
    for spec in specs.values():
        spec.setdefault("slots", len(spec["lengths"]))
        spec.setdefault("max_seqlen", max(spec["lengths"]))
        spec["rows"] = sum(spec["lengths"]) + spec.pop("extra_rows", 0)
        spec["equal"] = len(set(spec["lengths"])) == 1 and spec["slots"] == len(spec["lengths"])
    return specs


def bounds_of(lengths: list[int], slots: int) -> list[int]:
    out = [0]
    for n in list(lengths) + [0] * (slots - len(lengths)):
        out.append(out[-1] + n)
    return out


def changed_layout(spec: dict, seed: int) -> list[int]:
    """Other boundaries within the same capacity: random lengths up to the bound, some zero, the
    total within the rows."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = len(spec["lengths"])
    new = [int(x) for x in rng.integers(0, spec["max_seqlen"] + 1, n)]
    new = [0 if rng.random() < 0.15 else x for x in new]
    while sum(new) > spec["rows"]:
        new = [x // 2 for x in new]
    if not sum(new):
        new[0] = max(1, spec["max_seqlen"] // 2)
    return new


def flops(lengths: list[int], d: int) -> float:
    return 4.0 * sum(n * n for n in lengths) * HEADS * d


# ---- measuring ------------------------------------------------------------------------------------


def cuda_ms(fn, samples: int = 15) -> float:
    """Median milliseconds per call between CUDA events, several calls per sample when calls are short."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(1, min(50, int(2.0 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def wall_ms(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


class Workload:
    """One workload's tensors at one head dim, laid out as the towers hand them over: q and k views
    of a [rows, 2, heads, d] rotary output, v a view of the [rows, 3, heads, d] qkv projection."""

    def __init__(self, name: str, spec: dict, d: int) -> None:
        import torch

        self.name, self.spec, self.d = name, spec, d
        gen = torch.Generator(device=DEVICE).manual_seed(d)
        rows = spec["rows"]
        self.qk = torch.randn(rows, 2, HEADS, d, device=DEVICE, generator=gen).bfloat16()
        self.qkv = torch.randn(rows, 3, HEADS, d, device=DEVICE, generator=gen).bfloat16()
        self.q, self.k, self.v = self.qk[:, 0], self.qk[:, 1], self.qkv[:, 2]
        self.bounds = bounds_of(spec["lengths"], spec["slots"])
        self.cu = torch.tensor(self.bounds, dtype=torch.int32, device=DEVICE)
        self.max_seqlen = spec["max_seqlen"]
        self.flops = flops(spec["lengths"], d)
        self.ref = self.varlen(self.cu)

    def varlen(self, cu):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(self.q, self.k, self.v, cu, cu, self.max_seqlen, self.max_seqlen)

    def diff(self, out, bounds: list[int] | None = None, ref=None) -> dict:
        real = (bounds or self.bounds)[-1]
        a = out[:real].float()
        b = (self.ref if ref is None else ref)[:real].float()
        return {"max_abs": round((a - b).abs().max().item(), 6),
                "rel": float(f"{((a - b).norm() / b.norm()).item():.3e}"),
                "finite": bool(torch_isfinite(a))}


def torch_isfinite(t) -> bool:
    import torch

    return bool(torch.isfinite(t).all().item())


def capture(fn):
    """A CUDA graph of fn (warmed up on a side stream first) and its static output."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_record(w: Workload, call) -> dict:
    """Capture `call(cu)` over a static boundary buffer; replay on the workload's boundaries, then
    on changed ones (checked against varlen_attn on those), timing the replays."""
    import torch

    cu = w.cu.clone()
    graph, out = capture(lambda: call(cu))
    graph.replay()
    torch.cuda.synchronize()
    first = w.diff(out)
    changed = bounds_of(changed_layout(w.spec, w.d), w.spec["slots"])
    cu.copy_(torch.tensor(changed, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    after = w.diff(out, changed, w.varlen(cu))
    cu.copy_(w.cu)
    ms = cuda_ms(graph.replay)
    return {"ms": ms, **first, "changed_rel": after["rel"], "changed_max_abs": after["max_abs"],
            "changed_finite": after["finite"]}


# ---- the children -----------------------------------------------------------------------------------


def run_child(name: str, out_path: Path, budget_s: float) -> None:
    import torch

    deadline = time.monotonic() + budget_s
    results: list[dict] = []
    info: dict = {"child": name}

    def save() -> None:
        out_path.write_text(json.dumps({"info": info, "results": results}))

    def record(w: Workload, candidate: str, fn) -> None:
        row = {"hd": w.d, "workload": w.name, "candidate": candidate}
        if time.monotonic() > deadline:
            row["skipped"] = "deadline"
        else:
            t0 = time.monotonic()
            try:
                row.update(fn())
                if "ms" in row:
                    row["tflops"] = round(w.flops / (row["ms"] / 1e3) / 1e12, 1)
                    row["ms"] = round(row["ms"], 4)
            except Exception as exc:  # noqa: BLE001 - record it and go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                row["traceback"] = traceback.format_exc()[-4000:]
                print(row["traceback"], file=sys.stderr, flush=True)
            row["seconds"] = round(time.monotonic() - t0, 2)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        save()

    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    try:
        info["gpu"] = torch.cuda.get_device_name()
        info["torch_cudnn"] = torch.backends.cudnn.version()
    except Exception as exc:  # noqa: BLE001 - no device: nothing to measure
        info["device_error"] = f"{type(exc).__name__}: {exc}"
        save()
        raise
    if name == "cudnn":
        try:
            import cudnn

            info["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
            info["cudnn_backend"] = cudnn.backend_version()
        except Exception as exc:  # noqa: BLE001
            info["cudnn_import_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(info), flush=True)
    save()

    specs = workloads()
    for hd in HEAD_DIMS:
        for wname, spec in specs.items():
            if time.monotonic() > deadline:
                results.append({"hd": hd, "workload": wname, "candidate": name, "skipped": "deadline"})
                save()
                continue
            try:
                w = Workload(wname, spec, hd)
            except Exception as exc:  # noqa: BLE001 - no inputs, no candidates: say why
                results.append({"hd": hd, "workload": wname, "candidate": f"{name}:inputs",
                                "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()})
                save()
                continue
            if name == "reference":
                reference_candidates(w, record)
            else:
                cudnn_candidates(w, record)
            del w
            torch.cuda.empty_cache()
    if name == "cudnn":
        try:
            from models import attention_cudnn

            info["cudnn_plans_built"] = attention_cudnn.plan_count()
        except Exception:  # noqa: BLE001
            pass
    save()


def reference_candidates(w: Workload, record) -> None:
    import torch

    record(w, "varlen", lambda: {"ms": cuda_ms(lambda: w.varlen(w.cu)), "rel": 0.0})
    record(w, "varlen:graph", lambda: graph_record(w, w.varlen))
    if not w.spec["equal"]:
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, n = len(w.spec["lengths"]), w.spec["lengths"][0]

    def dense(backend, contiguous: bool):
        def views():
            q, k, v = (t.view(b, n, HEADS, w.d).transpose(1, 2) for t in (w.q, w.k, w.v))
            return tuple(t.contiguous() for t in (q, k, v)) if contiguous else (q, k, v)

        q, k, v = views()

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        out = run().transpose(1, 2).reshape(b * n, HEADS, w.d)
        return {"ms": cuda_ms(run), **w.diff(out)}

    record(w, "sdpa_cudnn_dense", lambda: dense(SDPBackend.CUDNN_ATTENTION, False))
    record(w, "sdpa_cudnn_dense_contiguous", lambda: dense(SDPBackend.CUDNN_ATTENTION, True))
    record(w, "sdpa_flash_dense", lambda: dense(SDPBackend.FLASH_ATTENTION, False))


def cudnn_candidates(w: Workload, record) -> None:
    from models import attention_cudnn

    def eager() -> dict:
        first = wall_ms(lambda: attention_cudnn.cudnn_attention(w.q, w.k, w.v, w.cu, w.max_seqlen))
        out = attention_cudnn.cudnn_attention(w.q, w.k, w.v, w.cu, w.max_seqlen)
        key = attention_cudnn.plan_key(w.q, w.k, w.v, w.cu, w.max_seqlen)
        plan = attention_cudnn.get_plan(key)
        try:  # which backend engine the frontend picked (a private index: diagnostics only)
            engine = plan.graph.get_plan_name_at_index(plan.graph._plan_index)
        except Exception as exc:  # noqa: BLE001
            engine = f"? ({type(exc).__name__})"
        return {"ms": cuda_ms(lambda: attention_cudnn.cudnn_attention(w.q, w.k, w.v, w.cu, w.max_seqlen)),
                "first_call_ms": round(first, 1), "plan": f"B={key.segments} S={key.max_seqlen}", "engine": engine,
                "workspace_bytes": plan.workspace.numel(), **w.diff(out)}

    record(w, "cudnn", eager)
    record(w, "cudnn:graph", lambda: graph_record(
        w, lambda cu: attention_cudnn.cudnn_attention(w.q, w.k, w.v, cu, w.max_seqlen)))


# ---- the parent ------------------------------------------------------------------------------------


def print_table(results: list[dict]) -> None:
    print(f"\n{'hd':>3} {'workload':20} {'candidate':34} {'ms':>9} {'TFLOP/s':>8} {'rel':>9} {'max_abs':>8}  note")
    for r in sorted(results, key=lambda r: (-r.get("hd", 0), r.get("workload", ""), r.get("candidate", ""))):
        note = r.get("skipped") or (r.get("error") or "")[:90]
        if "first_call_ms" in r:
            note = f"first call {r['first_call_ms']} ms " + note
        if "changed_rel" in r:
            note = f"after new boundaries rel {r['changed_rel']:.1e} " + note
        ms = f"{r['ms']:9.4f}" if "ms" in r else f"{'-':>9}"
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'-':>8}"
        rel = f"{r['rel']:9.1e}" if "rel" in r else f"{'-':>9}"
        mx = f"{r['max_abs']:8.4f}" if "max_abs" in r else f"{'-':>8}"
        where = f"{r.get('hd', 0):>3} {r.get('workload', ''):20} {r.get('candidate', ''):34}"
        print(f"{where} {ms} {tf} {rel} {mx}  {note}")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "--child":
        run_child(argv[2], Path(argv[3]), float(argv[4]))
        return 0
    default = Path(os.environ.get("OUT", ".")) / "attention_probe.json"
    out_path = Path(argv[1]) if len(argv) > 1 else default
    out_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    merged: dict = {"children": {}, "results": []}
    for child, budget in CHILDREN.items():
        part = out_path.with_name(f"{out_path.stem}.{child}.json")
        part.unlink(missing_ok=True)
        t0 = time.monotonic()
        status: dict = {}
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", child, str(part),
                                   str(budget)], env=env, timeout=budget + GRACE_S)
            status["returncode"] = proc.returncode
        except subprocess.TimeoutExpired:
            status["returncode"] = "killed after timeout"
        status["seconds"] = round(time.monotonic() - t0, 1)
        if part.exists():
            data = json.loads(part.read_text() or "{}")
            status.update(data.get("info", {}))
            merged["results"] += data.get("results", [])
            part.unlink()
        merged["children"][child] = status
        out_path.write_text(json.dumps(merged, indent=1))
    print_table(merged["results"])
    print(json.dumps(merged["children"], indent=1))
    print(f"written: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
