"""`vitserve encode` end to end: real files, the same graph path as the server, errors without tracebacks."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open

from models import load_tower
from service.cli import add_encode_parser
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


def test_unknown_model_is_a_clear_error(tmp_path):
    done = vitserve("encode", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "o.st"), str(SAMPLE))
    assert done.returncode == 2 and "not a preset name" in done.stderr and "Traceback" not in done.stderr


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
