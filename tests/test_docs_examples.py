"""The examples of docs/api.md and the README run as pasted from the repository root: every curl block
and Python block against a live server on loopback (its port put in place of localhost:8000), every
JSON block parses, and every server command line parses with `vitserve serve`'s own flags."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from service.cli import add_serve_parser
from tests.http_helpers import ROOT, ServerThread, settings

DOCS = [ROOT / "docs" / "api.md", ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w+)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


def blocks(path: Path, lang: str) -> list[str]:
    return [textwrap.dedent(m["body"]) for m in FENCE.finditer(path.read_text()) if m["lang"] == lang]


def client_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of the blocks that talk to a running server."""
    out = [("bash", b) for b in blocks(path, "bash") if b.lstrip().startswith("curl ")]
    return out + [("python", b) for b in blocks(path, "python") if "localhost:8000" in b]


EXAMPLES = [(path, lang, code) for path in DOCS for lang, code in client_blocks(path)]


@pytest.fixture(scope="module")
def server():
    with ServerThread(settings()) as srv:
        yield srv


def test_api_md_has_runnable_examples_of_each_kind():
    kinds = [lang for path, lang, _ in EXAMPLES if path.name == "api.md"]
    assert kinds.count("bash") >= 2 and kinds.count("python") >= 1


@pytest.mark.parametrize("path,lang,code", EXAMPLES,
                         ids=[f"{p.name}:{lang}:{i}" for i, (p, lang, _) in enumerate(EXAMPLES)])
def test_example_runs_against_a_live_server(server, path, lang, code):
    code = code.replace("localhost:8000", f"127.0.0.1:{server.port}")
    cmd = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and '"error"' not in done.stdout, done.stdout[:500]
    if "/encode" in code and lang == "bash":
        assert done.stdout.startswith('{"id":"enc-'), done.stdout[:200]  # an answer, cut short by head


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_json_blocks_parse(path):
    for body in blocks(path, "json"):
        json.loads(body)


def test_server_command_lines_use_real_flags():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    lines = [line for path in DOCS for b in blocks(path, "bash") for line in b.splitlines()]
    commands = [shlex.split(line, comments=True) for line in lines
                if line.startswith(("vitserve serve", "python -m service.http.server"))]
    assert len(commands) >= 3
    for words in commands:
        args = words[2:] if words[0] == "vitserve" else words[3:]
        parser.parse_args(["serve", *args])  # exits (fails the test) on an unknown flag


def test_every_metric_is_documented():
    """The metrics table of docs/api.md names every vitserve_* series the server exports."""
    from prometheus_client.parser import text_string_to_metric_families

    from service.metrics import Metrics

    families = list(text_string_to_metric_families(Metrics().render().decode()))
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families if f.name.startswith("vitserve_")}
    text = (ROOT / "docs" / "api.md").read_text()
    assert len(names) > 10 and {n for n in names if f"`{n}" not in text} == set()


def test_the_performance_page_cites_exactly_the_raw_files_kept():
    """docs/bench/ keeps the raw results docs/performance.md cites, and only those; the page stays one
    current page (older runs live in git history)."""
    page = (ROOT / "docs" / "performance.md").read_text()
    cited = set(re.findall(r"docs/bench/([\w.+-]+)", page))
    kept = {p.name for p in (ROOT / "docs" / "bench").iterdir()}
    assert cited - kept == set(), "cited but missing"
    assert kept - cited == set(), "kept but never cited"
    assert len(page.splitlines()) < 300
