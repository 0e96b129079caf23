"""The chart's model storage (values model.*, gateway.tokenizer) and image references, rendered
by a real helm: only the workers mount the model, each source gives the volume it names, the
gateways never run the worker image, every pod and init container meets the restricted Pod
Security Standard (hostPath aside), and the download init container fetches from a hub once.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from typing import ClassVar

import jsonschema
import pytest

from tests.deploy.test_chart_render import HELM, helm, render, workloads
from tests.deploy.test_deploy import CHART, VALUES, merged, validator

REVISION = "0123456789abcdef0123456789abcdef01234567"
DOWNLOAD = {"enabled": True, "repo": "org/model", "revision": REVISION}
SOURCES = {
    "existingClaim": {"source": "existingClaim", "existingClaim": "models", "path": "m"},
    "pvc": {"source": "pvc", "path": "m", "download": DOWNLOAD},
    "hostPath": {"source": "hostPath", "hostPath": {"path": "/data/models"}, "path": "m"},
    "volume": {"source": "volume", "volume": {"nfs": {"server": "nfs", "path": "/m"}}, "path": "m"},
}
TOKENIZER_PVC = {"tokenizer": {"volume": {"persistentVolumeClaim": {"claimName": "tok"}}}}


def rendered(model: dict, gateway: dict | None = None) -> tuple[dict, ...]:
    overrides = [f"model={json.dumps(merged(VALUES['model'], model))}"]
    if gateway:
        overrides.append(f"gateway={json.dumps(merged(VALUES['gateway'], gateway))}")
    return render(None, *overrides)


def pods(docs) -> dict[str, dict]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in workloads(docs)}


def containers(pod: dict) -> list[dict]:
    return pod["containers"] + pod.get("initContainers", [])


@pytest.mark.parametrize("source", SOURCES)
def test_only_workers_mount_the_model(source):
    gateway = None if source == "pvc" else TOKENIZER_PVC  # pvc: the tokenizer is downloaded
    docs = rendered(SOURCES[source], gateway)
    worker = pods(docs)["worker"]["spec"]["template"]["spec"]
    (volume,) = [v for v in worker["volumes"] if v["name"] == "model"]
    kind = {"existingClaim": "persistentVolumeClaim", "pvc": "persistentVolumeClaim"}
    assert kind.get(source, source if source != "volume" else "nfs") in volume
    main = worker["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
    assert {"name": "SKIFF_MODEL", "value": "/models/m"} in main["env"]
    for name, doc in pods(docs).items():
        if name != "worker":
            spec = doc["spec"]["template"]["spec"]
            assert "model" not in {v["name"] for v in spec["volumes"]}, name
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(claims) == (source == "pvc")
    if source == "pvc":
        assert volume["persistentVolumeClaim"]["claimName"] == claims[0]["metadata"]["name"]
        assert claims[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_gateways_never_run_the_worker_image():
    for case in ({}, SOURCES["pvc"]):
        docs = rendered(case)
        workers = pods(docs)["worker"]["spec"]["template"]["spec"]["containers"][0]["image"]
        gateway = pods(docs)["gateway"]["spec"]["template"]["spec"]
        assert all(c["image"] != workers for c in containers(gateway))
        env = {e["name"]: e.get("value") for e in gateway["containers"][0]["env"]}
        # embedded: the image's own files (its SKIFF_MODEL_DIR); downloaded: an emptyDir
        assert env.get("SKIFF_MODEL_DIR") == (None if not case else "/tokenizer")


def test_a_tokenizer_volume_for_other_models():
    docs = rendered(
        SOURCES["existingClaim"], {"tokenizer": {**TOKENIZER_PVC["tokenizer"], "path": "m"}}
    )
    gateway = pods(docs)["gateway"]["spec"]["template"]["spec"]
    assert {"name": "SKIFF_MODEL_DIR", "value": "/tokenizer/m"} in gateway["containers"][0]["env"]
    (volume,) = [v for v in gateway["volumes"] if v["name"] == "tokenizer"]
    assert volume["persistentVolumeClaim"]["claimName"] == "tok"


def test_a_model_the_gateways_cannot_tokenize_is_refused():
    if HELM is None:
        helm("version")  # skips, or fails under CI
    override = json.dumps(merged(VALUES["model"], SOURCES["existingClaim"]))
    done = subprocess.run(
        [HELM, "template", "x", str(CHART), "--set-json", f"model={override}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "gateway.tokenizer.volume is required" in done.stderr


@pytest.mark.parametrize("source", [None, *SOURCES])
def test_restricted_pod_security(source):
    docs = rendered(SOURCES[source], TOKENIZER_PVC) if source else render(None)
    for doc in workloads(docs):
        pod = doc["spec"]["template"]["spec"]
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["seccompProfile"]["type"] == "RuntimeDefault"
        host_paths = [v for v in pod["volumes"] if "hostPath" in v]
        assert not host_paths or (source == "hostPath" and doc["kind"] == "StatefulSet")
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["readOnlyRootFilesystem"] is True and not sc.get("privileged")


def test_image_references():
    docs = render(None)
    images = {
        c["image"] for d in workloads(docs) for c in containers(d["spec"]["template"]["spec"])
    }
    assert "ghcr.io/skiff-ai/skiff-gateway:0.1.0" in images
    assert "docker.io/library/nats:2.11-alpine" in images
    digest = "sha256:" + "a" * 64
    worker = merged(VALUES["worker"], {"image": {"tag": "1.2", "digest": digest}})
    docs = render(
        None, 'global={"imageRegistry": "mirror.local:5000"}', f"worker={json.dumps(worker)}"
    )
    images = {
        c["image"] for d in workloads(docs) for c in containers(d["spec"]["template"]["spec"])
    }
    assert f"mirror.local:5000/skiff-ai/skiff-worker:1.2@{digest}" in images
    assert all(i.startswith("mirror.local:5000/") for i in images)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ({"download": {**DOWNLOAD, "revision": "main"}}, "a branch, not a commit"),
        ({"source": "pvc", "path": "m", "download": {**DOWNLOAD, "revision": ""}}, "no revision"),
        ({"download": DOWNLOAD}, "download of the embedded model"),
        ({"source": "existingClaim", "path": "m"}, "no claim"),
        ({"source": "pvc"}, "no path"),
        ({"volume": {"nfs": {"server": "x", "path": "/"}}, "path": "m"}, "volume, source embedded"),
        ({"source": "hostPath", "path": "m", "hostPath": {"path": "data"}}, "relative hostPath"),
        ({"source": "pvc", "path": "m", "pvc": {"accessMode": "ReadOnlyMany"}}, "unfillable pvc"),
    ],
)
def test_schema_rejects_bad_model_values(model, why):
    values = merged(VALUES, {"model": model})
    assert list(validator().iter_errors(values)), why


def test_schema_accepts_every_source():
    for model in SOURCES.values():
        jsonschema.validate(merged(VALUES, {"model": model}), validator().schema)


class _Hub(http.server.BaseHTTPRequestHandler):
    """The Hub's HTTP API as snapshot_download uses it, for one repo at one commit."""

    files: ClassVar = {
        "config.json": b"{}",
        "tokenizer.json": b"{}",
        "model.safetensors": b"w" * 64,
    }
    requests: ClassVar[list[str]] = []

    def do_GET(self):
        self.requests.append(self.path)
        if self.path.startswith("/api/models/org/model/revision/"):
            body = json.dumps(
                {
                    "id": "org/model",
                    "sha": REVISION,
                    "siblings": [{"rfilename": f} for f in self.files],
                }
            ).encode()
            return self._send(200, body, {"Content-Type": "application/json"})
        if self.path.startswith(f"/api/models/org/model/tree/{REVISION}"):
            tree = [
                {"type": "file", "path": f, "size": len(b), "oid": f} for f, b in self.files.items()
            ]
            return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
        name = self.path.rsplit("/", 1)[-1]
        if self.path.startswith(f"/org/model/resolve/{REVISION}/") and name in self.files:
            return self._send(
                200, self.files[name], {"X-Repo-Commit": REVISION, "ETag": f'"{name}"'}
            )
        self._send(404, b"")

    do_HEAD = do_GET

    def _send(self, code: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(code)
        for key, value in {**(headers or {}), "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_download_init_container_fetches_once(tmp_path):
    """The worker's download-model container, run as rendered against a local stand-in for the
    Hub: the included files arrive, a second run (a restarted pod) finds the marker."""
    docs = rendered(SOURCES["pvc"])
    worker = pods(docs)["worker"]["spec"]["template"]["spec"]
    (init,) = worker["initContainers"]
    command = list(init["command"])
    command[0] = sys.executable
    assert command[3:6] == ["org/model", REVISION, "/models/m"]
    command[5] = str(tmp_path / "m")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        **os.environ,
        **{e["name"]: e["value"] for e in init["env"] if "value" in e},
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "HF_HUB_DISABLE_XET": "1",
    }
    try:
        fetched = []
        for _ in range(2):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            fetched.append(len(_Hub.requests))
        assert (tmp_path / "m" / "model.safetensors").read_bytes() == _Hub.files[
            "model.safetensors"
        ]
        assert (tmp_path / "m" / ".skiff-download").read_text() == f"org/model@{REVISION}\n"
        assert "is there" in done.stdout
        assert fetched[0] > 0 and fetched[1] == fetched[0], _Hub.requests  # no second fetch
    finally:
        server.shutdown()
