"""Attention backends on the CPU: backend resolution, the cuDNN backend's plan keys and ragged
metadata, and its Triton metadata kernel under Triton's interpreter against the torch path.

Triton's interpreter (TRITON_INTERPRET=1) must be set before the kernel is defined, hence a
subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.attention import (
    BACKENDS,
    CHECK_MAX_SEQLEN,
    SHORT_SEQLEN,
    backend_problem,
    check_backend_name,
    dense_attention,
    kernel_for,
    packed_attention,
    resolve_backend,
    sdpa_per_segment,
)
from models.attention_cudnn import fill_ragged_metadata, plan_key, ragged_metadata_torch, size_class

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def cu(lengths: list[int], slots: int | None = None) -> torch.Tensor:
    """Boundaries of `lengths`, padded with zero-length segments up to `slots`."""
    bounds = [0]
    for n in lengths + [0] * ((slots or len(lengths)) - len(lengths)):
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32)


def qkv_like_the_towers(rows: int, heads: int, dim: int, dtype=torch.bfloat16):
    """q and k: views of one [rows, 2, heads, dim] rotary output; v: a view of [rows, 3, heads, dim]."""
    gen = torch.Generator().manual_seed(0)
    qk = torch.randn(rows, 2, heads, dim, generator=gen).to(dtype)
    qkv = torch.randn(rows, 3, heads, dim, generator=gen).to(dtype)
    q, k = qk.unbind(1)
    return q, k, qkv[:, 2]


# ---- backend resolution ---------------------------------------------------------------------------


def test_auto_on_the_cpu_is_sdpa() -> None:
    assert resolve_backend("auto", CPU, torch.float32) == "sdpa"
    assert resolve_backend("sdpa", CPU) == "sdpa"


@pytest.mark.parametrize("name", ["flash", "", "CUDNN"])
def test_unknown_backends_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend(name, CPU)


@pytest.mark.parametrize("name", ["cudnn", "varlen"])
def test_cuda_backends_on_the_cpu_say_so(name: str) -> None:
    with pytest.raises(ValueError, match=f"'{name}' needs a CUDA device"):
        check_backend_name(name, CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend(name, CPU)


def test_load_tower_rejects_a_cuda_backend_on_the_cpu_before_loading() -> None:
    from models import load_tower

    with pytest.raises(ValueError, match="'cudnn' needs a CUDA device"):
        load_tower("tiny-qwen2-vl", device="cpu", attention="cudnn")


def test_load_tower_sets_every_attention_layer() -> None:
    from models import load_tower
    from models.layers import Attention

    tower = load_tower("tiny-qwen2.5-vl", device="cpu", attention="auto")
    layers = [m for m in tower.modules() if isinstance(m, Attention)]
    assert tower.backend == "sdpa" and layers and all(m.backend == "sdpa" for m in layers)
    tower.set_attention("varlen")
    assert all(m.backend == "varlen" for m in layers)


def test_cli_offers_every_backend() -> None:
    import argparse

    from service.cli import add_encode_parser

    parser = argparse.ArgumentParser()
    add_encode_parser(parser.add_subparsers())
    args = parser.parse_args(["encode", "x.jpg", "-o", "y", "--attention", "cudnn"])
    assert args.attention == "cudnn"
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    choices = next(a.choices for a in sub.choices["encode"]._actions if a.dest == "attention")
    assert tuple(choices) == BACKENDS


def test_sdpa_per_segment_leaves_padding_segments_out() -> None:
    q, k, v = qkv_like_the_towers(12, 2, 16, torch.float32)
    bounds = cu([5, 0, 4], slots=5)
    out = packed_attention("sdpa", q, k, v, bounds, 5)
    assert torch.equal(out, sdpa_per_segment(q, k, v, bounds))
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))


# ---- short segments: the cudnn backend hands them to varlen_attn ----------------------------------


@pytest.fixture
def fake_kernels(monkeypatch) -> list[tuple[str, int]]:
    """varlen_attn and cuDNN replaced by SDPA per segment; each call is recorded as (kernel, bound)."""
    import torch.nn.attention.varlen as varlen_module

    from models import attention_cudnn

    calls: list[tuple[str, int]] = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
        assert cu_q is cu_k and max_q == max_k and q.shape[-1] % 8 == 0
        calls.append(("varlen", max_q))
        if scale is None:
            return sdpa_per_segment(q, k, v, cu_q)
        return sdpa_per_segment(q * (scale * q.shape[-1] ** 0.5), k, v, cu_q)  # SDPA scales by the padded dim

    def cudnn(q, k, v, cu_seqlens, max_seqlen):
        calls.append(("cudnn", max_seqlen))
        return sdpa_per_segment(q, k, v, cu_seqlens)

    monkeypatch.setattr(varlen_module, "varlen_attn", varlen)
    monkeypatch.setattr(attention_cudnn, "cudnn_attention", cudnn)
    return calls


def test_short_layers_pick_varlen_under_cudnn_only() -> None:
    assert SHORT_SEQLEN == 64  # Qwen2.5-VL's windows: 8 x 8 patches
    assert kernel_for("cudnn", short=True) == "varlen" and kernel_for("cudnn") == "cudnn"
    assert kernel_for("varlen", short=True) == kernel_for("varlen") == "varlen"
    assert kernel_for("sdpa", short=True) == kernel_for("sdpa") == "sdpa"
    assert CHECK_MAX_SEQLEN > SHORT_SEQLEN  # the load-time check runs cuDNN itself


@pytest.mark.parametrize("max_seqlen", [8, 64, 65, 512])
@pytest.mark.parametrize("short, kernel", [(False, "cudnn"), (True, "varlen")])
def test_the_kernel_follows_the_layer_never_the_batch(fake_kernels: list, max_seqlen: int, short: bool,
                                                      kernel: str) -> None:
    """Whatever the batch's longest segment (a lone small image, or one beside a large one), a layer's
    calls go to one kernel: a choice by the bound made an item's bytes depend on its neighbours."""
    q, k, v = qkv_like_the_towers(40, 2, 16, torch.float32)
    bounds = cu([8, 0, 8, 3], slots=6)
    out = packed_attention("cudnn", q, k, v, bounds, max_seqlen, short)
    assert fake_kernels == [(kernel, max_seqlen)]
    assert torch.equal(out, sdpa_per_segment(q, k, v, bounds))


@pytest.mark.parametrize("dim", [36, 52, 72, 90])
def test_varlen_pads_a_head_dim_that_is_not_a_multiple_of_8(fake_kernels: list, dim: int) -> None:
    """varlen_attn takes head dims that are multiples of 8: others travel zero-padded, at the head dim's
    own scale, and come back cut to it (the fake kernel checks what it is handed)."""
    q, k, v = qkv_like_the_towers(40, 2, dim, torch.float32)
    bounds = cu([8, 0, 20, 3], slots=6)
    out = packed_attention("varlen", q, k, v, bounds, 20)
    assert out.shape == q.shape
    torch.testing.assert_close(out, sdpa_per_segment(q, k, v, bounds), rtol=1e-5, atol=1e-6)
    assert fake_kernels == [("varlen", 20)]


@pytest.mark.parametrize("dim", [16, 36, 80])
def test_dense_attention_equals_sdpa_per_segment(dim: int) -> None:
    """The graph-capturable SDPA path (float32 on CUDA): every segment padded to the bound with its keys
    masked; zero-length segments and rows outside every segment are dropped, not read back."""
    q, k, v = qkv_like_the_towers(50, 3, dim, torch.float32)
    bounds = cu([8, 0, 20, 1, 3], slots=7)  # 32 rows of 50 in segments
    got = dense_attention(q, k, v, bounds, 20)
    ref = sdpa_per_segment(q, k, v, bounds)
    torch.testing.assert_close(got[:32], ref[:32], rtol=1e-5, atol=1e-6)
    # an item's rows alone, at another bound and position (the same bytes on CUDA: test_cuda_invariance.py)
    alone = dense_attention(q[8:28], k[8:28], v[8:28], cu([20]), 32)
    torch.testing.assert_close(alone, got[8:28], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, dtype, dim, problem", [
    ("varlen", torch.float32, 80, "takes bfloat16 or float16, not float32"),
    ("cudnn", torch.float32, 80, "takes bfloat16 or float16"),
    ("cudnn", torch.bfloat16, 36, "multiples of 8"),
    ("cudnn", torch.bfloat16, 160, "up to 128"),
    ("varlen", torch.float16, 320, "up to 256"),
    ("varlen", torch.bfloat16, 36, None),  # padded
    ("sdpa", torch.float32, 36, None),
    ("auto", torch.float32, 36, None),
])
def test_backend_problems_name_what_a_kernel_cannot_take(name, dtype, dim, problem) -> None:
    found = backend_problem(name, "cuda", dtype, dim)
    assert (found is None) if problem is None else (problem in found)


def test_auto_serves_float32_on_cuda_through_sdpa(monkeypatch) -> None:
    """No packed kernel takes float32: auto picks the dense SDPA path without trying cuDNN."""
    from models import attention

    monkeypatch.setattr(attention, "check_backend", lambda *a: pytest.fail("cuDNN tried for float32"))
    assert resolve_backend("auto", torch.device("cuda", 0), torch.float32, 16, 80) == "sdpa"
    with pytest.raises(ValueError, match="float32"):
        resolve_backend("varlen", torch.device("cuda", 0), torch.float32, 16, 80)


def test_a_cudnn_tower_runs_its_windows_through_varlen(fake_kernels: list) -> None:
    """The rule lives in the dispatch, so a tower needs nothing of its own: Qwen2.5-VL under the cudnn
    backend sends its window layers (bound 64) to varlen_attn and its full-attention layer (one
    image of 192 patches) to cuDNN, with the tower's results unchanged."""
    import numpy as np

    from graphs.runner import GraphRunner, plan_for
    from models import load_tower

    tower = load_tower("tiny-qwen2.5-vl", device="cpu", dtype="float32")
    runner = GraphRunner(tower, CPU, plan_for(tower, max_batch_tokens=256), use_graphs=False)
    grid = (1, 16, 12)
    pixels = np.random.default_rng(0).integers(0, 256, (192, tower.processor.patch_dim), dtype=np.uint8)
    ref = runner.eager(pixels, [grid]).embeds
    assert fake_kernels == []
    tower.set_attention("cudnn")
    got = runner.eager(pixels, [grid]).embeds
    assert fake_kernels == [("varlen", 64), ("cudnn", 192), ("varlen", 64)]  # full attention in block 1
    assert torch.equal(got, ref)


# ---- the cuDNN backend, without cuDNN -------------------------------------------------------------


def test_size_classes_bound_the_waste() -> None:
    classes = [size_class(n) for n in range(1, 5000)]
    assert classes[:8] == [1, 2, 3, 4, 6, 6, 8, 8]
    assert all(n <= c <= max(n, 1.5 * n) for n, c in zip(range(1, 5000), classes))
    assert len(set(classes)) < 30
    assert size_class(64) == 64 and size_class(1024) == 1024 and size_class(5184) == 6144


def test_plan_key_follows_the_tensors_strides_and_classes() -> None:
    q, k, v = qkv_like_the_towers(1000, 16, 80)
    key = plan_key(q, k, v, cu([300, 0, 400], slots=5), 400)
    assert (key.segments, key.max_seqlen, key.heads, key.head_dim, key.dtype) == (6, 512, 16, 80, "bfloat16")
    assert key.q_strides == key.k_strides == (2 * 16 * 80, 80)
    assert key.v_strides == (3 * 16 * 80, 80)
    assert key.row_strides == (16 * 80, 2 * 16 * 80, 3 * 16 * 80)  # output, q and k, v
    # the same classes share a plan whatever the boundaries or token count
    q2, k2, v2 = qkv_like_the_towers(700, 16, 80)
    assert plan_key(q2, k2, v2, cu([100, 200, 300, 50, 50, 0]), 450) == key
    # other strides, dtype or head dim: another plan
    dense = q.contiguous()
    assert plan_key(dense, k, v, cu([1000]), 1000).q_strides == (16 * 80, 80)
    assert plan_key(*qkv_like_the_towers(10, 16, 72), cu([10]), 10).head_dim == 72
    assert plan_key(*qkv_like_the_towers(10, 16, 80, torch.float16), cu([10]), 10).dtype == "float16"


def test_plan_key_rejects_what_cudnn_cannot_take() -> None:
    q, k, v = qkv_like_the_towers(10, 2, 16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        plan_key(q.float(), k.float(), v.float(), cu([10]), 10)
    with pytest.raises(ValueError, match="int32"):
        plan_key(q, k, v, cu([10]).long(), 10)
    with pytest.raises(ValueError, match="one shape"):
        plan_key(q, k[:5], v, cu([10]), 10)
    with pytest.raises(ValueError, match="unit stride"):
        plan_key(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), cu([10]), 10)


def test_ragged_metadata_from_cu_seqlens() -> None:
    bounds = cu([5, 0, 70, 33, 0])
    lengths, offsets = ragged_metadata_torch(bounds, 8, (1280, 2560))
    assert lengths.dtype == torch.int32 and offsets.dtype == torch.int64
    assert lengths.tolist() == [5, 0, 70, 33, 0, 0, 0, 0]  # capacity beyond cu_seqlens: zero-length
    assert offsets.shape == (2, 9)
    assert offsets[0].tolist() == [0, 6400, 6400, 96000, 138240] + [138240] * 4  # elements, not rows
    assert torch.equal(offsets[1], offsets[0] * 2)
    # into the plan's buffers, over stale values of a larger batch (the torch path, on the CPU)
    seq_len = torch.full((8,), 7, dtype=torch.int32)
    offs = torch.full((2, 9), -1, dtype=torch.int64)
    fill_ragged_metadata(bounds, seq_len, offs, (1280, 2560))
    assert torch.equal(seq_len, lengths) and torch.equal(offs, offsets)


# ---- the metadata kernel, interpreted ---------------------------------------------------------------

SCRIPT = r"""
import json, torch
from models.attention_cudnn import fill_ragged_metadata, ragged_metadata_torch

bounds = [0, 5, 5, 75, 108, 108]  # zero-length segments, then capacity beyond cu_seqlens
cu = torch.tensor(bounds, dtype=torch.int32)
seq_len = torch.full((8,), 9, dtype=torch.int32)
offsets = torch.full((3, 9), -1, dtype=torch.int64)
fill_ragged_metadata(cu, seq_len, offsets, (1280, 2560, 3840))
lengths_ref, offsets_ref = ragged_metadata_torch(cu, 8, (1280, 2560, 3840))
print(json.dumps({"metadata": torch.equal(seq_len, lengths_ref) and torch.equal(offsets, offsets_ref)}))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton", reason="Triton is a test dependency on x86-64 Linux (pyproject.toml)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ragged_metadata_kernel_matches_torch(interpreted: dict) -> None:
    assert interpreted["metadata"] is True


def test_per_forward_memory_holds_only_within_one_forward_and_one_tensor():
    """What lets cuDNN's lengths and offsets be computed once per forward: remembered for the tensor they
    came from, within the `one_forward` that filled them, never outside one (inference tensors included:
    the towers run under inference_mode)."""
    from models.forward_scope import PerForward, one_forward

    memo = PerForward()
    with torch.inference_mode():
        cu, other = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
        memo.fill(cu)
        assert not memo.filled(cu)  # outside a forward nothing is remembered
        with one_forward():
            assert not memo.filled(cu)
            memo.fill(cu)
            assert memo.filled(cu) and not memo.filled(other)  # the same values in another tensor: not it
            with one_forward():  # a nested forward (a tower inside a tower) starts afresh
                assert not memo.filled(cu)
            memo.fill(other)
            assert memo.filled(other) and not memo.filled(cu)
        with one_forward():  # the next forward (or a capture after its warm-up) fills again
            assert not memo.filled(other)
