"""The llama.cpp peer of `make bench` without llama.cpp: command lines, llama-bench's JSON,
slot sizing, core counting and the ratio lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import llamacpp
from bench.roofline import cpu_summary

LLAMA = llamacpp.LlamaCpp(
    server=Path("/c/bin/llama-server"), bench=Path("/c/bin/llama-bench"), gguf=Path("/c/m.gguf")
)

# Shape of `llama-bench -o json` (fields trimmed): one object per test.
BENCH_JSON = json.dumps(
    [
        {"model_type": "llama ?B all F32", "n_threads": 2, "n_prompt": 512, "n_gen": 0,
         "avg_ts": 310.5, "stddev_ts": 4.0},
        {"model_type": "llama ?B all F32", "n_threads": 1, "n_prompt": 0, "n_gen": 64,
         "avg_ts": 30.5, "stddev_ts": 0.5, "samples_ts": [30.25, 30.75]},
        {"model_type": "llama ?B all F32", "n_threads": 2, "n_prompt": 0, "n_gen": 64,
         "avg_ts": 49.125, "stddev_ts": 0.5, "samples_ts": [49.0, 49.25]},
    ]
)  # fmt: skip


def test_cache_dir_follows_the_skiff_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SKIFF_CACHE_DIR", str(tmp_path))
    assert llamacpp.cache_dir("0.3.36") == tmp_path / "llama.cpp" / "0.3.36"


def test_build_commands_release_native_no_network_two_targets():
    configure = llamacpp.configure_command(Path("/s"), Path("/b"))
    assert configure[:5] == ["cmake", "-S", "/s", "-B", "/b"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"):
        assert flag in configure
    build = llamacpp.build_command(Path("/b"), jobs=2)
    assert build[-3:] == ["--target", "llama-server", "llama-bench"]
    assert "-j2" in build
    download = llamacpp.download_command("0.3.36", Path("/d"))
    assert download[-3:] == ["llama-cpp-python==0.3.36", "-d", "/d"]
    assert download[download.index("--no-binary") + 1] == ":all:"


def test_convert_to_f32_gguf_with_llama_cpps_converter():
    cmd = llamacpp.convert_command(Path("/s"), Path("/m"), Path("/o.gguf"))
    assert cmd[1:3] == ["/s/convert_hf_to_gguf.py", "/m"]
    assert cmd[cmd.index("--outtype") + 1] == "f32"
    assert cmd[-1] == "/o.gguf"
    q8 = llamacpp.convert_command(Path("/s"), Path("/m"), Path("/q.gguf"), outtype="q8_0")
    assert q8[q8.index("--outtype") + 1] == "q8_0"


def test_prepare_converts_each_outtype_once_to_its_own_file(monkeypatch, tmp_path):
    monkeypatch.setenv("SKIFF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llamacpp, "_build", lambda root, version, jobs: Path("/s"))
    converted = []

    def convert(cmd, log, env=None):
        converted.append(cmd[cmd.index("--outtype") + 1])
        Path(cmd[-1]).write_text("gguf")

    monkeypatch.setattr(llamacpp, "_run", convert)
    root = tmp_path / "llama.cpp" / "0.3.36"
    f32 = llamacpp.prepare(Path("/m/SmolLM2"), "0.3.36")
    q8 = llamacpp.prepare(Path("/m/SmolLM2"), "0.3.36", outtype="q8_0")
    again = llamacpp.prepare(Path("/m/SmolLM2"), "0.3.36", outtype="q8_0")
    assert (f32.gguf, q8.gguf, again.gguf) == (
        root / "SmolLM2-f32.gguf",
        root / "SmolLM2-q8_0.gguf",
        root / "SmolLM2-q8_0.gguf",
    )
    assert converted == ["f32", "q8_0"]  # cached: the second q8_0 converts nothing
    assert q8.bench == root / "build" / "bin" / "llama-bench"


def test_completion_request_asks_for_greedy_token_ids_without_the_prompt_cache():
    body = llamacpp.completion_request([1, 2, 3], 16, ignore_eos=False)
    assert body == {
        "prompt": [1, 2, 3],
        "n_predict": 16,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": False,
        "cache_prompt": False,
        "return_tokens": True,
    }
    assert llamacpp.completion_request([1], 4, ignore_eos=True)["ignore_eos"] is True


def test_completion_response_tokens():
    # Shape of a non-streamed /completion response (tools/server, fields trimmed).
    body = {"index": 0, "content": " the", "tokens": [260, 30, 2], "stop": True,
            "tokens_predicted": 3, "stop_type": "eos"}  # fmt: skip
    assert llamacpp.completion_tokens(json.dumps(body)) == [260, 30, 2]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("not json", "has no tokens"),
        ('{"content": "x"}', "has no tokens"),
        ('["tokens"]', "has no tokens"),
        ('{"tokens": [1, "x"]}', "not token ids"),
    ],
)
def test_completion_response_without_token_ids_is_a_clear_error(text, error):
    with pytest.raises(ValueError, match=error):
        llamacpp.completion_tokens(text)


def test_server_context_holds_every_slots_longest_request():
    prompts, outputs = [[1] * 256, [1] * 16], [128, 16]
    per_slot = llamacpp.ctx_per_slot(prompts, outputs)
    assert per_slot == 384
    assert llamacpp.ctx_per_slot([[1] * 257], [128]) == 448  # rounded up to 64
    cmd = llamacpp.server_command(LLAMA, port=8123, slots=16, ctx_per_slot=per_slot, threads=2)
    value = lambda flag: cmd[cmd.index(flag) + 1]  # noqa: E731
    assert cmd[0] == "/c/bin/llama-server"
    assert value("-m") == "/c/m.gguf"
    assert [value(f) for f in ("-np", "-c", "-t", "--port")] == ["16", "6144", "2", "8123"]
    assert "--cont-batching" in cmd


def test_llama_bench_single_stream_command_and_json():
    cmd = llamacpp.bench_command(LLAMA, threads=[1, 2])
    assert cmd[0] == "/c/bin/llama-bench"
    assert cmd[1:] == ["-m", "/c/m.gguf", "-p", "0", "-n", "64", "-t", "1,2", "-o", "json"]
    assert llamacpp.parse_bench_json(BENCH_JSON) == {1: 30.5, 2: 49.125}  # the pp512 test left out


@pytest.mark.parametrize(
    ("text", "error"),
    [("not json", "not JSON"), ("[]", "no text-generation"), ('[{"n_prompt": 8}]', "no text")],
)
def test_llama_bench_bad_output_is_a_clear_error(text, error):
    with pytest.raises(ValueError, match=error):
        llamacpp.parse_bench_json(text)


def test_physical_cores_count_core_ids_not_hyperthreads():
    two_cores_four_threads = "".join(
        f"processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {i % 2}\n\n" for i in range(4)
    )
    assert llamacpp.physical_cores(two_cores_four_threads) == 2
    assert llamacpp.physical_cores("processor\t: 0\n") >= 1  # no core ids: logical count


def test_ratio_lines():
    assert llamacpp.ratio_lines(85.3, 102.6, 17.7, 49.1, "unused") == [
        "throughput ratio vs llama.cpp: 0.83",
        "single-stream ratio vs llama.cpp: 0.36",
    ]


def test_ratio_lines_say_why_they_are_missing():
    missing = "cannot be built: cmake failed"
    assert llamacpp.ratio_lines(85.3, None, 17.7, None, missing) == [
        f"throughput ratio vs llama.cpp is missing: {missing}",
        f"single-stream ratio vs llama.cpp is missing: {missing}",
    ]
    assert llamacpp.ratio_lines(None, 102.6, 17.7, 49.1, "")[0] == (
        "throughput ratio vs llama.cpp is missing: --no-served"
    )


def test_cpu_summary_names_the_extensions_that_matter():
    info = "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n"
    summary = cpu_summary(info)
    assert summary["model"] == "AMD EPYC"
    assert summary["avx512_bf16"] is True
    assert summary["amx_bf16"] is False
