"""`vitserve serve` refuses what it can know wrong before binding its port: one line on stderr, exit
code 2 (settings, device, storage, port) or 3 (the model), and the port never bound."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.http.server import main
from service.preflight import EXIT_MODEL, EXIT_SETTINGS, StartupError, bind
from tests.checkpoints import write_checkpoint
from tests.http_helpers import ROOT, free_port


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_a_missing_model_exits_3_with_one_line_and_never_binds():
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--model", "/nonexistent",
                             "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while proc.poll() is None:  # watch the port the whole time the process lives
        assert port_is_free(port), "the server bound its port"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == EXIT_MODEL == 3
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("vitserve serve: --model: /nonexistent: not a preset name")
    assert port_is_free(port)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint("tiny-qwen2-vl", folder)
    return folder


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def run(capsys, *flags: str) -> tuple[int, str]:
    port = free_port()
    code = main(["--device", "cpu", "--port", str(port), *flags])
    captured = capsys.readouterr()
    assert port_is_free(port)
    return code, captured.err


def test_a_good_checkpoint_passes_without_reading_weights(checkpoint):
    from models.loader import check_model

    assert check_model(str(checkpoint)) == "qwen2_vl"
    assert check_model("tiny-qwen3-vl") == "qwen3_vl"


def test_model_problems_exit_3(tmp_path, capsys, checkpoint):
    bad_json = copy_checkpoint(checkpoint, tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{not json")
    other_family = copy_checkpoint(checkpoint, tmp_path / "llama")
    (other_family / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_weights = copy_checkpoint(checkpoint, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    no_pre = copy_checkpoint(checkpoint, tmp_path / "no-preprocessor")
    (no_pre / "preprocessor_config.json").unlink()
    misshaped = copy_checkpoint(checkpoint, tmp_path / "misshaped")
    state = load_file(str(misshaped / "model.safetensors"))
    key = next(k for k in state if k.endswith("merger.mlp.0.bias"))
    state[key] = torch.zeros(7)
    save_file(state, str(misshaped / "model.safetensors"), metadata={"format": "pt"})
    cases = {
        bad_json: "config.json cannot be read",
        other_family: "unsupported model_type 'llama'",
        no_weights: "no safetensors weights",
        no_pre: "preprocessor_config.json is missing",
        misshaped: "mis-shaped 1: merger.mlp.0.bias",
        tmp_path / "nowhere": "not a preset name",
    }
    for folder, reason in cases.items():
        code, err = run(capsys, "--model", str(folder))
        assert code == EXIT_MODEL, (folder, err)
        assert len(err.strip().splitlines()) == 1 and reason in err, err


def test_settings_problems_exit_2(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, err = run(capsys, "--model", "tiny-qwen2-vl", "--ec-shared-storage", str(a_file / "cache"))
    assert code == EXIT_SETTINGS and "--ec-shared-storage" in err and len(err.strip().splitlines()) == 1
    code, err = run(capsys, "--model", "tiny-qwen2-vl", "--max-header-bytes", "10")
    assert code == EXIT_SETTINGS and "--max-header-bytes" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["--model", "tiny-qwen2-vl", "--device", "cpu", "--port", str(port)])
        err = capsys.readouterr().err
    assert code == EXIT_SETTINGS and f"cannot listen on 127.0.0.1:{port}" in err, err
    if not torch.cuda.is_available():
        code, err = run(capsys, "--model", "tiny-qwen2-vl", "--device", "cuda")
        assert code == EXIT_SETTINGS and "CUDA is not available" in err
    code, err = run(capsys, "--model", "tiny-qwen2-vl", "--device", "tpu")
    assert code == EXIT_SETTINGS and "--device 'tpu'" in err


def test_fronts_listen_on_one_port_each_through_its_own_socket():
    sockets = bind("127.0.0.1", 0, count=3)
    try:
        port = sockets[0].getsockname()[1]
        assert [s.getsockname()[1] for s in sockets] == [port] * 3
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in sockets)
        for s in sockets:
            s.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # the kernel hands it to one of them
            pass
        # a second server on the port is refused, sharing or not
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind("127.0.0.1", port, count=2)
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind("127.0.0.1", port)
    finally:
        for s in sockets:
            s.close()


def test_a_lone_front_listens_without_sharing_its_port():
    [sock] = bind("127.0.0.1", 0)
    with sock:
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)


def test_loading_a_tower_leaves_torch_dynamo_unimported():
    """A tower is built on the meta device, where torch runs some kernels (arange, normal_) as Python
    references whose first call imports torch._dynamo: 1.5 s of every start on 2 cores. Rotary frequencies
    and position tables are made without them, for every family."""
    probe = ("import sys\nfrom models.loader import load_tower\nfrom models.presets import PRESETS\n"
             "for name in PRESETS:\n    if name.startswith('tiny-'):\n"
             "        load_tower(name, device='cpu', dtype='float32')\n"
             "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "False"
