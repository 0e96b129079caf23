"""`skiff auth-callout` refuses to start, with one line naming what to fix, on a missing or bad
signing key and an unreachable API server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nkeys
import pytest

from services.auth_callout import nats_jwt
from services.launcher import free_port

pytestmark = pytest.mark.e2e  # runs `skiff auth-callout`

ROOT = Path(__file__).resolve().parents[2]


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}", insecure-skip-tls-verify: true}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: c, context: {{cluster: c, user: u}}}}]
current-context: c
"""
    )
    return path


def _start(*args: str, usage: bool = False) -> str:
    """The callout's one line on stderr (after argparse's usage, for a usage error); it must
    have exited with an error."""
    cmd = [sys.executable, "-m", "services.cli", "auth-callout", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stderr
    lines = done.stderr.strip().splitlines()
    if usage:
        assert lines[0].startswith("usage: skiff auth-callout")
        lines = lines[-1:]
    (line,) = lines
    return line


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (None, "--signing-key-file .*missing.nk: .*No such file"),
        ("garbage", "--signing-key-file .*: not an nkey seed"),
        ("user", "--signing-key-file .*: not an account seed"),
    ],
)
def test_a_missing_or_bad_signing_key(tmp_path, key, expected):
    path = tmp_path / "missing.nk"
    if key == "garbage":
        path = tmp_path / "garbage.nk"
        path.write_text("SAnot-a-seed\n")
    elif key == "user":
        path = tmp_path / "user.nk"
        path.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    line = _start("--signing-key-file", str(path), "--kubeconfig", str(tmp_path / "none"))
    assert line.startswith("skiff auth-callout: ")
    assert re.search(expected, line), line


def test_an_unreachable_api_server(tmp_path):
    key = tmp_path / "signing.nk"
    key.write_text(nats_jwt.new_account_seed())
    kubeconfig = _kubeconfig(tmp_path, f"https://127.0.0.1:{free_port()}")
    line = _start("--signing-key-file", str(key), "--kubeconfig", str(kubeconfig))
    assert line.startswith("skiff auth-callout: API server unreachable"), line
    assert "create tokenreviews" in line


def test_no_signing_key_flag():
    assert "--signing-key-file is required" in _start(usage=True)
