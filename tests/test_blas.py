"""models/blas.py's process setting: batch-invariant products take cuBLAS's workspaces away, and turning it off
gives back exactly what the user had set (the GPU side, that rows then match at every count, is
tools/invariance_probe.py gemm and tests/test_cuda_invariance.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, torch
from models.blas import NO_WORKSPACE, batch_invariant_products
def now():
    return {k: os.environ.get(k) for k in NO_WORKSPACE} | {
        "bf16_reduced": bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)}
steps = {"start": now()}
batch_invariant_products(torch.device("cpu"))
steps["cpu"] = now()
batch_invariant_products(torch.device("cuda"))
steps["on"] = now()
batch_invariant_products(torch.device("cuda"))
steps["on_again"] = now()
batch_invariant_products(torch.device("cuda"), enabled=False)
steps["off"] = now()
print(json.dumps(steps))
"""


def test_invariant_products_drop_the_workspaces_and_off_restores_the_users_setting() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")}
    env["CUBLASLT_WORKSPACE_SIZE"] = "512"  # the user's own; CUBLAS_WORKSPACE_CONFIG left unset
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    user = {"CUBLAS_WORKSPACE_CONFIG": None, "CUBLASLT_WORKSPACE_SIZE": "512"}
    assert {k: steps["start"][k] for k in user} == user
    assert steps["cpu"] == steps["start"]  # CPU products need nothing
    none = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0", "bf16_reduced": False}
    assert steps["on"] == steps["on_again"] == none
    assert steps["off"] == user | {"bf16_reduced": True}
