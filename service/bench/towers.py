"""`vitserve bench`: this engine (graphs on and off) against transformers' eager vision model, side by
side in one process on one GPU, on the same random-weight preset and the same inputs, with the
floor (the tower's matrix products and attention calls alone, replayed as one graph) and MFU
against a bf16 matmul measured in the same run. The floor is measured twice: with varlen_attn (the
design notes' reference) and with the attention backend the tower serves with (`floor_best`), which
runs calls of short segments (Qwen2.5-VL's windows) through varlen_attn as the tower does
(models/attention.py, `SHORT_SEQLEN`)."""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from graphs.runner import GraphRunner, plan_for
from models import VisualInput, kernels, load_tower
from models.presets import PRESETS, full_config

log = logging.getLogger("vitserve.bench")


def workloads(patch: int, seed: int = 0) -> dict[str, list[tuple[int, int, int]]]:
    """Grids (t, h, w) in patches for the workloads of the design notes, plus a seeded mix."""
    even = lambda n: n - n % 2  # noqa: E731
    big = (1, even(1344 // patch), even(756 // patch))
    rng = np.random.default_rng(seed)
    mix = [(1, 2 * int(rng.integers(4, 40)), 2 * int(rng.integers(4, 40))) for _ in range(24)]
    return {
        "1x448": [(1, even(448 // patch), even(448 // patch))],
        "32x224": [(1, even(224 // patch), even(224 // patch))] * 32,
        "128x224": [(1, even(224 // patch), even(224 // patch))] * 128,
        "8x1344x756": [big] * 8,
        "1x1344x756": [big],
        "video16f448": [(8, even(448 // patch), even(448 // patch))],
        "4xvideo32f336": [(16, even(336 // patch), even(336 // patch))] * 4,
        "mix24": mix,
    }


def random_items(tower: torch.nn.Module, grids: list[tuple[int, int, int]], seed: int = 0,
                 device: str = "cuda") -> list[VisualInput]:
    """Seeded uint8 patch rows on the GPU for each grid (t, h, w): a workload's inputs, the same in every run."""
    rng = np.random.default_rng(seed)
    return [VisualInput("video" if t > 1 else "image",
                        torch.from_numpy(rng.integers(0, 256, (t * h * w, tower.processor.patch_dim),
                                                      dtype=np.uint8)).to(device), (t, h, w))
            for t, h, w in grids]


def cuda_time(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of `fn` between CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time(lambda: a @ b, 3, 20)
    return 2 * 8192**3 / (ms / 1e3) / 1e12


def tower_dims(tower) -> dict:
    d = tower.dims
    wide = d.hidden * tower.merge_unit
    # The matrix products after the blocks on each merged token, as chains of (in, out) from the merge
    # block's concatenated patches: each merger's two layers, or GLM's merging Conv2d and its gated merger
    # (proj, gate and up in one product, down on the gated half).
    if hasattr(tower, "downsample"):
        context = tower.merger.hidden
        merger = [[(wide, d.out), (d.out, d.out), (d.out, 2 * context), (context, d.out)]]
    elif hasattr(tower, "merger_products"):  # a projector of its own widths (models/mergers.py)
        merger = [tower.merger_products]
    else:
        merger = [[(wide, wide), (wide, d.out)]] * (1 + tower.num_deepstack)
    windows = getattr(tower, "windows", None)  # towers without a window layout attend over whole frames or clips
    return dict(hidden=d.hidden, inter=d.mlp, depth=d.depth, heads=d.heads, kv_heads=d.kv_heads,
                gated=tower.spec.mlp == "gated", cin=tower.processor.patch_dim, out=d.out,
                merger=merger, unit=tower.merge_unit, window=windows.window if windows else 0,
                full=set(getattr(tower, "full_attention", range(d.depth))))


def hf_grid_thw(tower, grids) -> list[tuple[int, int, int]]:
    """The grids as transformers' vision model of the family takes them (see `reference_frames_as_grids`)."""
    if tower.spec.extra.get("reference_frames_as_grids"):
        return [(1, h, w) for t, h, w in grids for _ in range(t)]
    if hasattr(tower.geometry, "frames"):  # clips cut into attention segments (models.geometries)
        return [(n, h, w) for t, h, w in grids for n in tower.geometry.frames((t, h, w))]
    return list(grids)


def forward_flops(d: dict, grids) -> float:
    """Matrix-product FLOPs of one forward (attention per frame, or per window in window layers)."""
    n = sum(t * h * w for t, h, w in grids)
    h, inter = d["hidden"], d["inter"]
    mlp = (3 if d["gated"] else 2) * 2 * h * inter
    kv = h * d["kv_heads"] // d["heads"]  # key/value width: below h with grouped heads
    f = n * 2 * d["cin"] * h + d["depth"] * n * (2 * (2 * h * h + 2 * h * kv) + mlp)
    for layer in range(d["depth"]):
        for t, gh, gw in grids:
            if layer in d["full"]:
                f += t * 4 * (gh * gw) ** 2 * h
            else:  # windows of window x window merged tokens
                side = d["window"] * 2
                f += t * 4 * gh * gw * min(side * side, gh * gw) * h
    tokens = n // d["unit"]
    f += tokens * sum(2 * a * b for chain in d["merger"] for a, b in chain)
    return float(f)


def fp8_products(dev: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`x @ w` as the FP8 towers run it, less the activations' quantization: one `_scaled_mm` over e4m3
    operands of the same shapes (inner and outer dimensions padded to 16), bf16 out. The e4m3 inputs are static
    buffers of random values (a floor times the products, not what they compute)."""
    from models.quantization import ALIGN, FP8

    weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def up(k: int) -> int:
        return -(-k // ALIGN) * ALIGN

    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        k, n = up(w.shape[0]), up(w.shape[1])
        if id(w) not in weights:
            weights[id(w)] = (torch.randn(n, k, device=dev).to(FP8).t(), torch.ones(1, n, device=dev))
        if (x.shape[0], k) not in inputs:
            inputs[(x.shape[0], k)] = (torch.randn(x.shape[0], k, device=dev).to(FP8),
                                       torch.ones(x.shape[0], 1, device=dev))
        (wq, sb), (xq, sa) = weights[id(w)], inputs[(x.shape[0], k)]
        return torch._scaled_mm(xq, wq, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)[:, : w.shape[1]]

    return product


def floor_graph(d: dict, grids, tower, attention: str = "varlen", fp8: bool = False) -> Callable[[], None]:
    """Only the GEMMs and attention calls (backend `attention`, see models/attention.py) of the tower
    for these shapes, as one CUDA graph; with `fp8`, the products after the patch embedding in FP8
    (`fp8_products`), as `--quantization fp8` runs them."""
    from models.attention import packed_attention

    n = sum(t * h * w for t, h, w in grids)
    h, heads, kv_heads = d["hidden"], d["heads"], d["kv_heads"]
    kv = h * kv_heads // heads
    dt, dev = torch.bfloat16, "cuda"
    w = lambda a, b: torch.randn(a, b, device=dev, dtype=dt) * 0.02  # noqa: E731
    mm = fp8_products(dev) if fp8 else torch.matmul
    w_embed, w_qkv, w_o = w(d["cin"], h), w(h, h + 2 * kv), w(h, h)
    w_up, w_down = w(h, (2 if d["gated"] else 1) * d["inter"]), w(d["inter"], h)
    w_merger = [[w(a, b) for a, b in chain] for chain in d["merger"]]
    cap = tower.required_capacity(grids)
    meta = tower.build_metadata(grids, cap)
    cu = torch.from_numpy(meta["cu_seqlens"]).to(dev)
    cu_w = torch.from_numpy(meta["cu_window_seqlens"]).to(dev) if "cu_window_seqlens" in meta else cu
    x0 = torch.randn(n, d["cin"], device=dev, dtype=dt)

    def forward():
        x = x0 @ w_embed
        for layer in range(d["depth"]):
            rows = mm(x, w_qkv).reshape(n, heads + 2 * kv_heads, -1)
            q, k, v = rows[:, :heads], rows[:, heads : heads + kv_heads], rows[:, heads + kv_heads :]
            if kv_heads != heads:  # grouped heads, expanded as the tower does
                k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            full = layer in d["full"]
            a = packed_attention(attention, q, k, v, cu if full else cu_w,
                                 cap.max_seqlen if full else cap.max_window_seqlen, short=not full)
            x = x + mm(a.reshape(n, h), w_o)
            m = mm(x, w_up)
            if d["gated"]:
                m = m[:, : d["inter"]] * m[:, d["inter"] :]
            else:
                m = torch.nn.functional.gelu(m, approximate="tanh")
            x = x + mm(m, w_down)
        for chain in w_merger:
            y = x.view(n // d["unit"], -1)
            for wm in chain:
                y = mm(y[:, : wm.shape[0]], wm)  # a gated product feeds its first half on

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    def replay() -> None:
        graph.replay()

    # The graph reads the weights, inputs and boundaries `forward` holds: freed, their memory would go to the next
    # tensor made, and the floor would time products of whatever it holds and attention over whatever boundaries
    # it holds (or read out of bounds).
    replay.holds = forward  # type: ignore[attr-defined]
    return replay


# transformers' attention for a family's reference where it is not sdpa (Hy4's text attention has sinks, which
# its sdpa path refuses)
REFERENCE_ATTENTION = {"hy_v4_vl": "eager"}


def hf_visual(tower):
    """transformers' vision model of the tower's preset, carrying the tower's weights; for a family whose
    projector sits outside that vision model, the whole model called through the family's entry point
    (`Family.extra["reference_features"]`, see `ReferenceFeatures`)."""
    import transformers

    spec = tower.spec
    attention = REFERENCE_ATTENTION.get(spec.model_type, "sdpa")
    cfg = full_config(PRESETS[tower.name])
    dev = next(tower.parameters()).device
    dtype = next(tower.parameters()).dtype
    kwargs = {"attn_implementation": attention} if spec.model_type in REFERENCE_ATTENTION else {}
    if not kwargs:
        spec.vision_config(cfg)._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = getattr(transformers, spec.hf_class)._from_config(cfg, dtype=dtype, **kwargs)
    if not set(tower.state_dict()) <= set(vision_module(model).state_dict()):
        model = hf_model_carrying(tower, model, cfg, attention)
        if "reference_features" in spec.extra:
            return ReferenceFeatures(model, spec.extra["reference_features"]).eval()
        return vision_module(model).eval()
    visual = vision_module(model).to_empty(device=dev)
    visual.load_state_dict(tower.state_dict(), strict=False)
    for m in visual.modules():  # non-persistent rotary buffers were left empty by to_empty
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
            n = m.inv_freq.numel()
            m.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * n, 2, dtype=torch.float, device=dev) / (2 * n)))
    return visual.eval()


def hf_model_carrying(tower, meta_model, cfg, attention: str = "sdpa"):
    """transformers' whole model carrying the tower's weights, where its module names are not the tower's
    (transformers renames tensors between its checkpoints and its modules, or the tower names its parts as the
    checkpoints do): the names `save_pretrained` would write (transformers' own reverse conversion of the meta
    model's), each matched to a tower tensor by the loader's own reading of a checkpoint (its prefixes and
    renames), then loaded by from_pretrained with transformers' conversions. The text model stays random."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    from models.loader import tower_name

    spec = tower.spec
    full_names = {}
    for key in revert_weight_conversion(meta_model, meta_model.state_dict()):
        name = tower_name(key, spec.prefixes, spec.renames)
        if name is not None:
            full_names[name] = key
    unnamed = sorted(set(tower.state_dict()) - set(full_names))
    if unnamed:
        raise KeyError(f"{unnamed[:5]}: not among the tensors {spec.hf_class} writes under {spec.prefixes}")
    state = {full_names[k]: v.cpu() for k, v in tower.state_dict().items()}
    param = next(tower.parameters())
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its report lists the text model's weights, left random
    try:
        model = getattr(transformers, spec.hf_class).from_pretrained(
            None, config=cfg, state_dict=state, dtype=param.dtype, attn_implementation=attention)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model.to(param.device)


class ReferenceFeatures(torch.nn.Module):
    """A whole transformers model called like a vision model, for families whose projector sits outside the
    vision model: packed pixels and grids in, `features(model, pixels, grid_thw)` out (the family's
    `extra["reference_features"]`: its entry point, without the per-item split). `parts`: the modules that
    entry point runs, held under the tower's own names so that the tower's state dict loads into them and
    parameter counts compare, the rest of the model unregistered (and unloaded); without them the whole model
    is registered, so that it moves and casts with this module."""

    def __init__(self, model: torch.nn.Module, features: Callable,
                 parts: dict[str, torch.nn.Module] | None = None) -> None:
        super().__init__()
        if parts is None:
            self.model = model
        else:
            for name, module in parts.items():
                setattr(self, name, module)
        self._whole = [model]  # a list: not a submodule (again)
        self._features = features

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self._features(self._whole[0], pixels, grid_thw)


def vision_module(model) -> torch.nn.Module:
    """The vision model inside a transformers model (the Omni models keep it in their thinker; LFM3-VL and
    dots3-note call it `vision_tower`, and LFM3-VL's projector sits beside it: both as one module; families
    whose projector sits outside the vision model name their image entry point)."""
    from models.families import FAMILIES

    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    inner = getattr(model, "model", None)
    if family is not None and "reference_features" in family.extra and hasattr(inner, "visual") \
            and hasattr(inner, "projector"):  # PaddleOCR-VL, Cosmos3-Edge: the tower's `visual` and `projector`
        visual = getattr(inner.visual, "vision_model", inner.visual)  # PaddleOCR-VL's wraps its transformer again
        return ReferenceFeatures(model, family.extra["reference_features"],
                                 parts={"visual": visual, "projector": inner.projector})
    for path in ("thinker.model.visual", "thinker.visual", "model.visual", "visual", "model.vision_tower",
                 "model.vision_model"):
        found = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if found is not None:
            projector = getattr(getattr(model, "model", None), "multi_modal_projector", None)
            return ProjectedVision(found, projector) if path == "model.vision_tower" and projector else found
    raise AttributeError(f"no vision model in {type(model).__name__}")


class ProjectedVision(torch.nn.Module):
    """A vision model and the projector the model runs on its last hidden state, called as one."""

    def __init__(self, vision: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision, self.projector = vision, projector

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.projector(self.vision(pixel_values, grid_thw=grid_thw, **kwargs).last_hidden_state)


def hf_outputs(out) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merged tokens and DeepStack features from any transformers 5.x vision model output."""
    if isinstance(out, torch.Tensor):
        return out, []
    if isinstance(out, tuple):
        return out[0], list(out[1]) if len(out) > 1 else []
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


def run(models: list[str], out_dir: Path, max_batch_tokens: int = 16384, only: list[str] | None = None,
        quantization: str = "none") -> dict:
    """Each model's rows; with `quantization="fp8"` also its FP8 rows (model name + "+fp8") after its bf16 ones,
    the floor the same bf16 one."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version()}
    from models import attention_cudnn

    if attention_cudnn.available() is None:
        env["cudnn"] = attention_cudnn.versions()
    peak = matmul_tflops()
    env["bf16_matmul_tflops"] = round(peak, 1)
    print(json.dumps(env), flush=True)
    rows = []
    for name in models:
        for mode in ("none",) + ((quantization,) if quantization != "none" else ()):
            try:
                rows += bench_model(name, peak, max_batch_tokens, only, mode, baseline=rows)
            except Exception as exc:  # noqa: BLE001 - one model's failure is a row; the others still run
                print(f"{name}: failed: {exc!r}", flush=True)
                rows.append(dict(model=name, workload="_failed", error=repr(exc)))
            torch.cuda.empty_cache()
    result = {"env": env, "rows": rows}
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    print_table(rows)
    chart(rows, out_dir / "bench.png")
    return result


def bench_model(name: str, peak: float, max_batch_tokens: int, only: list[str] | None,
                quantization: str = "none", baseline: list[dict] = ()) -> list[dict]:
    """One model's rows. A quantized model's rows take transformers' time from its unquantized rows in
    `baseline` (the same bf16 reference) and add its own time against theirs (`vs_bf16`)."""
    rows = []
    unquantized = {r["workload"]: r for r in baseline if r["model"] == name and "graph_ms" in r}
    tower = load_tower(name, device="cuda", dtype="bfloat16")
    # before quantizing (transformers' model carries the bf16 weights); not built where the bf16 rows give its times
    hf = hf_visual(tower) if quantization == "none" or not unquantized else None
    if quantization == "fp8":
        from graphs.precision import quantize_with_gate
        from models.families import FAMILIES

        # every block in FP8 whatever the gate's figures (printed): the speed of a tower that passes it whole
        report = quantize_with_gate(tower, torch.device("cuda"), FAMILIES[tower.family].video, 0.0, 0.0)
        print(f"{name}: fp8, {report}", flush=True)
        name = f"{name}+fp8"
    plan = plan_for(tower, max_batch_tokens=max_batch_tokens)
    graphs = GraphRunner(tower, torch.device("cuda"), plan)
    t0 = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t0
    eager = GraphRunner(tower, torch.device("cuda"), plan, use_graphs=False)
    dims = tower_dims(tower)
    print(f"{name}: {len(graphs.pool.graphs)} graphs captured in {capture_s:.1f}s, "
          f"pool {graphs.stats.pool_bytes / 2**30:.2f} GiB, failures {len(graphs.pool.failed)}", flush=True)
    for wname, grids in workloads(tower.processor.patch_size).items():
        if only and wname not in only:
            continue
        items = random_items(tower, grids)
        host = torch.cat([it.pixels for it in items]).cpu().numpy()
        x = torch.from_numpy(tower.processor.normalize(host)).to("cuda", torch.bfloat16)
        g = torch.tensor(hf_grid_thw(tower, grids), device="cuda")
        hits0 = graphs.stats.graph_items
        eager0 = sum(graphs.stats.eager_items.values())
        before = unquantized.get(wname) if quantization != "none" else None
        with torch.inference_mode():
            ms_hf = before["hf_ms"] if before else cuda_time(lambda: hf(x, grid_thw=g))  # noqa: B023
            ms_graph = cuda_time(lambda: graphs.encode(items))  # noqa: B023
            ms_eager = cuda_time(lambda: eager.encode(items))  # noqa: B023
            # Timed again after the eager runner: a graph row that differs from this one was disturbed
            # by what ran before it (transformers' forward first), not by the graphs.
            ms_graph_again = cuda_time(lambda: graphs.encode(items))  # noqa: B023
            fused = set(kernels._enabled)
            kernels.set_enabled(None)  # the same eager path with torch's kernels: what the fusion saves
            try:
                ms_unfused = before["eager_unfused_ms"] if before else cuda_time(lambda: eager.encode(items))  # noqa: B023
            finally:
                kernels.set_enabled(fused)
        hit = graphs.stats.graph_items - hits0
        miss = sum(graphs.stats.eager_items.values()) - eager0
        ms_floor = before["floor_ms"] if before else cuda_time(floor_graph(dims, grids, tower))
        fp8_floor = {}
        if quantization == "fp8":  # the FP8 floor: FP8 products and the served attention backend
            best_fp8 = tower.backend if tower.backend not in ("varlen", "sdpa") else "varlen"
            ms_fp8 = cuda_time(floor_graph(dims, grids, tower, best_fp8, fp8=True))
            fp8_floor = dict(floor_fp8_ms=round(ms_fp8, 3), over_floor_fp8=round(ms_graph / ms_fp8, 2))
            if before:
                fp8_floor.update(bf16_graph_ms=before["graph_ms"], vs_bf16=round(ms_graph / before["graph_ms"], 3))
        best = tower.backend if tower.backend not in ("varlen", "sdpa") else "varlen"
        ms_floor_best = before["floor_best_ms"] if before else \
            ms_floor if best == "varlen" else cuda_time(floor_graph(dims, grids, tower, best))
        flops = forward_flops(dims, grids)
        patches = sum(t * h * w for t, h, w in grids)
        row = dict(model=name, workload=wname, patches=patches, hf_ms=round(ms_hf, 3),
                   graph_ms=round(ms_graph, 3), graph_again_ms=round(ms_graph_again, 3), eager_ms=round(ms_eager, 3),
                   eager_unfused_ms=round(ms_unfused, 3),
                   fused_kernels=sorted(fused), floor_ms=round(ms_floor, 3), best_attention=best,
                   floor_best_ms=round(ms_floor_best, 3),
                   speedup_vs_hf=round(ms_hf / ms_graph, 2), graph_vs_eager=round(ms_eager / ms_graph, 2),
                   over_floor=round(ms_graph / ms_floor, 2), over_floor_best=round(ms_graph / ms_floor_best, 2),
                   patches_per_s=round(patches / ms_graph * 1e3),
                   mfu=round(flops / (ms_graph / 1e3) / (peak * 1e12), 3),
                   hf_mfu=round(flops / (ms_hf / 1e3) / (peak * 1e12), 3),
                   hit_rate=round(hit / max(hit + miss, 1), 3), **fp8_floor)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append(dict(model=name, workload="_capture", graphs=len(graphs.pool.graphs),
                     capture_s=round(capture_s, 2), pool_gib=round(graphs.stats.pool_bytes / 2**30, 3)))
    return rows


def profile(name: str, workload: str, out_path: Path, max_batch_tokens: int = 16384) -> None:
    """Kernel-time breakdown of one workload (torch.profiler) on the eager path, which runs the graph
    path's kernels at exact shapes, plus the wall time of graph and eager `encode` calls, so a gap
    to the floor shows as kernel time or as host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tower = load_tower(name, device="cuda", dtype="bfloat16")
    plan = plan_for(tower, max_batch_tokens=max_batch_tokens)
    runner = GraphRunner(tower, torch.device("cuda"), plan, use_graphs=False)
    items = random_items(tower, workloads(tower.processor.patch_size)[workload])
    with torch.inference_mode():
        ms_eager = cuda_time(lambda: runner.encode(items))
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.encode(items)
            torch.cuda.synchronize()
        modalities = tuple(sorted({it.modality for it in items}))
        graph_ms = {}
        fused = set(kernels._enabled)
        # The graph path once per kernel set: all fused kernels, each one left out, none.
        for label, subset in [("all", fused), *[(f"no {k}", fused - {k}) for k in sorted(fused)], ("none", set())]:
            kernels.set_enabled(subset)
            graphs = GraphRunner(tower, torch.device("cuda"), plan, modalities=modalities)
            graphs.capture()
            before = graphs.stats.as_dict()
            graph_ms[label] = round(cuda_time(lambda g=graphs: g.encode(items)), 3)
            after = graphs.stats.as_dict()
            graphs.pool.graphs.clear()  # give the pool's memory back before the next capture
            torch.cuda.empty_cache()
        kernels.set_enabled(fused)
        ms_graph = graph_ms["all"]
    replays = {k: v - before["replays"].get(k, 0) for k, v in after["replays"].items()
               if v != before["replays"].get(k, 0)}
    events = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
    table = events.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    with open(out_path, "a") as f:
        f.write(f"== {name} {workload}: eager {ms_eager:.2f} ms wall, {kernel_ms:.2f} ms of kernels; "
                f"graph {ms_graph:.2f} ms wall; fused kernels {sorted(kernels._enabled)}\n"
                f"graph ms by kernel set: {graph_ms}\nreplays per key (13 runs): {replays}; "
                f"eager items: {after['eager_items']}\n{table}\n")
    print(f"{name} {workload}: eager {ms_eager:.2f} ms, kernels {kernel_ms:.2f} ms, graph {graph_ms}, "
          f"replays {replays}", flush=True)


def bench_chunking(name: str, out_path: Path, frames: tuple[int, ...] = (64, 256), side: int = 448) -> list[dict]:
    """Long videos: exact temporal chunking through graphs against the eager fallback."""
    tower = load_tower(name, device="cuda", dtype="bfloat16")
    plan = plan_for(tower)
    chunked = GraphRunner(tower, torch.device("cuda"), plan, modalities=("video",), video_chunking=True)
    chunked.capture()
    fallback = GraphRunner(tower, torch.device("cuda"), plan, use_graphs=False)
    p = tower.processor.patch_size
    rows = []
    for n in frames:
        grid = (n // 2, side // p - (side // p) % 2, side // p - (side // p) % 2)
        rng = np.random.default_rng(n)
        video = VisualInput("video", torch.from_numpy(rng.integers(0, 256, (grid[0] * grid[1] * grid[2],
                            tower.processor.patch_dim), dtype=np.uint8)).cuda(), grid)
        with torch.inference_mode():
            a = chunked.encode([video])[0].embeds
            b = fallback.encode([video])[0].embeds
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            ms_chunked = cuda_time(lambda: chunked.encode([video]))  # noqa: B023
            ms_eager = cuda_time(lambda: fallback.encode([video]))  # noqa: B023
        rows.append(dict(model=name, frames=n, grid=list(grid), chunked_ms=round(ms_chunked, 2),
                         eager_ms=round(ms_eager, 2), speedup=round(ms_eager / ms_chunked, 3),
                         rel_diff=round(err, 5)))
        print(json.dumps(rows[-1]), flush=True)
    with open(out_path, "a") as f:
        f.write(json.dumps(rows) + "\n")
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':22} {'workload':14} {'HF ms':>8} {'graph ms':>9} {'eager ms':>9} {'unfused':>9} {'floor ms':>9} "
          f"{'floor best':>10} {'xHF':>6} {'/floor':>7} {'/best':>6} {'MFU':>5} {'hit':>5}")
    for r in rows:
        if r["workload"] == "_capture":
            print(f"{r['model']:22} capture: {r['graphs']} graphs, {r['capture_s']} s, {r['pool_gib']} GiB")
            continue
        if r["workload"] == "_failed":
            print(f"{r['model']:22} failed: {r['error']}")
            continue
        print(f"{r['model']:22} {r['workload']:14} {r['hf_ms']:8.2f} {r['graph_ms']:9.2f} {r['eager_ms']:9.2f} "
              f"{r['eager_unfused_ms']:9.2f} {r['floor_ms']:9.2f} {r['floor_best_ms']:10.2f} {r['speedup_vs_hf']:6.2f} "
              f"{r['over_floor']:7.2f} {r['over_floor_best']:6.2f} {r['mfu']:5.2f} {r['hit_rate']:5.2f}"
              + (f"  fp8: {r['vs_bf16']:.3f}x bf16, {r['over_floor_fp8']:.2f}x its floor" if "vs_bf16" in r else ""))


def chart(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no chart written")
        return
    data = [r for r in rows if not r["workload"].startswith("_")]
    labels = [f"{r['model'].split(':')[-1]}\n{r['workload']}" for r in data]
    xs = np.arange(len(data))
    fig, ax = plt.subplots(figsize=(max(8, len(data) * 0.6), 4.5))
    ax.bar(xs - 0.2, [r["speedup_vs_hf"] for r in data], 0.4, label="graphs vs transformers")
    ax.bar(xs + 0.2, [r["hf_ms"] / r["floor_ms"] for r in data], 0.4, label="floor vs transformers")
    ax.set_xticks(xs, labels, rotation=90, fontsize=7)
    ax.set_ylabel("speed-up over transformers eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
