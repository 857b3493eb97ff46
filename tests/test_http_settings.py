"""`vitserve serve` flags, VITSERVE_* variables and the settings model; the HTTP layer's media parsing."""

from __future__ import annotations

import argparse
import base64
import os

import pytest

from service.cli import add_serve_parser
from service.http.errors import ApiError
from service.http.parsing import decode_media
from service.http.server import main, settings_from_args
from service.media.sniff import sniff_modality
from service.settings import FLAGS, ServeSettings, SettingsError
from tests.http_helpers import image_bytes
from tests.videos import make_video

# The flags the issue and the deployment chart rely on (tests/test_deploy.py keeps the same list).
REQUIRED_FLAGS = [
    "model", "host", "port", "device", "dtype", "served-model-name", "max-batch-tokens", "budgets", "t-capture",
    "max-wait-ms", "max-queued-tokens", "max-concurrent-requests", "max-payload-bytes", "request-timeout-s",
    "api-key", "log-level", "eager", "max-batch-items", "max-items-per-request", "preprocess-workers", "allow-url",
    "allowed-hosts", "ec-shared-storage", "video-chunking", "data-parallel",
]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    return parser.parse_args(["serve", *argv])


def test_every_flag_exists_and_maps_to_a_setting_and_variable():
    flags = {f.removeprefix("--") for f, _ in FLAGS}
    assert set(REQUIRED_FLAGS) <= flags
    for flag in flags:
        field = flag.replace("-", "_")
        assert field in ServeSettings.model_fields, flag
        assert ServeSettings.env_name(field) == "VITSERVE_" + flag.upper().replace("-", "_")
    args = parse([])
    assert args.func.__name__ == "serve_from_args"  # the server, loaded when it runs


def test_flag_beats_variable_beats_default(monkeypatch):
    monkeypatch.setenv("VITSERVE_MAX_BATCH_TOKENS", "4096")
    monkeypatch.setenv("VITSERVE_PORT", "9000")
    monkeypatch.setenv("VITSERVE_EAGER", "true")
    monkeypatch.setenv("VITSERVE_ALLOW_URL", "1")
    monkeypatch.setenv("VITSERVE_ALLOWED_HOSTS", "img.example.com, *.cdn.example.com")
    monkeypatch.setenv("VITSERVE_BUDGETS", "1024,2048,4096")
    monkeypatch.setenv("VITSERVE_MAX_WAIT_MS", "2.5")
    monkeypatch.setenv("VITSERVE_API_KEY", "zq-secret-9")
    s = settings_from_args(parse(["--port", "8100", "--no-eager", "--model", "tiny-qwen3-vl"]))
    assert (s.port, s.eager, s.max_batch_tokens) == (8100, False, 4096)
    assert (s.model, s.model_defaulted) == ("tiny-qwen3-vl", False)
    assert s.allow_url and s.allowed_hosts == ["img.example.com", "*.cdn.example.com"]
    assert s.budgets == [1024, 2048, 4096] and s.max_wait_ms == 2.5
    assert s.api_key_bytes() == b"zq-secret-9" and "zq-secret-9" not in str(s.public_dict())
    defaults = ServeSettings.from_sources({}, env={})
    assert defaults.model == "tiny-qwen2-vl" and defaults.model_defaulted
    assert defaults.max_payload_bytes == 64 * 2**20 and defaults.max_items_per_request == 64
    assert defaults.max_wait_ms == 2 and defaults.queue_tokens_limit == 8 * defaults.max_batch_tokens
    assert ServeSettings.from_sources({}, env={"VITSERVE_BUDGETS": "auto"}).budgets is None
    assert ServeSettings.from_sources({}, env={"VITSERVE_VIDEO_CHUNKING": "off"}).video_chunking is False
    assert ServeSettings.from_sources({}, env={"VITSERVE_VIDEO_CHUNKING": "on"}).video_chunking is True


@pytest.mark.parametrize("env,message", [
    ({"VITSERVE_DATA_PARALLEL": "0"}, "--data-parallel takes a number of engines"),
    ({"VITSERVE_VIDEO_CHUNKING": "auto"}, "takes on or off"),
    ({"VITSERVE_ALLOW_URL": "true"}, "--allow-url needs --allowed-hosts"),
    ({"VITSERVE_PORT": "eighty"}, "VITSERVE_PORT"),
    ({"VITSERVE_EAGER": "maybe"}, "VITSERVE_EAGER"),
    ({"VITSERVE_DTYPE": "int8"}, "VITSERVE_DTYPE"),
    ({"VITSERVE_MAX_PAYLOAD_BYTES": "-1"}, "VITSERVE_MAX_PAYLOAD_BYTES"),
])
def test_bad_settings_say_what_to_fix(env, message):
    with pytest.raises(SettingsError, match=message):
        ServeSettings.from_sources({}, env=env)


def test_cli_refuses_bad_settings_with_exit_2(capsys, monkeypatch):
    for key in [k for k in os.environ if k.startswith("VITSERVE_")]:
        monkeypatch.delenv(key)
    assert main(["--data-parallel", "0"]) == 2
    assert "--data-parallel" in capsys.readouterr().err
    assert main(["--max-batch-items", "5000", "--max-batch-tokens", "1024"]) == 2
    assert "--max-batch-items" in capsys.readouterr().err
    assert main(["--budgets", "0,64"]) == 2
    assert "--budgets" in capsys.readouterr().err
    assert main(["--budget-steps", "0"]) == 2
    assert "--budget-steps" in capsys.readouterr().err
    assert main(["--device", "cpu", "--data-parallel", "auto", "--fronts", "3"]) == 2  # auto: one CPU engine
    assert "--fronts 3 with 1 engine(s)" in capsys.readouterr().err


def test_vitserve_cli_has_the_serve_subcommand(capsys, monkeypatch):
    cli = pytest.importorskip("service.cli")
    monkeypatch.delenv("VITSERVE_DATA_PARALLEL", raising=False)
    assert cli.main(["serve", "--data-parallel", "none"]) == 2
    assert "takes a number of engines (1 or more) or auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert all(f"--{flag}" in out for flag in REQUIRED_FLAGS)


def test_media_fields():
    png = image_bytes(8, 8)
    text = base64.b64encode(png).decode()
    assert decode_media(text, 0, "image", False) == (png, None)
    assert decode_media("data:image/png;base64," + text, 0, "image", False) == (png, None)
    assert decode_media(text.rstrip("="), 0, "image", False) == (png, None)  # missing padding
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))  # MIME line breaks
    assert decode_media(wrapped, 0, "image", False) == (png, None)
    urlsafe = base64.urlsafe_b64encode(png).decode()
    assert decode_media(urlsafe, 0, "image", False) == (png, None)
    assert decode_media("https://img.example.com/a.png", 3, "image", True) == (None, "https://img.example.com/a.png")
    for value, code in [
        ("https://img.example.com/a.png", "url_not_allowed"),  # URLs disabled
        ("file:///etc/passwd", "url_not_allowed"),
        ("ftp://host/a.png", "url_not_allowed"),
        ("data:image/png,rawbytes", "invalid_data_url"),
        ("data:video/mp4;base64," + text, "type_mismatch"),
        ("not base64 at all!", "invalid_base64"),
        ("", "empty"),
    ]:
        with pytest.raises(ApiError) as err:
            decode_media(value, 2, "image", False)
        assert (err.value.status, err.value.code, err.value.index) == (422, code, 2), value


def test_sniffing_multipart_files():
    assert sniff_modality(image_bytes(8, 8, fmt="JPEG")) == "image"
    assert sniff_modality(image_bytes(8, 8, fmt="WEBP")) == "image"
    assert sniff_modality(make_video(2, width=32, height=32)) == "video"
    assert sniff_modality(make_video(2, width=32, height=32, container="matroska")) == "video"
    assert sniff_modality(b"\x00\x00\x00\x18ftypheic" + b"\x00" * 16) == "image"  # HEIC: refused as an image
    assert sniff_modality(b"%PDF-1.7 ...") == "image"  # unknown: the image decoder names it in the error


def test_fastapi_telemetry_is_off_unless_opentelemetry_is_configured(monkeypatch):
    import inspect

    from fastapi import FastAPI

    from service.http.app import telemetry_options

    for key in [k for k in os.environ if k.startswith(("OTEL_", "FASTAPI_OTEL_"))]:
        monkeypatch.delenv(key)
    supported = "telemetry" in inspect.signature(FastAPI.__init__).parameters
    off = {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    assert telemetry_options() == (off if supported else {})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert telemetry_options() == {}


def test_every_flag_comes_from_the_settings_and_names_its_true_default():
    """One definition: the flags are the settings' fields; each help text names the default the field has."""
    fields = ServeSettings.flag_fields()
    assert [f.removeprefix("--").replace("-", "_") for f, _ in FLAGS] == fields
    for name in fields:
        field = ServeSettings.model_fields[name]
        help_text = field.description or ""
        assert "default" in help_text, name
        default = field.default
        if isinstance(default, bool):
            assert ("default off" in help_text) == (default is False), name
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            shown = [f"{default:g}" if isinstance(default, float) else str(default)]
            for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
                if isinstance(default, int) and default and default % size == 0:
                    shown.append(f"{default // size} {unit}")
            assert any(f"default {x}" in help_text for x in shown), (name, help_text)
        elif isinstance(default, str):
            assert default in help_text, (name, help_text)
