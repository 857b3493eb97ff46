"""Summarise a py-spy speedscope file: per thread, its samples and the frames that take them.

    python tools/speedscope_summary.py http_pyspy.json [--top 25] [--min-samples 200] > summary.txt

Use it on the profile `HTTP_PYSPY=1 tools/gpu_run.sh` writes (or any `py-spy record --format speedscope`).

For each thread with at least --min-samples samples: the top frames by self samples (where the thread
was) and by inclusive samples (what it was inside), as percentages of the thread's samples."""

from __future__ import annotations

import argparse
import json
from collections import Counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-samples", type=int, default=200)
    args = ap.parse_args()
    doc = json.load(open(args.path))
    frames = doc["shared"]["frames"]

    def label(i: int) -> str:
        f = frames[i]
        where = f.get("file", "").split("site-packages/")[-1].split("/work/main/")[-1]
        return f"{f['name']} ({where}:{f.get('line', '')})"

    for prof in sorted(doc["profiles"], key=lambda p: -len(p.get("samples", []))):
        samples = prof.get("samples", [])
        weights = [1] * len(samples)  # py-spy samples at one rate; its weights are that period in seconds
        total = len(samples)
        if total < args.min_samples:
            continue
        own: Counter[int] = Counter()
        inside: Counter[int] = Counter()
        for stack, w in zip(samples, weights):
            if stack:
                own[stack[-1]] += w
            for i in set(stack):
                inside[i] += w
        print(f"=== {prof.get('name')}: {total} samples")
        print("  self:")
        for i, n in own.most_common(args.top):
            print(f"    {100 * n / total:5.1f}%  {label(i)}")
        print("  inclusive:")
        for i, n in inside.most_common(args.top):
            print(f"    {100 * n / total:5.1f}%  {label(i)}")


if __name__ == "__main__":
    main()
