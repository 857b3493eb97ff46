"""Matrix products whose every row comes out the same whatever the number of rows (CUDA).

cuBLAS picks a kernel by the problem's shape, and for few rows it splits the inner dimension (split-K,
stream-K) and sums partial products in another order: the same item then gets other bytes alone than in
a full batch (H200, torch 2.11: rows of a 3456->1280 product differed at 1 to 64 rows of 32768;
`tools/invariance_probe.py gemm`). Those partial sums live in cuBLAS's workspace: with none (cuBLAS and
cuBLASLt alike) each output element is one sequential sum over K whatever the tile shape, and every row
count from 1 to 16384 gave the same rows of 32768, in bf16 and fp16, with and without bias and with the
GELU epilogue; float32 from 24 rows up (the eager forwards' rows are padded to at least 32 units;
models/metadata.py). Without a workspace cuBLASLt also takes its statically scheduled kernels, which need
no memset of a tile counter before each product and ran 1-4 us quicker at 6272 rows (H200, torch 2.11;
`tools/workspace_probe.py`). CPU products need nothing beyond that padding.

The price is host time in eager forwards: torch 2.11 parses CUBLAS_WORKSPACE_CONFIG (with a std::regex) every time
it hands out a cuBLAS handle, whatever its value, so each product's call takes 50-190 us instead of 15 (H200 host);
a graph's replay makes no such call.
"""

from __future__ import annotations

import os

import torch

NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
_USER_SETTINGS = {key: os.environ.get(key) for key in NO_WORKSPACE}  # what "off" goes back to


def batch_invariant_products(device: torch.device, enabled: bool = True) -> None:
    """Make this process's CUDA matrix products batch-invariant (or restore torch's defaults).

    Call it before capturing graphs: torch reads the workspace sizes when it makes a stream's workspace, so a
    change drops the workspaces made so far (the next product makes them anew), and a graph captured before
    the change would still point into the memory they held."""
    if device.type != "cuda":
        return
    matmul = torch.backends.cuda.matmul
    if enabled and torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt:
        # torch 2.11's cuBLASLt refuses bias-less products without a workspace; cuBLAS takes them
        torch.backends.cuda.preferred_blas_library("default")
    matmul.allow_bf16_reduced_precision_reduction = not enabled
    matmul.allow_fp16_reduced_precision_reduction = not enabled
    wanted = NO_WORKSPACE if enabled else _USER_SETTINGS
    if all(os.environ.get(key) == value for key, value in wanted.items()):
        return
    for key, value in wanted.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if torch.cuda.is_initialized():
        torch._C._cuda_clearCublasWorkspaces()
