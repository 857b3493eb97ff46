"""FP8 products at the towers' shapes, piece by piece (GPU): `python tools/fp8_probe.py > OUT.jsonl`.

Per shape (rows x K -> N: Qwen2.5-VL-7B's q/k/v, projection, gate/up and down products, Qwen3-VL-8B's two MLP
products; 41472 rows are 8 images 1344x756, 784 one 448x448), milliseconds (CUDA events, mean of 20 after 3
warm-ups) of: the bf16 product (`bf16`), the e4m3 product alone (`fp8_mm`), the activations' per-row quantization
through torch (`quant_torch`) and the Triton kernel (`quant_triton`), and the whole `fp8_linear` (`fp8_linear`).
The first line is the fused kernels' load-time check (`fp8_rows`: the share of bytes that differ from torch's).
"""

import json

import torch
import torch.nn.functional as F

from models import kernels as K
from models.quantization import Fp8Weight, fp8_linear

SHAPES = ((1280, 3840), (1280, 1280), (1280, 6912), (3456, 1280), (1152, 4304), (4304, 1152))


def ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / iters, 4)


def main() -> None:
    dev = torch.device("cuda")
    print(json.dumps({"check_kernels": K.check_kernels(dev)}), flush=True)
    K.enable_triton(dev)
    for rows in (41472, 784):
        for k, n in SHAPES:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            q = Fp8Weight.quantize(w)
            width = q.values.shape[1]
            values, scale = K.fp8_rows_torch(x, width)
            print(json.dumps(dict(
                rows=rows, k=k, n=n, bf16=ms(lambda: F.linear(x, w)),  # noqa: B023
                fp8_mm=ms(lambda: torch._scaled_mm(values, q.values.t(), scale_a=scale, scale_b=q.scale,  # noqa: B023
                                                   out_dtype=torch.bfloat16)),
                quant_torch=ms(lambda: K.fp8_rows_torch(x, width)),  # noqa: B023
                quant_triton=ms(lambda: K.fp8_rows_triton(x, width)),  # noqa: B023
                fp8_linear=ms(lambda: fp8_linear(x, q, None)))), flush=True)  # noqa: B023


if __name__ == "__main__":
    main()
