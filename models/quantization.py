"""FP8 (e4m3) matrix products for a tower's linear layers (`--quantization fp8`).

Weights are quantized once, after loading, from the checkpoint's bf16 (or fp16/fp32) values: one scale per
output channel (the row's largest magnitude over e4m3's largest, 448). Activations are quantized on the fly,
one scale per row (per token; `models.kernels.fp8_rows`, one pass on the GPU), so a row's product depends on
that row alone, as the batch-invariant bf16 products do. The product is `torch._scaled_mm` (e4m3 x e4m3,
float32 accumulation, the scales applied in its epilogue, bias added there, out in bf16, cast to the
activations' dtype where that differs). Its inner and
outer dimensions must be multiples of 16: weights are padded with zero columns and rows to match.

What stays in the tower's dtype: the patch embeddings (the first product, over raw pixels), routers and
mixture-of-experts experts (models/moe.py), each marked `keeps_precision`, attention, norms and the
elementwise steps, and the products of the first blocks when the load-time gate asks for them
(graphs/precision.py). Every other product goes through `linear`, whichever form its weight has: the fused
q/k/v and gate/up products (their holders swap their fused weights) and each remaining `nn.Linear` (swapped
for `Fp8Linear`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import FP8, FP8_MAX, Fp8Rows, fp8_rows

ALIGN = 16  # _scaled_mm's inner dimension (and output width) multiple


@dataclass
class Fp8Weight:
    """A [out, in] weight as e4m3 values [out, in], both padded to multiples of 16, and float32 scales [1, out]."""

    values: torch.Tensor
    scale: torch.Tensor
    in_features: int
    out_features: int

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
        values = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        cols, rows = -w.shape[1] % ALIGN, -w.shape[0] % ALIGN
        if cols or rows:  # zero bytes are +0.0 in e4m3; padded output rows are cut off after the product
            values = F.pad(values.view(torch.uint8), (0, cols, 0, rows)).view(FP8)
            scale = F.pad(scale, (0, rows), value=1.0)
        return cls(values.contiguous(), scale[None, :].contiguous(), w.shape[1], w.shape[0])

    @property
    def padded(self) -> bool:
        return self.values.shape[0] != self.out_features

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the FP8 values stand for (for tests and error figures)."""
        return (self.values.float() * self.scale[0, :, None])[: self.out_features, : self.in_features]


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias through e4m3; x as rows of the tower's dtype, or already quantized (`Fp8Rows`, from
    a norm or activation that wrote them for this product)."""
    if isinstance(x, Fp8Rows):
        if x.values.shape[1] != weight.values.shape[1]:
            raise ValueError(f"FP8 rows of width {x.values.shape[1]} for a product over {weight.values.shape[1]}")
        shape, values, scale = x.shape, x.values, x.scale
    else:
        shape = x.shape
        values, scale = fp8_rows(x.reshape(-1, shape[-1]), weight.values.shape[1])
    if bias is not None and weight.padded:
        bias = F.pad(bias, (0, weight.values.shape[0] - weight.out_features))
    # bf16 out: the only output CUDA's row-wise scaled kernels write (an fp16 or fp32 tower casts it back)
    out = torch._scaled_mm(values, weight.values.t(), scale_a=scale, scale_b=weight.scale,
                           bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16)
    if weight.padded:
        out = out[:, : weight.out_features]
    return out.to(x.dtype).reshape(*shape[:-1], weight.out_features)


def fp8_input_width(module: nn.Module) -> int | None:
    """The width of the e4m3 rows a module reads when its first product is FP8 and it reads its input nowhere
    else (it says so with a `fp8_input` method: attention, MLPs), so the norm before it can write them; else None."""
    reader = getattr(module, "fp8_input", None)
    return reader() if reader is not None else None


def width_of(weight: object) -> int | None:
    """An FP8 weight's padded inner width (what its input rows are quantized to), or None for any other."""
    return weight.values.shape[1] if isinstance(weight, Fp8Weight) else None


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the FP8 product when the weight was quantized."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Fp8Linear(nn.Module):
    """An nn.Linear's product in FP8; the bias stays in the tower's dtype."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.weight = Fp8Weight.quantize(source.weight)
        self.bias = None if source.bias is None else nn.Parameter(source.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"


@dataclass
class Quantized:
    """What `quantize_tower` changed: `undo` puts the tower back as it was, `commit` releases the bf16 storage
    the FP8 weights replaced (a quantized tower is for serving: it is not fused or saved again)."""

    products: int
    bf16_blocks: int
    fused: list[tuple[nn.Module, tuple, list[tuple[nn.Module, torch.Tensor]]]]
    swaps: list[tuple[nn.Module, str, nn.Linear]]

    def undo(self) -> None:
        for holder, fused, parts in self.fused:
            holder.fused = fused
            for part, weight in parts:
                part.weight.data = weight
        for parent, name, linear in self.swaps:
            setattr(parent, name, linear)
        self.fused, self.swaps = [], []

    def commit(self) -> None:
        for _, _, parts in self.fused:
            for part, weight in parts:
                part.weight.data = weight.new_empty(0)
        self.fused, self.swaps = [], []


def quantize_tower(tower: nn.Module, bf16_blocks: int = 0) -> Quantized:
    """Put the tower's products in FP8 (see the module docstring), all but those of its first `bf16_blocks`
    blocks (`block_stack()`): an error made early passes through every later block.

    A holder of fused products (a `fused` tuple and `fused_parts`) gets the weights at its `FUSED_WEIGHTS`
    positions quantized; every other `nn.Linear` becomes an `Fp8Linear`."""
    keep: set[int] = set()
    for block in list(tower.block_stack())[:bf16_blocks]:
        keep.update(id(m) for m in block.modules())
    fused, count = [], 0
    for module in tower.modules():
        if getattr(module, "keeps_precision", False):  # patch embeddings, mixtures of experts
            keep.update(id(m) for m in module.modules())
        elif id(module) not in keep and getattr(module, "fused", None) is not None and hasattr(module, "fused_parts"):
            positions = getattr(module, "FUSED_WEIGHTS", (0,))
            parts = [(part, part.weight.data) for part in module.fused_parts()]
            fused.append((module, module.fused, parts))
            module.fused = tuple(Fp8Weight.quantize(v) if i in positions else v for i, v in enumerate(module.fused))
            count += len(positions)
            keep.update(id(part) for part, _ in parts)
    swaps = [(parent, name, child) for parent in tower.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and id(child) not in keep]
    for parent, name, child in swaps:
        setattr(parent, name, Fp8Linear(child))
    return Quantized(count + len(swaps), bf16_blocks, fused, swaps)


FP8_SCALES = ("weight_scale_inv", "weight_scale", "input_scale")  # beside a weight in FP8 checkpoints


def fp8_scale_names(names: Iterable[str]) -> set[str]:
    """The scale tensors of an FP8 checkpoint among `names`: NAME.weight_scale_inv (one per block, the
    fine-grained format), NAME.weight_scale (per tensor or per output channel, compressed-tensors and ModelOpt)
    and NAME.input_scale (a static activation scale, not used: activations are scaled per token)."""
    names = set(names)
    return {n for n in names for suffix in FP8_SCALES
            if n.endswith("." + suffix) and n[: -len(suffix)] + "weight" in names}


def dequantize_checkpoint(tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                          block: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's vision tensors as `dtype` weights: each e4m3/e5m2 NAME.weight times its scales
    (`fp8_scale_names`), the scales dropped; every other tensor as it is. `block`: the checkpoint's
    `weight_block_size` (found from the shapes when not given). `--quantization fp8` then quantizes the tower
    again in its own scheme; without it the tower serves the checkpoint's values in `dtype`."""
    scales = fp8_scale_names(tensors)
    out = {}
    for name, tensor in tensors.items():
        if name in scales:
            continue
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            out[name] = tensor
            continue
        stem = name[: -len("weight")]
        if stem + "weight_scale_inv" in tensors:
            weight = _blockwise(tensor, tensors[stem + "weight_scale_inv"].float(), block, name)
        elif stem + "weight_scale" in tensors:
            scale = tensors[stem + "weight_scale"].float()
            if scale.numel() == 1:
                weight = tensor.float() * scale.reshape(())
            elif scale.numel() == tensor.shape[0]:
                weight = tensor.float() * scale.reshape(-1, *([1] * (tensor.dim() - 1)))
            else:
                raise ValueError(f"{name}: a weight_scale of shape {tuple(scale.shape)} for a weight of "
                                 f"{tuple(tensor.shape)} (per tensor or per output channel expected)")
        else:
            raise ValueError(f"{name} is stored in {tensor.dtype} without a weight_scale or weight_scale_inv")
        out[name] = weight.to(dtype)
    return out


def _blockwise(values: torch.Tensor, scale: torch.Tensor, block: Sequence[int] | None, name: str) -> torch.Tensor:
    rows, cols = values.shape
    if block is None:  # the smallest power-of-two block that gives these scales' grid
        block = next(((b, b) for b in (2**k for k in range(4, 11))
                      if (-(-rows // b), -(-cols // b)) == tuple(scale.shape)), None)
    if block is None or (-(-rows // block[0]), -(-cols // block[1])) != tuple(scale.shape):
        raise ValueError(f"{name}: weight_scale_inv of shape {tuple(scale.shape)} does not tile a weight of "
                         f"{(rows, cols)} in blocks of {block}")
    grid = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return values.float() * grid


def cosine_per_row(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12)
