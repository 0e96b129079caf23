"""The pure parts of the local node's image builder: apt and pip configuration read from the
machine, the chart values that select the built images, the content hash. Nothing is built."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cluster.localkube import images
from tests.deploy.test_chart_render import pod_spec, render, workloads

DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main contrib
Enabled: yes
"""


def test_apt_sources_from_deb822_and_one_line_files() -> None:
    assert images.parse_apt_sources(DEB822, deb822=True) == [
        "deb http://deb.debian.org/debian bookworm main",
        "deb http://deb.debian.org/debian bookworm-updates main",
        "deb http://mirror.example/debian-security bookworm-security main contrib",
    ]
    listing = (
        "# comment\ndeb [signed-by=/k.gpg] http://m.example/debian bookworm main # x\n"
        "deb-src http://m.example/debian bookworm main\n"
    )
    assert images.parse_apt_sources(listing, deb822=False) == [
        "deb http://m.example/debian bookworm main"
    ]


PIP_LIST = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
:env:.disable-pip-version-check='1'
global.cert='/elsewhere/ca.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple https://m.example/simple'
global.find-links='/opt/old-wheels'
"""


def test_pip_index_configuration_environment_first_constraint_left_out() -> None:
    config = images.parse_pip_config(PIP_LIST)
    assert config == {
        "cert": "/etc/ssl/certs/ca-certificates.crt",
        "find-links": "/opt/wheels",
        "extra-index-url": (
            "file:///opt/pypi/simple file:///opt/pypi-more/simple https://m.example/simple"
        ),
    }
    # an index root is mounted whole (its pages link to ../../files); remote URLs need nothing
    assert [str(p) for p in images.pip_local_paths(config)] == [
        "/etc/ssl/certs/ca-certificates.crt",
        "/opt/pypi",
        "/opt/pypi-more",
        "/opt/wheels",
    ]
    assert images.torch_index_url(config) == images.PYPI
    assert images.torch_index_url({"index-url": "https://m.example/simple"}).startswith("https://m")
    conf = images.render_pip_conf(config)
    assert conf.startswith("[global]\n") and "find-links = /opt/wheels\n" in conf


def rendered_images(values: dict[str, str]) -> set[tuple[str, str]]:
    """(image, imagePullPolicy) of every container the chart renders with the CPU worker."""
    overrides = [f"{k}={json.dumps(v)}" for k, v in values.items()]
    found = set()
    for doc in workloads(render(None, 'worker.device="cpu"', *overrides)):
        spec = pod_spec(doc)
        for c in spec.get("initContainers", []) + spec["containers"]:
            found.add((c["image"], c["imagePullPolicy"]))
    return found


def test_chart_values_select_the_built_images() -> None:
    wanted = {images.service_image(s) for s in images.SERVICES} | {images.nats_image()}
    rendered = rendered_images(images.chart_values())
    assert {image for image, _ in rendered} == wanted
    assert {policy for _, policy in rendered} == {"Never"}


def test_source_hash_follows_the_sources(tmp_path: Path) -> None:
    for name in images.SOURCES:
        (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("x")
    (tmp_path / "services" / "a.py").write_text("a = 1\n")
    first = images.source_hash(["pip"], root=tmp_path)
    (tmp_path / "services" / "__pycache__").mkdir()
    (tmp_path / "services" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    assert images.source_hash(["pip"], root=tmp_path) == first
    assert images.source_hash(["other pip"], root=tmp_path) != first
    (tmp_path / "services" / "a.py").write_text("a = 2\n")
    assert images.source_hash(["pip"], root=tmp_path) != first
