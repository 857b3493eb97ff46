"""The `vitserve` command: `serve` (HTTP server), `encode` (offline batch encoding), `bench`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from models.presets import DEFAULT_MODEL, PRESETS

# `vitserve bench --cache` with no value: the hit-against-miss benchmark (service/bench/cache.py).
CACHE_COMPARE = "compare"

log = logging.getLogger("vitserve")


def load_media(path: Path, cfg):
    """A local file the user named -> VisualInput, routed by its first bytes like the server's uploads."""
    from service.media.image_preprocess import preprocess_image_bytes
    from service.media.sniff import sniff_modality
    from service.media.video_preprocess import preprocess_video_bytes

    data = path.read_bytes()
    if sniff_modality(data) == "image":
        return preprocess_image_bytes(data, cfg)
    return preprocess_video_bytes(data, cfg)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default; required options and switches say so instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return text + " (required)"
        if action.nargs == 0 and action.default is False:  # a switch
            return text + " (default: off)"
        return super()._get_help_string(action) or ""

    def _split_lines(self, text: str, width: int) -> list[str]:
        # preset and flag names hold hyphens: a line break inside one makes it unusable when copied
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """The `serve` subcommand; the server's modules load only when it runs (`vitserve --help` stays quick)."""
    from service.settings import add_serve_arguments

    p = sub.add_parser("serve", help="run the HTTP server",
                       description="Serve POST /encode. Every flag can also be set with "
                                   "VITSERVE_<FLAG_IN_UPPER_SNAKE>; the flag wins.")
    add_serve_arguments(p)
    p.set_defaults(func=serve_from_args)
    return p


def serve_from_args(args: argparse.Namespace) -> int:
    """`vitserve serve`: the server (service/http/server.py), imported now."""
    from service.http.server import run_from_args

    return run_from_args(args)


def add_encode_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("encode", help="encode local images/videos into a safetensors file",
                       formatter_class=DefaultsHelpFormatter,
                       description="Offline batch encoding through the same graph pool the server uses. Writes "
                                   "embeds.<i>, grid_thw.<i> (and deepstack.<i>.<j>) per input, in order; the "
                                   "file's metadata describes the inputs by file name, with the timing of videos. "
                                   "Exit codes: 2 for a bad option or input, 3 for a model that cannot be loaded.")
    p.add_argument("inputs", nargs="+", type=Path, metavar="FILE", help="images and videos, sniffed from their bytes")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"checkpoint folder or preset ({', '.join(PRESETS)})")
    p.add_argument("--output", "-o", type=Path, default=None,
                   help="safetensors file to write (its folder must exist; an existing file is replaced), or - for "
                        "stdout. Without it: stdout when stdout is a pipe or a file, else FIRST_INPUT_STEM.safetensors "
                        "next to the first input")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | "
                                                   "float16 | float32")
    p.add_argument("--output-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written tensors")
    # the backends of models.attention.BACKENDS (not imported here: that pulls in torch)
    p.add_argument("--attention", default="auto", choices=["auto", "varlen", "cudnn", "sdpa"],
                   help="attention backend (auto: cuDNN when it passes its load-time check, else varlen_attn, "
                        "on CUDA; SDPA per segment on the CPU)")
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: the tower's linear layers as FP8 products, its first blocks unquantized as far as the "
                        "agreement bar with its float32 self asks; refused (exit 3) past half")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="token budget of the largest batch/graph")
    p.add_argument("--t-capture", type=int, default=8, help="temporal patches per video slot in the graphs")
    p.add_argument("--eager", action="store_true", help="bypass the graph pool")
    p.add_argument("--stats", action="store_true", help="print the pool statistics as one JSON line at the end")
    p.add_argument("--workers", type=int, default=4, help="decode/preprocess threads")
    p.set_defaults(func=run_encode)
    return p


def output_target(output: Path | None, first_input: Path) -> Path | None:
    """Where `encode` writes: a file, or None for stdout (`-o -`, or no -o with stdout redirected)."""
    if output is not None:
        return None if str(output) == "-" else output
    if not sys.stdout.isatty():
        return None
    return first_input.with_suffix(".safetensors")


def write_output(data: bytes, path: Path | None) -> None:
    """The file appears whole or not at all (a temporary name, then renamed), with the mode a new file gets
    under the umask (0644 under the usual 022), not the 0600 safetensors' own writer gives it."""
    if path is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def input_entry(index: int, path: Path, item, geometry) -> dict:
    """The output file's description of one input: its file name (never the local path) and, for videos,
    the timing fields the server's responses carry."""
    entry = {"index": index, "type": item.modality, "file": path.name, "grid_thw": list(item.grid_thw),
             "num_tokens": geometry.tokens(item.grid_thw, item.modality)}
    if item.modality == "video":
        from service.http.encoders import VIDEO_FIELDS

        entry.update({k: item.meta[k] for k in VIDEO_FIELDS if item.meta.get(k) is not None})
    return entry



def run_encode(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save

    from graphs.budgets import BudgetError
    from graphs.precision import QuantizationRefused, quantize_with_gate
    from graphs.runner import GraphRunner, plan_for
    from models import CheckpointError, load_tower
    from service.media.errors import MediaError
    from service.preflight import EXIT_MODEL, EXIT_SETTINGS

    missing = [str(p) for p in args.inputs if not p.is_file()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return EXIT_SETTINGS
    target = output_target(args.output, args.inputs[0])
    if target is not None and not target.parent.is_dir():
        print(f"error: --output {target}: the folder {target.parent} does not exist", file=sys.stderr)
        return EXIT_SETTINGS
    try:
        tower = load_tower(args.model, device=args.device, dtype=args.dtype, attention=args.attention)
        if args.quantization == "fp8":
            from models.families import FAMILIES

            tower.quantization = quantize_with_gate(tower, tower.device, FAMILIES[tower.family].video)
        plan = plan_for(tower, max_batch_tokens=args.max_batch_tokens, t_capture=args.t_capture)
    except CheckpointError as exc:  # the model, as `vitserve serve` exits for it
        print(f"error: --model: {exc}", file=sys.stderr)
        return EXIT_MODEL
    except QuantizationRefused as exc:
        print(f"error: --quantization fp8: {exc}", file=sys.stderr)
        return EXIT_MODEL
    except (BudgetError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SETTINGS

    def prepare(path: Path):
        try:
            return load_media(path, tower.processor)
        except MediaError as exc:
            return exc
        except OSError as exc:
            return MediaError(reason=f"cannot read: {exc.strerror or exc}", code="unreadable")

    with ThreadPoolExecutor(max(1, args.workers)) as pool:
        items = list(pool.map(prepare, args.inputs))
    bad = [(p, e) for p, e in zip(args.inputs, items) if isinstance(e, Exception)]
    for path, exc in bad:
        print(f"error: {path}: {exc.reason} [{exc.code}]", file=sys.stderr)
    if bad:
        return EXIT_SETTINGS

    device = next(tower.parameters()).device
    runner = GraphRunner(tower, device, plan, use_graphs=not args.eager)
    runner.capture()
    out_dtype = getattr(torch, args.output_dtype)
    tensors: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    progress = _progress(len(items))
    for batch in runner.pack_items(items):
        outs = runner.run_batch(batch, [items[i] for i in batch.items])
        for i, out in zip(batch.items, outs):
            tensors[f"embeds.{i}"] = out.embeds.to(out_dtype).cpu().contiguous()
            tensors[f"grid_thw.{i}"] = torch.tensor([items[i].grid_thw], dtype=torch.int64)
            for j, feat in enumerate(out.deepstack):
                tensors[f"deepstack.{i}.{j}"] = feat.to(out_dtype).cpu().contiguous()
        progress(len(batch.items))
    elapsed = time.perf_counter() - start
    model = args.model if args.model in PRESETS else Path(args.model).name  # a folder: its name, not its path
    inputs = [input_entry(i, path, item, tower.geometry) for i, (path, item) in enumerate(zip(args.inputs, items))]
    metadata = {"model": model, "family": tower.family, "dtype": args.output_dtype,
                "inputs": json.dumps(inputs, separators=(",", ":"))}
    write_output(save(tensors, metadata=metadata), target)
    # The file goes to stdout: the report goes to stderr.
    report = sys.stdout if target is not None else sys.stderr
    for i, (path, item) in enumerate(zip(args.inputs, items)):
        tokens = tower.geometry.tokens(item.grid_thw, item.modality)
        print(f"{i}\t{path}\t{item.modality}\tgrid_thw={list(item.grid_thw)}\t"
              f"tokens={tokens}\tshape={list(tensors[f'embeds.{i}'].shape)}", file=report)
    print(f"wrote {target if target is not None else 'stdout'}: {len(items)} inputs in {elapsed:.2f}s",
          file=sys.stderr)
    if args.stats:
        print(json.dumps({**runner.stats.as_dict(),
                          "quantization": getattr(tower, "quantization", None) or {"mode": "none"}}), file=report)
    return 0


def _progress(total: int):
    """A stderr progress bar for long runs (tqdm when present), silent for a handful of inputs."""
    if total < 16 or not sys.stderr.isatty():
        return lambda n: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda n: None
    bar = tqdm(total=total, unit="item", file=sys.stderr)
    return bar.update


def add_bench_parser(sub) -> argparse.ArgumentParser:
    from models.presets import BENCH_FAMILY_MODELS, BENCH_MODELS

    p = sub.add_parser("bench", help="engine vs transformers side by side on one GPU",
                       description="Graphs on, graphs off and transformers eager on the same inputs, "
                                   "with the floor and MFU; writes bench.json and bench.png.")
    p.add_argument("--models", default=",".join(BENCH_MODELS),
                   help=f"comma list of presets; also {', '.join(BENCH_FAMILY_MODELS)}")
    p.add_argument("--workloads", default="", help="comma list (default: all)")
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: each model's FP8 rows (MODEL+fp8) after its bf16 ones; with --http, pass it in "
                        "--serve-flags")
    p.add_argument("--accuracy", action="store_true",
                   help="instead of timing: FP8 and bf16 against float32 for each model's items (cosine, relative "
                        "error, DeepStack; the gate's choice of bf16 blocks); writes OUT/accuracy.jsonl")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    # HTTP load benchmark (service/bench/http.py); runs on a CPU machine too.
    p.add_argument("--http", action="store_true", help="load-test `vitserve serve` over HTTP on loopback against "
                                                       "the engine alone; writes OUT/http_bench.json")
    p.add_argument("--url", default=None, help="with --http: an already running server on a loopback address")
    p.add_argument("--model", default=None, help="with --http or --cache: model to serve (default "
                                                 "random:qwen2.5-vl-7b on a GPU, tiny-qwen2-vl on the CPU)")
    p.add_argument("--concurrency", default=None, help="with --http: comma list (default 1,2,4,...,256)")
    p.add_argument("--requests-per-level", type=int, default=None, help="with --http: requests per level (1024)")
    p.add_argument("--level-time-s", type=float, default=None, help="with --http: time limit per level (30)")
    p.add_argument("--serve-flags", default=None, help="with --http or --cache: more `vitserve serve` flags, one "
                                                       "string")
    # Encoder-output cache hit against miss (service/bench/cache.py); runs on a CPU machine too.
    p.add_argument("--cache", nargs="?", const=CACHE_COMPARE, default=None, metavar="misses,hits",
                   help="alone: time an encoder-output cache hit against a miss in `vitserve serve` (server-side, "
                        "one request at a time; writes OUT/cache_bench.json). With --http: misses (every request a "
                        "new image) and/or hits (a few images again), comma list (default misses)")
    p.add_argument("--cache-images", type=int, default=8, help="with --cache: distinct 448x448 JPEGs (default 8)")
    p.add_argument("--encoding-format", default="base64", choices=["float", "base64", "vllm", "vllm_ref"],
                   help="with --cache: the answers' format (default base64; vllm_ref adds a shared folder)")
    p.add_argument("--format", default=None,
                   help="with --http: answer format(s), comma list of base64 and vllm_ref (default base64); "
                        "vllm_ref also times the LLM server's fetch of an output (GET /v1/encoder_cache/{id}); "
                        "several formats or caches are measured in one run")
    p.add_argument("--client-processes", type=int, default=1,
                   help="with --http: client processes sharing each level's connections (default 1; one process "
                        "of Python client threads tops out near 500 images/s of 448x448 bf16 answers)")
    p.set_defaults(func=run_bench)
    return p


def run_bench(args: argparse.Namespace) -> int:
    if args.http and args.cache == CACHE_COMPARE:
        print("error: --cache alone and --http are two benchmarks: run them one at a time (with --http, --cache "
              "takes misses and/or hits)", file=sys.stderr)
        return 2
    if args.cache and not args.http:
        from service.bench.cache import run_from_args as run_cache

        return run_cache(args)
    if args.http:
        from service.bench.http import run_from_args

        return run_from_args(args)
    import torch

    from service.bench.towers import run

    if not torch.cuda.is_available():
        print("error: vitserve bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.accuracy:
        from service.bench.accuracy import run as run_accuracy

        args.out.mkdir(parents=True, exist_ok=True)
        run_accuracy(args.models.split(","), args.out / "accuracy.jsonl")
        return 0
    run(args.models.split(","), args.out, args.max_batch_tokens,
        args.workloads.split(",") if args.workloads else None, args.quantization)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vitserve", description="Vision-encoding inference server for Qwen-VL",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--log-level", default="warning", help="logging level for encode and bench")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"serve": add_serve_parser(sub), "encode": add_encode_parser(sub), "bench": add_bench_parser(sub)}
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's: that is where the flag was looked for
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command != "serve":
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
