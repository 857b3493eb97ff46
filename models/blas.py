"""Matrix products whose every row comes out the same whatever the number of rows (CUDA).

cuBLAS picks a kernel by the problem's shape, and for few rows it splits the inner dimension (split-K,
stream-K) and sums partial products in another order: the same item then gets other bytes alone than in
a full batch (H200, torch 2.11: rows of a 3456->1280 product differed at 1 to 64 rows of 32768;
`tools/invariance_probe.py gemm`). Without split reductions each output element is one sequential sum
over K whatever the tile shape, and every row count gave the same rows, in bf16 and fp16, through
cuBLASLt with its reduction scheme restricted to none. float32 products have no such switch: with no
cuBLAS workspace they can split no more, and rows matched from 24 rows up (the eager forwards' rows are
padded to at least 32 units; models/metadata.py). CPU products need nothing beyond that padding.
"""

from __future__ import annotations

import os

import torch

NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def batch_invariant_products(device: torch.device, dtype: torch.dtype, enabled: bool = True) -> None:
    """Make this process's CUDA matrix products batch-invariant (or restore torch's defaults)."""
    if device.type != "cuda":
        return
    matmul = torch.backends.cuda.matmul
    if not enabled:
        torch.backends.cuda.preferred_blas_library("default")
        matmul.allow_bf16_reduced_precision_reduction = (True, True)
        matmul.allow_fp16_reduced_precision_reduction = (True, True)
        return
    if dtype == torch.float32:
        # Read by torch when cuBLAS first runs in the process: the tower's load is the first to run it.
        # (Not with every product sent to cuBLASLt: torch 2.11 then fails to allocate its empty workspace.)
        for key, value in NO_WORKSPACE.items():
            os.environ.setdefault(key, value)
        return
    # Split reductions can be refused only through cuBLASLt's preference; torch then sends every product there.
    torch.backends.cuda.preferred_blas_library("cublaslt")
    matmul.allow_bf16_reduced_precision_reduction = (False, False)
    matmul.allow_fp16_reduced_precision_reduction = (False, False)
