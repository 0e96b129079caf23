"""The chart's `models` list, rendered by a real helm: each entry is another model with its own
scheduler Deployments and worker StatefulSets (named <fullname>-<id>-..., selected by their
skiff.io/model label), NATS subjects (<subjectPrefix>.models.<id>), worker NATS users and model
settings, its worker and scheduler values merged over the top-level ones; the gateways learn of
them through SKIFF_EXTRA_MODELS; the schema takes an override of every per-model value and
refuses bad ids; and an empty list renders what the chart rendered before it had one."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import build_parser as scheduler_parser
from services.worker.config import RunnerConfig, WorkerServiceConfig
from services.worker.main import build_parser as worker_parser
from shared import nats_auth
from shared.config import SchedulerConfig
from shared.subjects import Subjects, worker_prefix
from tests.deploy.test_chart_kube_versions import render_error
from tests.deploy.test_chart_render import (
    KUBERNETES_VERSIONS,
    find,
    pod_spec,
    render,
    selects,
    validate_all,
    workloads,
)
from tests.deploy.test_deploy import CHART, DOCKER, ROOT, SCHEMA, VALUES, merged, validator

Doc = dict[str, Any]
QWEN: Doc = {
    "id": "qwen",
    "servedModelName": "Qwen3-8B",
    "model": {"source": "existingClaim", "existingClaim": "models", "path": "Qwen3-8B"},
    "tokenizer": {
        "volume": {"persistentVolumeClaim": {"claimName": "tokenizers", "readOnly": True}},
        "path": "Qwen3-8B",
    },
    "worker": {
        "replicas": 3,
        "kvCacheGiB": 40,
        "resources": {"requests": {"cpu": "4"}},
        "nodeSelector": {"pool": "h200"},
    },
    "scheduler": {"shards": 2},
    "engine": {"maxModelLen": 32768},
}
SMALL: Doc = {"id": "small", "model": {"source": "embedded"}}


def models(*entries: Doc) -> str:
    return f"models={json.dumps(list(entries))}"


TWO = models(QWEN, SMALL)

# Values a `models` entry does not override: the ServiceAccounts are the release's, shared by
# every model's pods; a model's API name is the entry's servedModelName.
RELEASE_WIDE = {
    "model": ("servedModelName",),
    "worker": ("serviceAccount",),
    "scheduler": ("serviceAccount",),
}
# The schema's definitions of an entry's overrides, and the values each overrides.
OVERRIDES = {
    "modelOverrides": "#/properties/model",
    "tokenizerOverrides": "#/properties/gateway/properties/tokenizer",
    "workerOverrides": "#/properties/worker",
    "schedulerOverrides": "#/properties/scheduler",
    "engineOverrides": "#/properties/engine",
    "loraOverrides": "#/properties/lora",
}
# An entry's model path is its own (not inherited): required unless the model is embedded.
PATH_RULE: Doc = {
    "if": {"properties": {"source": {"not": {"const": "embedded"}}}},
    "then": {"required": ["path"]},
}


def resolve(root: Doc, pointer: str) -> Doc:
    node: Any = root
    for part in pointer.removeprefix("#/").split("/"):
        node = node[int(part) if isinstance(node, list) else part]
    found: Doc = node
    return found


def requires(root: Doc, schema: Doc) -> bool:
    """Whether `schema` requires a key anywhere (itself, its properties, what it refers to)."""
    if "$ref" in schema:
        return requires(root, resolve(root, schema["$ref"]))
    nested = [*schema.get("properties", {}).values(), *schema.get("allOf", [])]
    return bool(schema.get("required")) or any(requires(root, s) for s in nested)


def override_schema(root: Doc, pointer: str, shared: dict[str, Doc]) -> Doc:
    """The schema of an override of the values at `pointer`: any of their keys, each an
    override in turn; the values' own schema where it requires nothing. The override of a
    definition X is a definition too, XOverrides, added to `shared`."""
    schema = resolve(root, pointer)
    if not requires(root, schema):
        return {"$ref": pointer}
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/definitions/") + "Overrides"
        if name not in shared:
            shared[name] = override_schema(root, schema["$ref"], shared)
        return {"$ref": f"#/definitions/{name}"}
    if "properties" not in schema:  # all of several schemas
        parts = range(len(schema["allOf"]))
        return {"allOf": [override_schema(root, f"{pointer}/allOf/{i}", shared) for i in parts]}
    out = {key: value for key, value in schema.items() if key != "required"}
    out["properties"] = {
        key: override_schema(root, f"{pointer}/properties/{key}", shared)
        for key in schema["properties"]
    }
    return out


def override_schemas(root: Doc) -> dict[str, Doc]:
    """What the schema's definitions of overrides must be: OVERRIDES and those they use."""
    out: dict[str, Doc] = {}
    shared: dict[str, Doc] = {}
    for name, pointer in OVERRIDES.items():
        schema = override_schema(root, pointer, shared)
        for key in RELEASE_WIDE.get(pointer.rsplit("/", 1)[1], ()):
            del schema["properties"][key]
        out[name] = schema
    model = out["modelOverrides"]
    model["required"] = ["source"]
    model["allOf"] = [*model["allOf"], PATH_RULE]
    return out | shared


# ---- schema -----------------------------------------------------------------------------------


def test_an_entry_may_override_every_value_of_its_model() -> None:
    """The schema's overrides are the top-level values' schemas with nothing required (a new
    worker, scheduler, engine or model value fails here until an entry may override it too)."""
    defined = {k: v for k, v in SCHEMA["definitions"].items() if k.endswith("Overrides")}
    assert defined == override_schemas(SCHEMA)
    entry = SCHEMA["definitions"]["modelEntry"]["properties"]
    assert {entry[k]["$ref"].rsplit("/", 1)[1] for k in entry if "$ref" in entry[k]} == set(
        OVERRIDES
    )


@pytest.mark.parametrize(
    ("entry", "where"),
    [
        ({"id": "Qwen", "model": {"source": "embedded"}}, "uppercase id"),
        ({"id": "a.b", "model": {"source": "embedded"}}, "dot in the id"),
        ({"id": "-a", "model": {"source": "embedded"}}, "id not a DNS label"),
        ({"id": "a" * 25, "model": {"source": "embedded"}}, "id too long"),
        ({"model": {"source": "embedded"}}, "no id"),
        ({"id": "a", "model": {"path": "m"}}, "no model source"),
        ({"id": "a", "model": {"source": "existingClaim"}}, "no model path"),
        ({"id": "a", "model": {"source": "embedded"}, "worker": {"gpus": 2}}, "typo'd key"),
        ({"id": "a", "model": {"source": "embedded"}, "worker": {"device": "tpu"}}, "bad device"),
        (
            {"id": "a", "model": {"source": "embedded"}, "worker": {"serviceAccount": {}}},
            "release-wide value",
        ),
        (
            {"id": "a", "model": {"source": "embedded", "download": {"enabled": True}}},
            "embedded and downloaded",
        ),
        ({"id": "a", "model": {"source": "embedded"}, "engine": {"maxModelLen": 0}}, "engine"),
    ],
)
def test_the_schema_refuses_bad_entries(entry: Doc, where: str) -> None:
    assert list(validator().iter_errors(merged(VALUES, {"models": [entry]}))), where


def test_the_schema_takes_partial_overrides() -> None:
    entry = {
        **QWEN,
        "worker": {
            "autoscaling": {"enabled": True, "maxReplicas": 4, "serverAddress": "http://p:9090"},
            "decode": {"enabled": True, "replicas": 2},
            "pdb": {"enabled": False},
        },
        "scheduler": {"longPrefill": {"share": 0.25}},
    }
    assert not list(validator().iter_errors(merged(VALUES, {"models": [entry, SMALL]})))


def test_bad_ids_fail_the_render_with_a_clear_message() -> None:
    assert 'models: the id "qwen" is used twice' in render_error(None, models(QWEN, QWEN))
    assert "does not match pattern" in render_error(None, models({**SMALL, "id": "Small"}))


# ---- an empty list ----------------------------------------------------------------------------


def test_no_models_add_nothing() -> None:
    docs = render(None, "models=[]")
    assert stable(docs) == stable(render(None))
    assert not [d for d in docs if "skiff.io/model" in d["metadata"]["labels"]]
    gateway = env_of(find(docs, "Deployment", "skiff-gateway"))
    assert "SKIFF_EXTRA_MODELS" not in gateway
    assert not [a for a in nats_command(docs) if a.startswith("--model")]


def test_the_first_models_objects_stay_as_they_were() -> None:
    """Other models change none of the first model's objects (their selectors are immutable),
    but what must see the other models: the gateway (their list), NATS (their users), the first
    model's PDBs and ServiceMonitors (which exclude the other models' pods)."""
    on = ("networkPolicy.enabled=true", "metrics.serviceMonitor.enabled=true")
    before = {key(d): d for d in stable(render(None, *on))}
    after = {key(d): d for d in stable(render(None, *on, TWO))}
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {
        ("Deployment", "skiff-gateway"),
        ("StatefulSet", "skiff-nats"),
        ("Secret", "skiff-nats-auth"),
        ("PodDisruptionBudget", "skiff-worker"),
        ("ServiceMonitor", "skiff-scheduler"),
        ("ServiceMonitor", "skiff-worker"),
    }
    pdb = after[("PodDisruptionBudget", "skiff-worker")]["spec"]["selector"]
    assert (
        pdb["matchLabels"]
        == before[("PodDisruptionBudget", "skiff-worker")]["spec"]["selector"]["matchLabels"]
    )
    assert pdb["matchExpressions"] == [{"key": "skiff.io/model", "operator": "DoesNotExist"}]


def key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def stable(docs: Iterable[Doc]) -> list[Doc]:
    """The objects without what every render generates anew (passwords, certificates): the
    keys of their Secrets' data only."""
    return [{**d, "data": sorted(d["data"])} if d["kind"] == "Secret" else d for d in docs]


# ---- schedulers and workers -------------------------------------------------------------------


def env_of(doc: Doc) -> dict[str, Any]:
    (c,) = pod_spec(doc)["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def args_of(doc: Doc) -> list[str]:
    (c,) = pod_spec(doc)["containers"]
    args: list[str] = c.get("args", [])
    return args


def configs(build_parser: Any, doc: Doc, monkeypatch: pytest.MonkeyPatch) -> dict[type, Any]:
    """What the service parses from the container's SKIFF_* variables and arguments."""
    with monkeypatch.context() as m:
        for name, value in env_of(doc).items():
            if name.startswith("SKIFF_") and isinstance(value, str):
                m.setenv(name, value)
        parser = build_parser()
        ns, out = parser.parse_configs(args_of(doc))
        if build_parser is worker_parser:
            out[RunnerConfig] = parser.config(RunnerConfig, ns, model_dir="/models/m")
    result: dict[type, Any] = out
    return result


# (id, resource name base, subject prefix, API name, shards, context length)
MODELS = [
    ("", "skiff", "skiff", "SmolLM2-135M-Instruct", 1, 8192),
    ("qwen", "skiff-qwen", "skiff.models.qwen", "Qwen3-8B", 2, 32768),
    ("small", "skiff-small", "skiff.models.small", "small", 1, 8192),
]


def test_each_model_has_schedulers_and_workers_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = render(None, TWO)
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert deployments == {
        "skiff-gateway",
        "skiff-scheduler",
        "skiff-qwen-scheduler-0",
        "skiff-qwen-scheduler-1",
        "skiff-small-scheduler",
    }
    statefulsets = {d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet"}
    assert statefulsets == {"skiff-nats", "skiff-worker", "skiff-qwen-worker", "skiff-small-worker"}
    for model, name, prefix, served, shards, context in MODELS:
        worker = find(docs, "StatefulSet", f"{name}-worker")
        assert worker["spec"]["serviceName"] == f"{name}-worker"
        assert labels_of(worker).get("skiff.io/model", "") == model
        got = configs(worker_parser, worker, monkeypatch)
        service = got[WorkerServiceConfig]
        assert (service.subject_prefix, service.served_model_name) == (prefix, served)
        assert service.scheduler_shards == shards
        assert got[RunnerConfig].max_model_len == context
        schedulers = [
            d
            for d in docs
            if d["kind"] == "Deployment" and d["metadata"]["name"].startswith(f"{name}-scheduler")
        ]
        assert len(schedulers) == shards
        for shard, scheduler in enumerate(schedulers):
            got = configs(scheduler_parser, scheduler, monkeypatch)
            expected = prefix if shards == 1 else f"{prefix}.shard{shard}"
            assert got[SchedulerServiceConfig].subject_prefix == expected
            assert got[SchedulerServiceConfig].served_model_name == served
            assert got[SchedulerConfig].max_model_len == context
    assert env_of(find(docs, "StatefulSet", "skiff-qwen-worker"))["SKIFF_MODEL"] == (
        "/models/Qwen3-8B"
    )
    assert "SKIFF_MODEL" not in env_of(find(docs, "StatefulSet", "skiff-small-worker"))


def labels_of(doc: Doc) -> dict[str, str]:
    labels: dict[str, str] = doc["spec"]["template"]["metadata"]["labels"]
    return labels


def test_no_selector_of_another_model_selects_a_pod_of_the_first_or_of_another() -> None:
    """The other models' selectors carry their skiff.io/model label. The first model's
    (unchanged since before `models`) select the other models' pods too: only controllers
    (whose ControllerRef keeps them apart), Services (whose scrapes are deduplicated, see the
    ServiceMonitor test) and PDBs, which exclude them."""
    on = ("networkPolicy.enabled=true", "metrics.serviceMonitor.enabled=true")
    docs = render(None, *on, 'scheduler={"replicas": 2}', TWO)
    pods = {d["metadata"]["name"]: labels_of(d) for d in workloads(docs)}
    for doc in docs:
        model = doc["metadata"]["labels"].get("skiff.io/model")
        selector = object_selector(doc)
        if model is None or selector is None:
            continue
        assert selector["matchLabels"]["skiff.io/model"] == model
        chosen = {n for n, labels in pods.items() if selects(selector, labels)}
        assert chosen and all(pods[n].get("skiff.io/model") == model for n in chosen), key(doc)
    for pod in pods:
        budgets = [
            d
            for d in docs
            if d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"], pods[pod])
        ]
        assert len(budgets) == (
            0
            if pod.startswith(
                ("skiff-nats", "skiff-scheduler", "skiff-qwen-scheduler", "skiff-small-scheduler")
            )
            else 1
        ), pod


def object_selector(doc: Doc) -> Doc | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget"):
        selector: Doc = doc["spec"]["selector"]
        return selector
    if doc["kind"] == "Service":
        return {"matchLabels": doc["spec"]["selector"]}
    return None


def test_an_entrys_values_merge_over_the_top_level_ones() -> None:
    top = {
        "nodeSelector": {"gpu": "h100", "zone": "a"},
        "tolerations": [{"key": "x", "operator": "Exists"}],
    }
    docs = render(
        None,
        f"worker.nodeSelector={json.dumps(top['nodeSelector'])}",
        f"worker.tolerations={json.dumps(top['tolerations'])}",
        TWO,
    )
    first, qwen, small = (
        find(docs, "StatefulSet", f"{n}-worker") for n in ("skiff", "skiff-qwen", "skiff-small")
    )
    assert [d["spec"]["replicas"] for d in (first, qwen, small)] == [1, 3, 1]
    (c,) = pod_spec(qwen)["containers"]
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi"},  # the entry's cpu, the top-level memory
        "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"},
    }
    assert pod_spec(qwen)["nodeSelector"] == {"gpu": "h100", "zone": "a", "pool": "h200"}
    assert pod_spec(small)["nodeSelector"] == top["nodeSelector"]
    for doc in (first, qwen, small):
        assert pod_spec(doc)["tolerations"] == top["tolerations"]
    assert env_of(qwen)["SKIFF_KV_CACHE_GIB"] == "40"
    assert env_of(small)["SKIFF_KV_CACHE_GIB"] == env_of(first)["SKIFF_KV_CACHE_GIB"] == "8"
    # lists and other values replace; the entry's model path and download are its own
    replaced = {**QWEN, "worker": {"tolerations": [], "pdb": {"enabled": False}}}
    docs = render(None, f"worker.tolerations={json.dumps(top['tolerations'])}", models(replaced))
    assert "tolerations" not in pod_spec(find(docs, "StatefulSet", "skiff-qwen-worker"))
    pdbs = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert pdbs == {"skiff-gateway", "skiff-worker"}


def test_a_model_of_its_own_pvc_and_download() -> None:
    download = {
        "enabled": True,
        "repo": "Qwen/Qwen3-8B",
        "revision": "0123456789abcdef0123456789abcdef01234567",
    }
    entry = {"id": "qwen", "model": {"source": "pvc", "path": "Qwen3-8B", "download": download}}
    docs = render(CHART / "ci" / "gpu-pvc-values.yaml", models(entry))
    pvc = find(docs, "PersistentVolumeClaim", "skiff-qwen-model")
    first = find(docs, "PersistentVolumeClaim", "skiff-model")
    assert pvc["spec"] == first["spec"]  # the top-level model's pvc values
    worker = pod_spec(find(docs, "StatefulSet", "skiff-qwen-worker"))
    (volume,) = [v for v in worker["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "skiff-qwen-model"}
    (init,) = worker["initContainers"]
    assert init["command"][3:6] == ["Qwen/Qwen3-8B", download["revision"], "/models/Qwen3-8B"]
    # the gateways fetch its tokenizer files beside the first model's
    gateway = pod_spec(find(docs, "Deployment", "skiff-gateway"))
    inits = {c["name"]: c for c in gateway["initContainers"]}
    assert set(inits) == {"download-model", "download-model-qwen"}
    assert inits["download-model-qwen"]["command"][3:6] == [
        "Qwen/Qwen3-8B",
        download["revision"],
        "/tokenizers/qwen",
    ]
    (extra,) = extra_models(docs)
    assert extra["model_dir"] == "/tokenizers/qwen"
    # without a download, the gateways need its tokenizer files on a volume
    bare = {"id": "qwen", "model": {"source": "existingClaim", "existingClaim": "m", "path": "q"}}
    assert "models[qwen].tokenizer.volume is required" in render_error(None, models(bare))


def test_each_models_schedulers_elect_a_leader_on_leases_of_their_own() -> None:
    docs = render(None, 'scheduler={"replicas": 2}', TWO)
    accounts = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert [d["metadata"]["name"] for d in accounts] == ["skiff-scheduler"]
    leases = {d["metadata"]["name"] for d in docs if d["kind"] == "Lease"}
    assert leases == {
        "skiff-scheduler",
        "skiff-qwen-scheduler-0",
        "skiff-qwen-scheduler-1",
        "skiff-small-scheduler",
    }
    role = find(docs, "Role", "skiff-qwen-scheduler-leader-election")
    assert role["rules"][1]["resourceNames"] == ["skiff-qwen-scheduler-0", "skiff-qwen-scheduler-1"]
    binding = find(docs, "RoleBinding", "skiff-qwen-scheduler-leader-election")
    assert binding["subjects"][0]["name"] == "skiff-scheduler"
    for name in ("skiff-qwen-scheduler-0", "skiff-small-scheduler"):
        scheduler = find(docs, "Deployment", name)
        assert pod_spec(scheduler)["serviceAccountName"] == "skiff-scheduler"
        assert env_of(scheduler)["SKIFF_LEADER_ELECTION_LEASE_NAME"] == name
    # only one model electing still gets the ServiceAccount
    docs = render(None, models({**SMALL, "scheduler": {"replicas": 3}}))
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"] == [
        "skiff-scheduler"
    ]
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Lease"} == {
        "skiff-small-scheduler"
    }


# ---- the gateway ------------------------------------------------------------------------------


def extra_models(docs: Iterable[Doc]) -> list[Doc]:
    extra: list[Doc] = json.loads(
        env_of(find(docs, "Deployment", "skiff-gateway"))["SKIFF_EXTRA_MODELS"]
    )
    return extra


EMBEDDED_TOKENIZER = "/opt/skiff/models/SmolLM2-135M-Instruct"


def test_the_gateway_learns_of_every_other_model_and_mounts_its_tokenizer() -> None:
    docs = render(None, TWO)
    assert extra_models(docs) == [
        {
            "name": "Qwen3-8B",
            "model_dir": "/tokenizers/qwen/Qwen3-8B",
            "subject_prefix": "skiff.models.qwen",
            "scheduler_shards": 2,
            "max_model_len": 32768,
        },
        {
            "name": "small",
            "model_dir": EMBEDDED_TOKENIZER,
            "subject_prefix": "skiff.models.small",
            "scheduler_shards": 1,
            "max_model_len": 8192,
        },
    ]
    gateway = env_of(find(docs, "Deployment", "skiff-gateway"))
    routes = GatewayConfig(extra_models=gateway["SKIFF_EXTRA_MODELS"]).models  # as it parses it
    assert [(r.name, r.subject_prefix, r.scheduler_shards) for r in routes[1:]] == [
        ("Qwen3-8B", "skiff.models.qwen", 2),
        ("small", "skiff.models.small", 1),
    ]
    pod = pod_spec(find(docs, "Deployment", "skiff-gateway"))
    (c,) = pod["containers"]
    assert {"name": "tokenizer-qwen", "mountPath": "/tokenizers/qwen", "readOnly": True} in c[
        "volumeMounts"
    ]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tokenizer-qwen"]
    assert volume == {"name": "tokenizer-qwen", **QWEN["tokenizer"]["volume"]}
    assert not [v for v in pod["volumes"] if v["name"] == "tokenizer-small"]
    # the embedded model's tokenizer files are where the gateway image has them
    dockerfile = (DOCKER / "gateway.Dockerfile").read_text()
    assert f"SKIFF_MODEL_DIR={EMBEDDED_TOKENIZER} " in dockerfile


# ---- NATS -------------------------------------------------------------------------------------


def nats_command(docs: Iterable[Doc]) -> list[str]:
    (init,) = pod_spec(find(docs, "StatefulSet", "skiff-nats"))["initContainers"]
    command: list[str] = init["command"]
    return command


WORKERS = {
    "skiff": ["skiff-worker-0"],
    "skiff.models.qwen": [f"skiff-qwen-worker-{i}" for i in range(3)],
    "skiff.models.small": ["skiff-small-worker-0"],
}


def test_nats_knows_every_models_subjects_and_workers(tmp_path: Path) -> None:
    docs = render(None, TWO)
    command = nats_command(docs)
    assert [a for a in command if a.startswith("--model")] == [
        "--model=skiff.models.qwen:2",
        "--model=skiff.models.small:1",
    ]
    workers = [a.removeprefix("--worker=") for a in command if a.startswith("--worker=")]
    assert workers == [
        f"{user}@{prefix}" if prefix != "skiff" else user
        for prefix, users in WORKERS.items()
        for user in users
    ]
    # each worker pod mounts its own password only, which the Secret holds
    secret = find(docs, "Secret", "skiff-nats-auth")["data"]
    every = [u for users in WORKERS.values() for u in users]
    assert set(secret) == {"admin", "gateway", "scheduler", *every}
    assert len({base64.b64decode(p) for p in secret.values()}) == len(secret)
    for name, users in (
        ("skiff-qwen-worker", WORKERS["skiff.models.qwen"]),
        ("skiff-small-worker", WORKERS["skiff.models.small"]),
    ):
        (volume,) = [
            v
            for v in pod_spec(find(docs, "StatefulSet", name))["volumes"]
            if v["name"] == "nats-auth"
        ]
        assert [i["key"] for i in volume["secret"]["items"]] == users
    # the server the init container configures lets a worker use its own model's subjects only
    for user in secret:
        (tmp_path / user).write_text(base64.b64decode(secret[user]).decode())
    args = [a for a in command[3:] if not a.startswith(("--out", "--password-dir", "--tls"))]
    nats_auth.main([*args, f"--password-dir={tmp_path}", f"--out={tmp_path / 'nats.conf'}"])
    conf = (tmp_path / "nats.conf").read_text()
    known = {u["user"]: u for u in json.loads(conf.removeprefix("authorization "))["users"]}
    shards = {"skiff": 1, "skiff.models.qwen": 2, "skiff.models.small": 1}
    for prefix, names in WORKERS.items():
        for name in names:
            own = worker_prefix(prefix, name, shards[prefix])  # its shard's
            subjects = known[name]["permissions"]["publish"]["allow"]
            assert Subjects(own).worker_hello(name) in subjects
            assert all(s.startswith(f"{own}.") for s in subjects), name
            assert not [s for s in subjects if s.startswith("skiff.models.") != (prefix != "skiff")]
    gateway = known["gateway"]["permissions"]["publish"]["allow"]
    assert {
        "skiff.req.submit",
        "skiff.models.qwen.shard1.req.submit",
        "skiff.models.small.req.submit",
    } <= set(gateway)


def test_simulated_workers_of_another_model_host_their_ids() -> None:
    sim = {**SMALL, "worker": {"device": "sim", "replicas": 2, "sim": {"count": 2}}}
    docs = render(None, models(sim))
    workers = [a for a in nats_command(docs) if a.startswith("--worker=skiff-small")]
    assert workers == [
        f"--worker=skiff-small-worker-{i}=skiff-small-worker-{i}-0,skiff-small-worker-{i}-1"
        "@skiff.models.small"
        for i in range(2)
    ]
    env = env_of(find(docs, "StatefulSet", "skiff-small-worker"))
    assert (env["SKIFF_DEVICE"], env["SKIFF_COUNT"]) == ("sim", "2")
    assert env_of(find(docs, "StatefulSet", "skiff-worker"))["SKIFF_DEVICE"] == "cuda"


# ---- network, monitoring, autoscaling ---------------------------------------------------------


def test_network_policies_cover_every_models_pods() -> None:
    docs = render(
        None,
        "networkPolicy.enabled=true",
        models(QWEN, {**SMALL, "worker": {"prefill": {"enabled": True}}}),
    )
    pods = {d["metadata"]["name"]: labels_of(d) for d in workloads(docs)}
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for name, labels in pods.items():
        assert [p for p in policies if selects(p["spec"]["podSelector"], labels)], name
    nats = find(docs, "NetworkPolicy", "skiff-nats")["spec"]["ingress"][0]
    (peer,) = nats["from"]
    assert {n for n, labels in pods.items() if selects(peer["podSelector"], labels)} == set(
        pods
    ) - {"skiff-nats"}
    (transfer,) = [
        r
        for r in find(docs, "NetworkPolicy", "skiff-worker-prefill")["spec"]["ingress"]
        if r["ports"][0]["port"] == "kv-transfer"
    ]
    workers = {n for n in pods if "worker" in n}
    assert {
        n
        for n, labels in pods.items()
        if any(selects(p["podSelector"], labels) for p in transfer["from"])
    } == workers


def scraped(docs: Iterable[Doc], component: str) -> dict[str, list[tuple[str, str]]]:
    """Which pods Prometheus scrapes through the ServiceMonitor of `component`, with the job of
    each scrape: a target per pod of each Service it selects, unless a relabeling drops it."""
    docs = list(docs)
    monitor = find(docs, "ServiceMonitor", f"skiff-{component}")["spec"]
    (endpoint,) = monitor["endpoints"]
    pods = {d["metadata"]["name"]: labels_of(d) for d in workloads(docs)}
    out: dict[str, list[tuple[str, str]]] = {}
    for service in docs:
        if service["kind"] != "Service" or not selects(
            monitor["selector"], service["metadata"]["labels"]
        ):
            continue
        for pod, labels in pods.items():
            if not selects({"matchLabels": service["spec"]["selector"]}, labels):
                continue
            target = {"job": service["metadata"]["name"]}
            meta = {
                **{
                    f"__meta_kubernetes_service_label_{prom(k)}": v
                    for k, v in service["metadata"]["labels"].items()
                },
                **{f"__meta_kubernetes_pod_label_{prom(k)}": v for k, v in labels.items()},
            }
            if relabel(endpoint.get("relabelings", []), meta, target):
                out.setdefault(pod, []).append((service["metadata"]["name"], target["job"]))
    return out


def prom(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", label)


def relabel(rules: list[Doc], meta: dict[str, str], target: dict[str, str]) -> bool:
    """Prometheus's relabeling of the actions the chart uses (drop, replace with a fixed
    value): whether the target is kept."""
    for rule in rules:
        if rule["action"] == "drop":
            value = ";".join(meta.get(s, target.get(s, "")) for s in rule["sourceLabels"])
            if re.fullmatch(rule["regex"], value):
                return False
        else:
            assert rule["action"] == "replace" and "sourceLabels" not in rule
            target[rule["targetLabel"]] = rule["replacement"]
    return True


def test_prometheus_scrapes_each_pod_once_as_the_job_the_alerts_name() -> None:
    docs = render(None, "metrics.serviceMonitor.enabled=true", TWO)
    workers = scraped(docs, "worker")
    assert set(workers) == {"skiff-worker", "skiff-qwen-worker", "skiff-small-worker"}
    for pod, scrapes in workers.items():
        assert scrapes == [(pod, "skiff-worker")], pod  # its own Service, the alerts' job
    schedulers = scraped(docs, "scheduler")
    assert set(schedulers) == {
        "skiff-scheduler",
        "skiff-qwen-scheduler-0",
        "skiff-qwen-scheduler-1",
        "skiff-small-scheduler",
    }
    for pod, scrapes in schedulers.items():
        ((service, _),) = scrapes
        assert pod.startswith(service), pod


def test_each_model_scales_on_its_own_queue() -> None:
    autoscaling = {"enabled": True, "serverAddress": "http://prometheus:9090"}
    qwen = {
        **QWEN,
        "worker": {
            "autoscaling": {"enabled": True, "maxReplicas": 4},
            "prefill": {"enabled": True, "autoscaling": {"enabled": True}},
        },
    }
    docs = render(None, f"worker.autoscaling={json.dumps(autoscaling)}", models(qwen))
    queries = {
        d["metadata"]["name"]: d["spec"]["triggers"][0]["metadata"]["query"]
        for d in docs
        if d["kind"] == "ScaledObject"
    }
    waiting = 'sum(vllm:num_requests_waiting{namespace="llm",model_name="%s"})'
    prefill = 'service="skiff-qwen-scheduler",role="prefill",state="waiting"'
    assert queries == {
        "skiff-worker": waiting % "SmolLM2-135M-Instruct",
        "skiff-qwen-worker": waiting % "Qwen3-8B",
        "skiff-qwen-worker-prefill": f'sum(skiff_role_requests{{namespace="llm",{prefill}}})',
    }
    # every pod KEDA may start has a NATS user
    (volume,) = [
        v
        for v in pod_spec(find(docs, "StatefulSet", "skiff-qwen-worker"))["volumes"]
        if v["name"] == "nats-auth"
    ]
    assert [i["key"] for i in volume["secret"]["items"]] == [
        f"skiff-qwen-worker-{i}" for i in range(4)
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_kubernetes(version: str) -> None:
    on = (
        "networkPolicy.enabled=true",
        "metrics.serviceMonitor.enabled=true",
        'scheduler={"replicas": 2}',
    )
    assert validate_all(render(None, *on, TWO), version) > 20


def test_the_cluster_tests_values_render_with_models() -> None:
    local = ROOT / "tests" / "cluster" / "local-values.yaml"
    docs = render(local, models({**SMALL, "worker": {"device": "sim"}}))
    assert find(docs, "StatefulSet", "skiff-small-worker")


def documented_examples() -> dict[str, Doc]:
    """The `models` examples of values.yaml (a comment), the chart's README and
    docs/deployment.md."""
    values = (CHART / "values.yaml").read_text()
    comment = values[values.index("#   models:") : values.index("\nmodels: []")]
    out = {"values.yaml": yaml.safe_load(re.sub(r"(?m)^#  ", "", comment))}
    for path in (CHART / "README.md", ROOT / "docs" / "deployment.md"):
        text = path.read_text()
        block = re.search(r"```yaml\n(models:\n.*?)```", text, re.S)
        assert block, path
        out[path.name] = yaml.safe_load(block[1])
    return out


@pytest.mark.parametrize("where", ["values.yaml", "README.md", "deployment.md"])
def test_the_documented_examples_render(where: str) -> None:
    example = documented_examples()[where]
    assert not list(validator().iter_errors(merged(VALUES, example)))
    docs = render(None, models(*example["models"]))
    (entry,) = example["models"]
    find(docs, "StatefulSet", f"skiff-{entry['id']}-worker")
