"""`vitserve encode` end to end: real files, the same graph path as the server, errors without tracebacks."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from models import load_tower
from service.bench.http import print_summary, targets
from service.cli import add_encode_parser, output_target
from service.media.image_preprocess import preprocess_image_bytes
from service.media.video_preprocess import preprocess_video_bytes

SAMPLE = Path(__file__).resolve().parents[1] / "service" / "assets" / "sample.jpg"
VIDEO = SAMPLE.with_name("sample.mp4")


def vitserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=300)


def test_encode_writes_embeddings_equal_to_the_tower(tmp_path):
    png = tmp_path / "small.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (90, 130, 4), dtype=np.uint8), "RGBA").save(png)
    out = tmp_path / "out.safetensors"
    done = vitserve("encode", "--model", "tiny-qwen3-vl", "--stats", "-o", str(out), str(SAMPLE), str(png),
                    str(VIDEO))
    assert done.returncode == 0, done.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file (safetensors' own writer gives 0600)
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith(f"0\t{SAMPLE}\timage\tgrid_thw=") and lines[1].startswith(f"1\t{png}")
    assert lines[2].startswith(f"2\t{VIDEO}\tvideo")
    stats = json.loads(lines[-1])
    # The same fixed-shape path as the graphs; on the CPU no CUDA graph is captured.
    assert stats["graph_items"] == 3 and stats["graph_keys"] > 0
    assert stats["captured_graphs"] == (stats["graph_keys"] if torch.cuda.is_available() else 0)
    tower = load_tower("tiny-qwen3-vl", device="cpu")
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        inputs = json.loads(meta["inputs"])
        assert meta["model"] == "tiny-qwen3-vl" and [e["file"] for e in inputs] == ["sample.jpg", "small.png",
                                                                                    "sample.mp4"]
        assert str(tmp_path) not in json.dumps(meta) and str(SAMPLE.parent) not in json.dumps(meta)  # names only
        # A video carries the timing fields of the server's responses (what M-RoPE and vLLM need).
        video = preprocess_video_bytes(VIDEO.read_bytes(), tower.processor)
        assert inputs[2]["type"] == "video" and inputs[2]["grid_thw"] == list(video.grid_thw)
        assert inputs[2]["timestamps"] == video.meta["timestamps"]
        assert inputs[2]["second_per_grid_ts"] == video.meta["second_per_grid_ts"]
        assert "timestamps" not in inputs[0] and inputs[0]["num_tokens"] == f.get_tensor("embeds.0").shape[0]
        for i, path in enumerate([SAMPLE, png]):
            item = preprocess_image_bytes(path.read_bytes(), tower.processor)
            cap = tower.required_capacity([item.grid_thw])
            metadata = {k: torch.from_numpy(v) for k, v in tower.build_metadata([item.grid_thw], cap).items()}
            with torch.no_grad():
                ref = tower(torch.from_numpy(item.pixels), metadata, cap)
            assert f.get_tensor(f"grid_thw.{i}").tolist() == [list(item.grid_thw)]
            assert torch.allclose(f.get_tensor(f"embeds.{i}"), ref.embeds, rtol=1e-4, atol=1e-5)
            assert torch.allclose(f.get_tensor(f"deepstack.{i}.1"), ref.deepstack[1], rtol=1e-4, atol=1e-5)


def test_encode_reports_bad_inputs_by_name_without_traceback(tmp_path):
    truncated = tmp_path / "cut.jpg"
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buf, "JPEG")
    truncated.write_bytes(buf.getvalue()[:100])
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    done = vitserve("encode", "-o", str(tmp_path / "o.safetensors"), str(truncated), str(text),
                    str(tmp_path / "missing.png"))
    assert done.returncode == 2
    assert "missing.png" in done.stderr and "Traceback" not in done.stderr
    done = vitserve("encode", "-o", str(tmp_path / "o.safetensors"), str(truncated), str(text))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{truncated}:" in done.stderr and f"{text}:" in done.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_unknown_model_exits_3_as_serve_does(tmp_path):
    done = vitserve("encode", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "o.st"), str(SAMPLE))
    assert done.returncode == 3 and "not a preset name" in done.stderr and "Traceback" not in done.stderr


def test_the_output_goes_to_a_pipe_or_next_to_the_first_input(tmp_path, monkeypatch):
    # No -o, stdout a pipe (as here): the file itself on stdout, the report on stderr.
    done = subprocess.run([sys.executable, "-m", "service.cli", "encode", str(SAMPLE)], capture_output=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    tensors = load_safetensors(done.stdout)
    assert set(tensors) == {"embeds.0", "grid_thw.0"} and b"wrote stdout" in done.stderr
    assert f"0\t{SAMPLE}\timage".encode() in done.stderr
    # On a terminal: FIRST_INPUT_STEM.safetensors next to the first input; `-o -` is stdout anywhere.
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert output_target(None, tmp_path / "clip.mp4") == tmp_path / "clip.safetensors"
    assert output_target(Path("-"), tmp_path / "clip.mp4") is None
    assert output_target(tmp_path / "x.st", tmp_path / "clip.mp4") == tmp_path / "x.st"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert output_target(None, tmp_path / "clip.mp4") is None


def test_a_missing_output_folder_is_an_error_not_created(tmp_path):
    out = tmp_path / "no" / "such" / "out.safetensors"
    done = vitserve("encode", "-o", str(out), str(SAMPLE))
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "no").exists()


def test_the_output_mode_follows_the_umask(tmp_path):
    out = tmp_path / "o.safetensors"
    done = subprocess.run([sys.executable, "-m", "service.cli", "encode", "-o", str(out), str(SAMPLE)],
                          capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o027))
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["o.safetensors"]  # no temporary file left


def test_an_unknown_flag_shows_the_subcommands_usage():
    done = vitserve("encode", "--frobnicate", str(SAMPLE))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "usage: vitserve encode" in done.stderr and "unrecognized arguments: --frobnicate" in done.stderr
    done = vitserve("serve", "--frobnicate")
    assert done.returncode == 2 and "usage: vitserve serve" in done.stderr


def test_help_and_bad_flags_answer_without_loading_torch():
    """`vitserve --help`, a subcommand's help and a flag error read no model code: they took about 5 s on the
    dev box, importing torch through the model package and the server, and now take about 0.5 s."""
    probe = ("import sys\nfrom service.cli import main\n"
             "for argv in (['--help'], ['serve', '--help'], ['bench', '--help'], ['encode', '--frobnicate', 'x']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'graphs')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "--max-batch-tokens" in done.stdout and "random:qwen3.5-27b" in done.stdout


def test_the_http_bench_summary_on_the_cpu_prints_no_none_and_no_verdict(capsys):
    """A CPU server's figures check the plumbing: the GPU targets are not judged, missing figures left out."""
    level = {"concurrency": 1, "requests": 6, "images_per_s": 3.1, "steady_images_per_s": None, "p50_ms": 310.0,
             "p90_ms": None, "p99_ms": None, "errors": {}, "stopped_by": "requests", "elapsed_s": 1.9}
    engine = {"images_per_s": 4.2, "batch_images": 2, "single_ms": 250.0}
    t = targets([level], engine, judged=False)
    assert t["throughput_ratio_met"] is None and t["latency_overhead_met"] is None
    print_summary({"levels": [level], "engine": engine, "targets": t})
    out = capsys.readouterr().out
    assert "None" not in out and "missed" not in out and "not judged" in out


def test_encode_help_gives_every_option_a_text_and_its_default():
    sub = argparse.ArgumentParser(prog="vitserve").add_subparsers()
    add_encode_parser(sub)
    encode = sub.choices["encode"]
    body = encode.format_help().split("\n\n", 2)[2]  # after the usage and the description
    entries = re.split(r"\n  (?=[-A-Z])|\n\n", body)
    for action in encode._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
        name = action.option_strings[0] if action.option_strings else action.metavar
        entry = " ".join(next(e for e in entries if e.lstrip().startswith(name)).split())
        expected = ("(required)" if action.required else "(default: off)" if action.nargs == 0
                    else f"(default: {action.default})")
        assert entry.endswith(expected), entry
