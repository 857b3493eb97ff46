"""`--quantization fp8` on the CPU (torch's `_scaled_mm` runs there too): the FP8 product against the float
product it approximates, every family's tower quantized and passing the load-time agreement bar, a refusal with
its figures, and the flag through `vitserve serve` and `vitserve encode`. The GPU's speed and accuracy against
float32 are `vitserve bench`'s to measure."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphs.precision import QuantizationRefused, bf16_block_counts, gate_items, quantize_with_gate
from graphs.runner import GraphRunner, plan_for
from models import load_tower
from models.families import FAMILIES
from models.kernels import fp8_rows_torch as quantize_rows
from models.moe import SparseMoe
from models.patches import Conv2dPatches, LinearPatches
from models.presets import PRESETS
from models.quantization import FP8, Fp8Linear, Fp8Weight, cosine_per_row, fp8_linear, quantize_tower
from service.engine.types import ModelInfo
from service.handoff.content_id import model_identity
from service.handoff.pipeline import Handoff
from tests.http_helpers import ServerThread, SubprocessServer, settings
from tests.test_cli import SAMPLE
from tests.test_towers import rel_err

TINY = sorted(name for name in PRESETS if name.startswith("tiny-"))
ROOT = SAMPLE.parents[2]


@pytest.mark.parametrize("shape", [(64, 128), (40, 36), (3420, 1280), (17, 588)])
def test_weights_pad_to_16_and_dequantize_within_e4m3_rounding(shape):
    """e4m3 keeps 3 mantissa bits: each value within 2**-4 of itself, relative to its row's scale."""
    torch.manual_seed(0)
    w = torch.randn(*shape) * torch.rand(shape[0], 1) * 3  # rows of different magnitudes
    q = Fp8Weight.quantize(w)
    assert q.values.dtype == FP8 and q.values.shape[0] % 16 == 0 and q.values.shape[1] % 16 == 0
    assert (q.in_features, q.out_features) == (shape[1], shape[0])
    assert q.values[shape[0]:].float().abs().sum() == 0 and q.values[:, shape[1]:].float().abs().sum() == 0
    step = q.scale[0, : shape[0], None] * 448 * 2.0**-4
    assert ((q.dequantize() - w).abs() <= step).all()


def test_activation_rows_take_their_own_scales():
    """A row's FP8 values and scale do not depend on the rows beside it."""
    torch.manual_seed(1)
    x = torch.randn(9, 40, dtype=torch.bfloat16)
    x[3] *= 1000  # one loud row
    values, scale = quantize_rows(x, 48)
    alone, alone_scale = quantize_rows(x[5:6], 48)
    assert torch.equal(values[5:6].view(torch.uint8), alone.view(torch.uint8)) and torch.equal(scale[5:6], alone_scale)
    assert values.shape == (9, 48) and values[:, 40:].float().abs().sum() == 0


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_is_the_product_of_the_quantized_operands(bias):
    """The float product of the dequantized operands (float32 accumulation), up to the bf16 output's rounding, and
    within e4m3's error of the full-precision product."""
    torch.manual_seed(2)
    lin = nn.Linear(72, 40, bias=bias)
    x = torch.randn(11, 72)
    q = Fp8Weight.quantize(lin.weight)
    got = fp8_linear(x, q, lin.bias)
    values, scale = quantize_rows(x, q.values.shape[1])
    exact = F.linear(values.float()[:, :72] * scale, q.dequantize(), lin.bias)
    assert got.shape == (11, 40) and got.dtype == x.dtype and rel_err(got, exact) < 4e-3
    assert rel_err(got, lin(x)) < 0.08
    module = Fp8Linear(lin)
    assert torch.equal(module(x), got) and "fp8" in repr(module)


@pytest.mark.parametrize("name", TINY)
def test_every_family_quantizes_and_passes_the_bar(name):
    """Every product but the patch embeddings, routers and experts becomes FP8; the tower still agrees with its
    float32 self at the load-time bar, on images and, where the family takes them, videos."""
    tower = load_tower(name, device="cpu", dtype="bfloat16")
    assert len(tower.block_stack()) == tower.dims.depth  # what the gate can keep in bf16
    report = quantize_with_gate(tower, torch.device("cpu"), FAMILIES[tower.family].video)
    assert report["mode"] == "fp8" and report["products"] > 0 and report["bf16_blocks"] == 0
    assert report["mean_cosine"] >= 0.995 and report["worst_cosine"] >= 0.99
    kept = set()
    for module in tower.modules():
        if isinstance(module, (SparseMoe, Conv2dPatches, LinearPatches)):
            kept.update(id(m) for m in module.modules())
    left = [n for n, m in tower.named_modules() if type(m) is nn.Linear and id(m) not in kept
            and m.weight.numel() > 0]
    assert left == [], left  # an unquantized product would make the figures look better than FP8 is
    assert sum(isinstance(m, Fp8Linear) for m in tower.modules()) > 0


def test_a_tower_below_the_bar_is_refused_with_its_figures():
    tower = load_tower("tiny-qwen2.5-vl", device="cpu", dtype="bfloat16")
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, 256), use_graphs=False)
    item = gate_items(tower, video=False)[0]
    before = runner.eager(item.pixels, [item.grid_thw]).embeds
    figures = r"mean cosine of 0\.99\d+ \(worst 0\.99\d+, (image|video) \[[\d, ]+\]; the first [01] blocks in bf16\)"
    with pytest.raises(QuantizationRefused, match=figures):
        quantize_with_gate(tower, torch.device("cpu"), video=True, mean_bar=0.99999)
    # every try undone: the tower is the unquantized one, to the byte
    assert not any(isinstance(m, Fp8Linear) for m in tower.modules())
    assert not any(isinstance(w, Fp8Weight) for m in tower.modules() for w in (getattr(m, "fused", None) or ()))
    assert torch.equal(runner.eager(item.pixels, [item.grid_thw]).embeds, before)


def test_the_gate_keeps_in_bf16_the_first_blocks_that_cost_the_bar(monkeypatch):
    """A first block whose FP8 products go wrong (their rows reversed and scaled up here) is kept in bf16; the
    rest pass."""
    tower = load_tower("tiny-qwen3-vl", device="cpu", dtype="bfloat16")
    first = tower.block_stack()[0]
    spoiled = {p.data_ptr() for p in first.parameters()}  # fused weights start where their first part does
    quantize = Fp8Weight.quantize.__func__

    def spoil(cls, weight):
        q = quantize(cls, weight)
        if weight.data_ptr() in spoiled:
            q.values, q.scale = q.values.flip(0), q.scale * 100
        return q

    monkeypatch.setattr(Fp8Weight, "quantize", classmethod(spoil))
    report = quantize_with_gate(tower, torch.device("cpu"), video=True)
    assert report["bf16_blocks"] == 1 and report["mean_cosine"] >= 0.995
    assert not any(isinstance(m, Fp8Linear) for m in first.modules())
    assert not any(isinstance(w, Fp8Weight) for m in first.modules() for w in (getattr(m, "fused", None) or ()))
    later = [m for b in tower.block_stack()[1:] for m in b.modules()]
    assert any(isinstance(m, Fp8Linear) for m in later)


def test_gate_tries_up_to_half_the_blocks():
    assert bf16_block_counts(1) == [0]
    assert bf16_block_counts(3) == [0, 1]
    assert bf16_block_counts(32) == [0, 1, 2, 4, 8, 16]
    assert bf16_block_counts(27) == [0, 1, 2, 4, 8]


def test_a_server_whose_tower_fails_the_bar_exits_1_with_the_figures():
    server = SubprocessServer("--quantization", "fp8", env={"VITSERVE_TEST_BROKEN": "fp8_gate"},
                              launcher="tests.hooks.broken_paths")
    code, out = server.run_to_exit(timeout=120)
    assert code == 1, out[-3000:]
    assert "FP8 outputs agree with the tower's float32 outputs at a mean cosine of 0.9" in out, out[-3000:]


def test_quantize_tower_counts_fused_products_once():
    """Fused q/k/v and gate/up holders quantize their fused weight and release their parts' bf16 storage."""
    tower = load_tower("tiny-qwen2.5-vl", device="cpu", dtype="bfloat16")
    linears = sum(type(m) is nn.Linear for m in tower.modules())
    quantized = quantize_tower(tower)
    assert all(m.gate_proj.weight.numel() > 0 for m in tower.modules() if hasattr(m, "gate_proj"))  # until commit
    quantized.commit()
    count = quantized.products
    mlps = [m for m in tower.modules() if hasattr(m, "gate_proj")]
    assert mlps and all(isinstance(m.fused[0], Fp8Weight) and isinstance(m.fused[2], Fp8Weight) for m in mlps)
    assert all(m.gate_proj.weight.numel() == 0 for m in mlps)
    assert 0 < count < linears  # a fused gate/up is one product for two Linears


def test_serve_reports_the_quantization_and_encodes():
    body = {"items": [{"type": "image", "image": base64.b64encode(SAMPLE.read_bytes()).decode()}]}
    infos, answers = {}, {}
    for mode in ("none", "fp8"):
        with ServerThread(settings(model="tiny-qwen2.5-vl", quantization=mode, budgets=[256, 1024])) as srv, \
                srv.client() as c:
            infos[mode] = c.get("/info").json()["quantization"]
            r = c.post("/encode", json=body)
            assert r.status_code == 200, r.text
            answers[mode] = r.json()["data"][0]
    assert infos["none"] == {"mode": "none"}
    assert infos["fp8"]["mode"] == "fp8" and infos["fp8"]["products"] > 0 and infos["fp8"]["mean_cosine"] >= 0.995
    assert answers["none"]["num_tokens"] == answers["fp8"]["num_tokens"] > 0


def test_encode_cli_takes_the_flag(tmp_path):
    out = tmp_path / "out.safetensors"
    proc = subprocess.run([sys.executable, "-m", "service.cli", "encode", "--model", "tiny-qwen2.5-vl", "--device",
                           "cpu", "--quantization", "fp8", "--stats", "-o", str(out), str(SAMPLE)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["quantization"]["mode"] == "fp8" and stats["quantization"]["worst_cosine"] >= 0.99
    assert out.stat().st_size > 0


def test_fp8_outputs_get_other_content_ids():
    """A cache or shared folder serving both must never hand FP8 rows to a bf16 client, or the reverse."""
    tower = load_tower("tiny-qwen2.5-vl", device="cpu", dtype="bfloat16")
    plain = ModelInfo.from_runner(GraphRunner(tower, torch.device("cpu"), plan_for(tower, 256), use_graphs=False))
    fp8 = dataclasses.replace(plain, quantization={"mode": "fp8", "mean_cosine": 0.999})
    handoff = Handoff.__new__(Handoff)
    handoff.settings = settings(model="tiny-qwen2.5-vl")
    ids = {model_identity(handoff.identity_parts(m)) for m in (plain, fp8)}
    assert len(ids) == 2


def test_the_accuracy_bench_puts_fp8_beside_bf16_against_float32():
    """`vitserve bench --accuracy` on the CPU: each item of each shape, bf16 closer to float32 than FP8 is."""
    from service.bench.accuracy import measure, summary

    rows = measure("tiny-qwen3-vl", device="cpu")
    items = [r for r in rows if not r["item"].startswith("_")]
    assert [r["item"].split()[0] for r in items] == ["image", "image", "image", "video"]
    assert all(r["fp8_cos"] < r["bf16_cos"] and r["fp8_err"] > r["bf16_err"] for r in items)
    assert all(r["fp8_deepstack_cos"] < r["bf16_deepstack_cos"] for r in items)  # the DeepStack levels too
    result = summary(rows)
    assert result["fp8"]["mean_cos"] >= 0.995 and result["bf16"]["mean_cos"] > 0.9999
    assert result["bf16_blocks"] == 0 and not result["refused"]


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-paddleocr-vl", "tiny-qwen2.5-omni",
                                  "tiny-lfm3-vl"])
def test_norms_and_activations_hand_fp8_products_their_rows(name, monkeypatch):
    """Where a product reads only a norm's or an activation's output, that step writes the e4m3 rows (`Fp8Rows`)
    and the product takes them as they are: the same bytes as the product quantizing the rows itself."""
    import models.layers
    import models.quantization
    import models.siglip
    from models.kernels import Fp8Rows

    tower = load_tower(name, device="cpu", dtype="bfloat16")
    quantize_tower(tower).commit()
    runner = GraphRunner(tower, torch.device("cpu"), plan_for(tower, 256), use_graphs=False)
    item = gate_items(tower, video=False)[0]
    handed = []
    product = models.quantization.fp8_linear
    monkeypatch.setattr(models.quantization, "fp8_linear",
                        lambda x, w, b: handed.append(isinstance(x, Fp8Rows)) or product(x, w, b))
    with torch.inference_mode():
        fused = runner.eager(item.pixels, [item.grid_thw]).embeds
    assert sum(handed) >= 2 * len(tower.block_stack())  # at least each block's first and last MLP products
    for module in (models.layers, models.siglip):
        monkeypatch.setattr(module, "width_of", lambda weight: None)  # every product quantizes its own rows
    handed.clear()
    with torch.inference_mode():
        alone = runner.eager(item.pixels, [item.grid_thw]).embeds
    assert handed and not any(handed)
    assert torch.equal(fused, alone)


def fp8_checkpoint(source, dest, form: str, block: int = 16) -> dict:
    """`source`'s checkpoint with each 2-D vision weight stored as FP8 the way released FP8 checkpoints store
    them: `block` (e4m3 and one float32 weight_scale_inv per block x block tile, config's weight_block_size) or
    `channel` (e4m3 and a per-output-channel weight_scale, compressed-tensors' FP8_DYNAMIC, with an
    input_scale beside it). Returns the float32 weights the FP8 values stand for, by checkpoint name."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    expected = {}
    for name, w in list(tensors.items()):
        if "visual" not in name or not name.endswith(".weight") or w.dim() != 2 or min(w.shape) < 16:
            continue
        w = w.float()
        if form == "block":
            rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
            tiles = F.pad(w, (0, cols * block - w.shape[1], 0, rows * block - w.shape[0]))
            amax = tiles.view(rows, block, cols, block).abs().amax(dim=(1, 3))
            scale = (amax / 448).clamp_min(1e-12)
            grid = scale.repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
            tensors[name[: -len("weight")] + "weight_scale_inv"] = scale
        else:
            scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp_min(1e-12)
            grid = scale
            tensors[name[: -len("weight")] + "weight_scale"] = scale
            tensors[name[: -len("weight")] + "input_scale"] = torch.ones(1)
        values = (w / grid).to(FP8)
        tensors[name] = values
        expected[name] = values.float() * grid
    save_file(tensors, dest / "model.safetensors")
    if form == "block":
        config = json.loads((dest / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [block, block]}
        (dest / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("form", ["block", "channel"])
def test_fp8_checkpoints_load_as_they_ship(tmp_path, form):
    """An FP8 checkpoint's vision weights load as their values times their scales (to the bit), the scale
    tensors are not reported as unexpected, and the tower serves close to the bf16 checkpoint it came from."""
    from models.loader import check_model
    from tests.checkpoints import write_checkpoint

    write_checkpoint("tiny-qwen2.5-vl", tmp_path / "bf16")
    expected = fp8_checkpoint(tmp_path / "bf16", tmp_path / form, form)
    assert len(expected) >= 8
    assert check_model(str(tmp_path / form)) == "qwen2_5_vl"
    tower = load_tower(str(tmp_path / form), device="cpu", dtype="float32")
    state = tower.state_dict()
    for name, weight in expected.items():
        assert torch.equal(state[name.split("visual.", 1)[1]], weight), name
    plain = load_tower(str(tmp_path / "bf16"), device="cpu", dtype="float32")
    item = gate_items(tower, video=False)[0]
    ours, theirs = (GraphRunner(t, torch.device("cpu"), plan_for(t, 256), use_graphs=False)
                    .eager(item.pixels, [item.grid_thw]).embeds for t in (tower, plain))
    assert 0.99 < cosine_per_row(ours, theirs).mean().item() < 1.0


def test_an_fp8_weight_without_its_scales_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from models import CheckpointError
    from tests.checkpoints import write_checkpoint

    write_checkpoint("tiny-qwen2.5-vl", tmp_path / "bf16")
    fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8", "channel")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    dropped = next(n for n in tensors if n.endswith(".weight_scale"))
    del tensors[dropped]
    save_file(tensors, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"float8_e4m3fn without a weight_scale"):
        load_tower(str(tmp_path / "fp8"), device="cpu", dtype="float32")


def test_block_scales_without_a_block_size_are_read_from_their_grid():
    from models.quantization import dequantize_checkpoint

    values = (torch.randn(40, 72) * 100).to(FP8)
    scale = torch.rand(3, 5) + 0.5  # 16 x 16 tiles: 40 rows in 3, 72 columns in 5
    out = dequantize_checkpoint({"fc.weight": values, "fc.weight_scale_inv": scale, "fc.bias": torch.ones(40)},
                                torch.float32)
    assert set(out) == {"fc.weight", "fc.bias"}
    assert torch.equal(out["fc.weight"][16:32, 64:], values[16:32, 64:].float() * scale[1, 4])
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_checkpoint({"fc.weight": values, "fc.weight_scale_inv": scale}, torch.float32, block=(128, 128))


def test_the_gates_figure_is_each_items_worst_output_not_its_outputs_side_by_side():
    """A DeepStack tower's embedding and levels are held to the bar apart: side by side, better early levels
    would hide a worse embedding (a random Qwen3-VL-8B with its first block in bf16: 0.99515 joined, 0.99460
    for the embedding alone)."""
    from graphs.precision import float32_copy, item_agreement

    ref = [torch.ones(3, 4), torch.ones(3, 4)]
    got = [torch.ones(3, 4), torch.tensor([[1.0, 1, 1, -1]]).expand(3, 4)]  # the second output at cosine 0.5
    assert item_agreement(got, ref) == pytest.approx(0.5)
    tower = load_tower("tiny-qwen3-vl", device="cpu", dtype="bfloat16")
    exact = float32_copy(tower)
    report = quantize_with_gate(tower, torch.device("cpu"), video=True, mean_bar=0.0, worst_bar=0.0)
    runners = [GraphRunner(t, torch.device("cpu"), plan_for(t, 256), use_graphs=False) for t in (tower, exact)]
    figures = []
    for item in gate_items(tower, video=True):
        outs = [r.eager(item.pixels, [item.grid_thw], item.modality) for r in runners]
        levels = [[o.embeds, *o.deepstack] for o in outs]
        assert len(levels[0]) > 1  # DeepStack levels beside the embedding
        figures.append(min(cosine_per_row(a, b).mean().item() for a, b in zip(*levels)))
    assert report["mean_cosine"] == round(float(np.mean(figures)), 5)
    assert report["worst_cosine"] == round(min(figures), 5)
