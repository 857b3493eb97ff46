"""The flags reference in docs/api.md and docs/deployment.md against `vitserve serve --help`, and the
switches and lists behaving as the docs say."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from service import flags_doc
from service.cli import main
from service.http.server import settings_from_args
from service.settings import ServeSettings, SettingsError

ROOT = Path(__file__).resolve().parents[1]


def normalise(text: str) -> str:
    return " ".join(html.unescape(text.replace("\\|", "|")).split())


def help_text(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """`vitserve serve --help`, one line per flag (argparse would wrap `--allowed-hosts` at its hyphen)."""
    monkeypatch.setenv("COLUMNS", "10000")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    return normalise(capsys.readouterr().out)


@pytest.mark.parametrize("doc", flags_doc.DOCS, ids=lambda p: p.name)
def test_the_docs_flags_block_is_the_generated_one(doc: Path) -> None:
    assert flags_doc.current_block(doc.read_text()) == flags_doc.render(), (
        f"{doc.relative_to(ROOT)} differs from `vitserve serve --help`: run `python3 -m service.flags_doc`")


def test_the_docs_and_help_name_the_same_flags_with_the_same_words(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    shown = help_text(capsys, monkeypatch)
    block = flags_doc.current_block((ROOT / "docs" / "api.md").read_text())
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)`", block))
    in_help = set(re.findall(r"(--[a-z][a-z0-9-]*)", shown)) - {"--help"}
    assert documented == in_help
    for row in block.splitlines()[4:-2]:
        meaning = normalise(row.rsplit(" | ", 1)[1].removesuffix(" |"))
        assert meaning in shown, meaning
        assert "default" in meaning, f"the help of {row.split(' | ')[0]} does not name its default"
    settings_flags = {"--" + name.replace("_", "-") for name in ServeSettings.flag_fields()}
    assert settings_flags <= documented


def serve_args(argv: list[str]):
    import argparse

    from service.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("name", [n for n in ServeSettings.flag_fields()
                                  if ServeSettings.model_fields[n].annotation is bool])
def test_every_switch_takes_x_and_no_x(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    flag = "--" + name.replace("_", "-")
    monkeypatch.delenv(ServeSettings.env_name(name), raising=False)
    extra = ["--allowed-hosts", "example.com"]  # --allow-url needs it
    on = settings_from_args(serve_args([flag, *extra]))
    off = settings_from_args(serve_args(["--no-" + flag.removeprefix("--"), *extra]))
    assert getattr(on, name) is True and getattr(off, name) is False
    for value, expected in (("on", True), ("off", False), ("true", True), ("0", False)):
        monkeypatch.setenv(ServeSettings.env_name(name), value)
        assert getattr(settings_from_args(serve_args(extra)), name) is expected, value


def test_lists_take_commas_or_spaces() -> None:
    s = ServeSettings.from_sources({"budgets": "1024, 2048 4096", "allowed_hosts": "a.example.com b.example.com,c"},
                                   env={})
    assert s.budgets == [1024, 2048, 4096] and s.allowed_hosts == ["a.example.com", "b.example.com", "c"]


def test_the_readme_flags_exist(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    shown = help_text(capsys, monkeypatch)
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Flags"):readme.index("## Offline encoding")]
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", table))
    assert named and all(flag in shown for flag in named), sorted(f for f in named if f not in shown)


def test_budgets_auto_with_sizes_adds_them_to_the_automatic_ladder() -> None:
    from graphs.budgets import GraphKey, auto_budgets
    from graphs.packing import PackItem, pack
    from graphs.runner import plan_for
    from models import load_tower

    s = ServeSettings.from_sources({"budgets": "auto,196 1568"}, env={})
    assert s.budgets == sorted(set(auto_budgets(16384)) | {196, 1568})
    s = ServeSettings.from_sources({"max_batch_tokens": "2048"}, env={"VITSERVE_BUDGETS": "auto 196"})
    assert s.budgets == [64, 128, 196, 256, 512, 1024, 2048]
    with pytest.raises(SettingsError, match="4096 is over --max-batch-tokens 2048"):
        ServeSettings.from_sources({"budgets": "auto,4096", "max_batch_tokens": "2048"}, env={})
    # a 448x448 image (196 tokens) then replays in its own budget, not padded to 256
    tower = load_tower("tiny-qwen3-vl", device="cpu", dtype="float32")
    plan = plan_for(tower, s.max_batch_tokens, s.budgets)
    [batch] = pack([PackItem.of((1, 28, 28), "image", tower.geometry)], plan, None, set())
    assert batch.key == GraphKey("image", 196, batch.key.length_class)
