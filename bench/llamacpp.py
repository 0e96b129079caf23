"""llama.cpp as a peer in `make bench`: build, convert, serve, measure.

`llama-server` and `llama-bench` are built once with cmake from the llama.cpp vendored in the
`llama-cpp-python` sdist (PyPI) and cached under `<cache>/llama.cpp/<version>/`, next to GGUFs
of our model written by llama.cpp's own `convert_hf_to_gguf.py` (F32, and BF16 / Q8_0 for
bench/precision.py). `prepare` raises `LlamaCppUnavailable` with the reason when any step
fails, so the caller can skip the peer.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.arith import cdiv
from shared.default_model import cache_root

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp could not be built, converted for or started on this machine."""


@dataclass(frozen=True)
class LlamaCpp:
    server: Path
    bench: Path
    gguf: Path


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / "llama.cpp" / version


def physical_cores(cpuinfo: str | None = None) -> int:
    """Distinct (socket, core) pairs in /proc/cpuinfo; the logical CPU count if it has none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    cores: set[tuple[str, str]] = set()
    socket = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "physical id":
            socket = value.strip()
        elif key.strip() == "core id":
            cores.add((socket, value.strip()))
    return len(cores) or os.cpu_count() or 1


def download_command(version: str, dest: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-binary",
        ":all:",
        "--no-deps",
        f"llama-cpp-python=={version}",
        "-d",
        str(dest),
    ]


def configure_command(source: Path, build: Path) -> list[str]:
    """Release, native CPU flags, static, no network features, no web UI, no tests."""
    return [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]


def build_command(build: Path, jobs: int = 2) -> list[str]:
    return [
        "cmake",
        "--build",
        str(build),
        "--config",
        "Release",
        f"-j{jobs}",
        "--target",
        *TARGETS,
    ]


def convert_command(source: Path, model_dir: Path, out: Path, outtype: str = "f32") -> list[str]:
    """`outtype`: the converter's --outtype (f32, bf16, q8_0, ...)."""
    return [
        sys.executable,
        str(source / "convert_hf_to_gguf.py"),
        str(model_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(out),
    ]


def server_command(
    llama: LlamaCpp, port: int, slots: int, ctx_per_slot: int, threads: int
) -> list[str]:
    """`-c` is split between the slots (`-np`), so each slot holds `ctx_per_slot` tokens."""
    return [
        str(llama.server),
        "-m",
        str(llama.gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "--cont-batching",
        "-t",
        str(threads),
        "-tb",
        str(threads),
    ]


def bench_command(llama: LlamaCpp, threads: list[int], new_tokens: int = 64) -> list[str]:
    """Single-stream decode only (tg<new_tokens>) at each thread count, JSON output."""
    return [
        str(llama.bench),
        "-m",
        str(llama.gguf),
        "-p",
        "0",
        "-n",
        str(new_tokens),
        "-t",
        ",".join(map(str, threads)),
        "-o",
        "json",
    ]


def parse_bench_json(text: str) -> dict[int, float]:
    """Mean decode tokens/s of each text-generation test in `llama-bench -o json` output, by
    thread count."""
    try:
        runs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON: {e}") from e
    rates = {
        int(r["n_threads"]): float(r["avg_ts"])
        for r in runs
        if isinstance(r, dict) and r.get("n_prompt") == 0 and r.get("n_gen", 0) > 0
    }
    if not rates:
        raise ValueError("llama-bench output has no text-generation (n_prompt 0) result")
    return rates


def ctx_per_slot(prompts: list[list[int]], outputs: list[int], multiple: int = 64) -> int:
    """The longest request (prompt + output), rounded up to `multiple` tokens."""
    longest = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    return cdiv(longest, multiple) * multiple


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        except OSError as e:
            raise LlamaCppUnavailable(f"{cmd[0]}: {e}") from e
    if done.returncode != 0:
        raise LlamaCppUnavailable(f"`{' '.join(cmd[:4])} ...` failed; log: {log}")


def _build(root: Path, version: str, jobs: int) -> Path:
    """The source tree's llama.cpp directory, with both targets built under root/build/bin."""
    log = root / "build.log"
    source = root / "src" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        sdist = root / "sdist"
        _run(download_command(version, sdist), log)
        archives = sorted(sdist.glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise LlamaCppUnavailable(f"no llama-cpp-python sdist in {sdist}")
        with tarfile.open(archives[0]) as tar:
            top = tar.getnames()[0].split("/")[0]
            tar.extractall(root, filter="data")
        (root / top).rename(root / "src")
    bins = [root / "build" / "bin" / t for t in TARGETS]
    if not all(b.is_file() for b in bins):
        print(f"llama.cpp: building {', '.join(TARGETS)} (once; ~15 min on 2 cores), log {log}")
        _run(configure_command(source, root / "build"), log)
        _run(build_command(root / "build", jobs), log)
    return source


def prepare(
    model_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2, outtype: str = "f32"
) -> LlamaCpp:
    """Build the binaries and convert `model_dir` to a GGUF of `outtype` (`<model>-<outtype>.gguf`),
    each only once (cached)."""
    root = cache_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    source = _build(root, version, jobs)
    gguf = root / f"{Path(model_dir).name}-{outtype}.gguf"
    if not gguf.is_file():
        tmp = gguf.with_suffix(".tmp")
        env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
        _run(convert_command(source, Path(model_dir), tmp, outtype), root / "convert.log", env)
        tmp.rename(gguf)
    bin_dir = root / "build" / "bin"
    return LlamaCpp(server=bin_dir / "llama-server", bench=bin_dir / "llama-bench", gguf=gguf)


class LlamaServer:
    """A running `llama-server` (context manager): started, waited on until /health is ok."""

    def __init__(self, cmd: list[str], port: int, log: Path, timeout_s: float = 120.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._cmd, self._log, self._timeout_s = cmd, log, timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with self._log.open("wb") as f:
            self._proc = subprocess.Popen(self._cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise LlamaCppUnavailable(f"llama-server exited early; log: {self._log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise LlamaCppUnavailable(f"llama-server not healthy in {self._timeout_s:.0f}s")

    def __exit__(self, *exc: object) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def completion_request(prompt: list[int], n_predict: int, ignore_eos: bool) -> dict[str, object]:
    """A `/completion` body for greedy token ids: the prompt as token ids (no BOS is added to
    those), temperature 0 and top-k 1 (the argmax), nothing reused from an earlier request."""
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": ignore_eos,
        "cache_prompt": False,
        "return_tokens": True,
    }


def completion_tokens(text: str) -> list[int]:
    """The generated token ids (`tokens`) of a non-streamed `/completion` response."""
    try:
        tokens = json.loads(text)["tokens"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"llama-server /completion response has no tokens: {e!r}") from e
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise ValueError(f"llama-server /completion tokens are not token ids: {tokens!r:.80}")
    return tokens


def _complete(url: str, body: dict[str, object]) -> list[int]:
    request = urllib.request.Request(
        f"{url}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            return completion_tokens(resp.read().decode())
    except (OSError, ValueError) as e:
        raise LlamaCppUnavailable(f"llama-server /completion: {e}") from e


def greedy_tokens(
    llama: LlamaCpp, requests: list[tuple[list[int], int, bool]], threads: int, log: Path
) -> list[list[int]]:
    """Greedy token ids of each (prompt ids, n_predict, ignore_eos) request from a
    `llama-server` with one slot, the requests one at a time."""
    from services.launcher import free_port

    prompts, counts = [r[0] for r in requests], [r[1] for r in requests]
    port = free_port()
    cmd = server_command(llama, port, 1, ctx_per_slot(prompts, counts), threads)
    with LlamaServer(cmd, port, log) as server:
        return [_complete(server.url, completion_request(*r)) for r in requests]


def single_stream(llama: LlamaCpp, threads: list[int], new_tokens: int = 64) -> dict[int, float]:
    """`llama-bench` tg<new_tokens> decode tokens/s at each thread count."""
    return _run_bench(bench_command(llama, threads, new_tokens), parse_bench_json, 600)


def _run_bench(
    cmd: list[str], parse: Callable[[str], dict[int, float]], timeout: float
) -> dict[int, float]:
    """Run a `llama-bench` command and parse its JSON; any failure is LlamaCppUnavailable."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppUnavailable(f"llama-bench: {e}") from e
    if done.returncode != 0:
        raise LlamaCppUnavailable(f"llama-bench failed: {done.stderr.strip()[-500:]}")
    try:
        return parse(done.stdout)
    except ValueError as e:
        raise LlamaCppUnavailable(str(e)) from e


def prefill_command(llama: LlamaCpp, threads: list[int], sizes: list[int]) -> list[str]:
    """Prefill only (pp<n> for each size, no generation) at each thread count, two
    repetitions, JSON output."""
    return [
        str(llama.bench),
        "-m",
        str(llama.gguf),
        "-p",
        ",".join(map(str, sizes)),
        "-n",
        "0",
        "-r",
        "2",
        "-t",
        ",".join(map(str, threads)),
        "-o",
        "json",
    ]


def parse_prefill_json(text: str) -> dict[int, float]:
    """Best mean prefill tokens/s of each prompt size (over thread counts) in
    `llama-bench -o json` output."""
    try:
        runs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON: {e}") from e
    rates: dict[int, float] = {}
    for r in runs:
        if isinstance(r, dict) and r.get("n_gen") == 0 and r.get("n_prompt", 0) > 0:
            n = int(r["n_prompt"])
            rates[n] = max(rates.get(n, 0.0), float(r["avg_ts"]))
    if not rates:
        raise ValueError("llama-bench output has no prompt-processing (n_gen 0) result")
    return rates


def prefill(llama: LlamaCpp, threads: list[int], sizes: list[int]) -> dict[int, float]:
    """`llama-bench` pp<n> prefill tokens/s of each size, the best thread count's."""
    return _run_bench(prefill_command(llama, threads, sizes), parse_prefill_json, 1800)


SERVER_ATTEMPTS = 2


def serve_workload(
    llama: LlamaCpp,
    prompts: list[list[int]],
    outputs: list[int],
    slot_counts: list[int],
    thread_counts: list[int],
    log_dir: Path,
) -> dict[tuple[int, int], float]:
    """Output tokens/s of `llama-server` at each (slots, threads): every request at once,
    streamed through the same client as skiff's served path, each with exactly its requested
    tokens."""
    import asyncio

    from bench.http_client import ClientError, client_session
    from bench.served import run_at, stream_completion
    from services.launcher import free_port

    per_slot = ctx_per_slot(prompts, outputs)
    rates: dict[tuple[int, int], float] = {}
    for slots, threads in itertools.product(slot_counts, thread_counts):
        for attempt in range(SERVER_ATTEMPTS):  # a server that dies mid-run gets a second go
            port = free_port()
            cmd = server_command(llama, port, slots, per_slot, threads)
            log = log_dir / f"llama-server-np{slots}-t{threads}-{attempt}.log"
            with LlamaServer(cmd, port, log) as server:

                async def run(url: str = server.url) -> float:
                    async with client_session() as client:
                        await stream_completion(client, url, prompts[0], 4)  # warm-up
                        elapsed, _ = await run_at(client, url, prompts, outputs, len(prompts))
                    return sum(outputs) / elapsed

                try:
                    rate = rates[slots, threads] = asyncio.run(run())
                    break
                except (ClientError, TimeoutError, RuntimeError) as e:
                    failure = f"llama-server -np {slots} -t {threads}: {e} (log: {log})"
                    print(f"llama.cpp attempt {attempt + 1} failed: {failure}")
        else:
            raise LlamaCppUnavailable(failure)
        print(f"llama.cpp llama-server, {slots} slots, {threads} threads: {rate:.1f} output tok/s")
    return rates


def ratio_lines(
    served: float | None,
    llama_served: float | None,
    single: float,
    llama_single: float | None,
    missing: str,
) -> list[str]:
    """The two llama.cpp lines `make bench` prints right before its last line: each ratio, or
    a note saying why it is missing (`missing`, or --no-served for the served ratio)."""
    lines = []
    if served and llama_served:
        lines.append(f"throughput ratio vs llama.cpp: {served / llama_served:.2f}")
    else:
        why = "--no-served" if llama_served else missing
        lines.append(f"throughput ratio vs llama.cpp is missing: {why}")
    if llama_single:
        lines.append(f"single-stream ratio vs llama.cpp: {single / llama_single:.2f}")
    else:
        lines.append(f"single-stream ratio vs llama.cpp is missing: {missing}")
    return lines
