"""Which cuBLAS(Lt) kernels the tower's product shapes take under each workspace setting, whether a memset runs
before each, and what a product costs inside a CUDA graph (one fresh process per setting: torch reads the
workspace variables when cuBLAS first runs).

    python3 tools/workspace_probe.py OUT.jsonl

Found (H200, torch 2.11, docs/bench/cublaslt_workspace_h200.jsonl in git history, with the older setting of
models/blas.py that kept torch's workspace): from about 6000 rows every product of 1152 inputs takes a memset first,
with any workspace; without one cuBLASLt takes the statically scheduled ("ssched") variants, memset-free and 1.2-2.5
us quicker at 6272 rows. Sending every product to cuBLASLt with no workspace fails in torch 2.11 ("OOM trying to
allocate workspace for cublaslt"); models/blas.py now removes the workspaces and leaves bias-less products to
cuBLAS.
"""
import json
import os
import subprocess
import sys

CHILD = r'''
import json, statistics, sys, torch
sys.path.insert(0, ".")
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from models.blas import batch_invariant_products
inv = sys.argv[1] == "1"
batch_invariant_products(torch.device("cuda"), enabled=inv)
out = {}
for m, k, n in [(6272, 1152, 3456), (6272, 1152, 1152), (6272, 1152, 4304), (6272, 4304, 1152), (784, 1152, 3456),
                (784, 4304, 1152)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 30
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        F.linear(x, w, b)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            y = F.linear(x, w, b)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / 20)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay(); torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    out[f"{m}x{k}x{n}"] = {"us": round(statistics.median(ts), 2), "memsets": sum("emset" in x for x in names),
                          "kernel": sorted({x[:60] for x in names if "emset" not in x})}
print(json.dumps(out))
'''
rows = []
variants = [("invariant", "1", {}), ("default", "0", {}), ("default ws1k", "0", {"CUBLASLT_WORKSPACE_SIZE": "1"}),
            ("default nows", "0", {"CUBLAS_WORKSPACE_CONFIG": ":0:0"})]
for name, inv, env in variants:
    p = subprocess.run([sys.executable, "-c", CHILD, inv], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120)
    row = {"variant": name, "env": env}
    try:
        row.update(json.loads(p.stdout.strip().splitlines()[-1]))
    except Exception:
        row["error"] = p.stderr[-800:]
    print(json.dumps(row), flush=True)
    rows.append(row)
with open(sys.argv[1], "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
