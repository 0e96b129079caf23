"""`make bench`'s CPU naming: /proc/cpuinfo parsed into vendor, family numbers and extensions,
the family slug that names the results files, the `cpu:` line printed with the ratios and
the copy of the printed lines kept for the .txt."""

from __future__ import annotations

import pytest

from bench import roofline

pytestmark = pytest.mark.unit

AMX = "avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN4 = "avx2 fma avx512f avx512_vnni avx512_bf16 avx512ifma"


def cpuinfo(vendor: str, family: int, model: int, name: str, flags: str, cpus: int = 2) -> str:
    """/proc/cpuinfo of `cpus` identical processors (the fields the bench reads, in order)."""
    one = (
        f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        f"model name\t: {name}\nstepping\t: 1\nflags\t\t: fpu sse sse2 {flags}\n\n"
    )
    return "".join(one.format(i) for i in range(cpus))


SAPPHIRE_RAPIDS = cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8481C", AMX)
GENOA = cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC 9B14", ZEN4)
MILAN = cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC 7B13 64-Core Processor", "avx2 fma")


@pytest.mark.parametrize(
    ("info", "slug"),
    [
        (SAPPHIRE_RAPIDS, "intel-xeon-amx"),
        (cpuinfo("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Processor", AMX), "intel-xeon-amx"),
        (
            cpuinfo("GenuineIntel", 6, 85, "Intel(R) Xeon(R) Gold 6148", "avx2 fma avx512f"),
            "intel-xeon-avx512",
        ),
        (GENOA, "amd-epyc-zen4-avx512"),
        (cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC", ZEN4), "amd-epyc-zen4-avx512"),
        (cpuinfo("AuthenticAMD", 25, 17, "AMD EPYC", "avx2 fma"), "amd-epyc-zen4-avx2"),  # VM
        (MILAN, "amd-epyc-zen3-avx2"),
        (
            cpuinfo("AuthenticAMD", 23, 49, "AMD EPYC 7502P 32-Core", "avx2 fma"),
            "amd-epyc-zen2-avx2",
        ),
        (cpuinfo("AuthenticAMD", 26, 2, "AMD EPYC 9755 128-Core", ZEN4), "amd-epyc-zen5-avx512"),
        (cpuinfo("AuthenticAMD", 25, 97, "AMD Ryzen 9 7950X", ZEN4), "amd-ryzen-zen4-avx512"),
        ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n", "unknown-cpu-base"),
    ],
)
def test_family_slug_names_vendor_brand_generation_and_widest_extensions(
    info: str, slug: str
) -> None:
    cpu = roofline.cpu_summary(info)
    assert roofline.family_slug(cpu) == slug
    assert roofline.results_path(cpu, ".json").name == f"cpu-{slug}.json"
    assert roofline.results_path(cpu, ".txt").parent.name == "results"


def test_cpu_summary_reads_the_first_processor() -> None:
    cpu = roofline.cpu_summary(GENOA + cpuinfo("GenuineIntel", 6, 143, "Xeon", AMX, cpus=1))
    assert cpu == {
        "model": "AMD EPYC 9B14",
        "vendor": "AuthenticAMD",
        "family": 25,
        "model_number": 17,
        "avx2": True,
        "fma": True,
        "avx512f": True,
        "avx512_vnni": True,
        "avx512_bf16": True,
        "amx_bf16": False,
        "amx_int8": False,
    }
    assert roofline.cpu_summary("")["family"] is None


def test_cpu_line_names_the_cpu_extensions_and_kernel_isas() -> None:
    isas = ("avx512", "avx512_vnni", "avx512_bf16")
    line = roofline.cpu_line(roofline.cpu_summary(SAPPHIRE_RAPIDS), isas)
    assert line == (
        "cpu: Intel(R) Xeon(R) Platinum 8481C (GenuineIntel, family 6 model 143; family "
        "intel-xeon-amx), extensions: avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 "
        "amx_int8; skiff kernels avx512, int8 dot avx512_vnni, bf16 dot avx512_bf16"
    )
    line = roofline.cpu_line(roofline.cpu_summary(MILAN), (None, None, None))
    assert line.endswith("extensions: avx2 fma; skiff C++ kernels off")
    assert "family amd-epyc-zen3-avx2" in line


def test_cpu_line_here_names_the_isa_the_loaded_ops_picked() -> None:
    from kernels import cpu_ops

    line = roofline.cpu_line()
    if cpu_ops.load():
        want = f"skiff kernels {cpu_ops.isa()}, int8 dot {cpu_ops.int8_dot_isa()}, bf16 dot "
        assert f"{want}{cpu_ops.bf16_dot_isa()}" in line
    else:
        assert line.endswith("skiff C++ kernels off")


def test_tee_prints_and_keeps_what_it_printed_for_the_txt() -> None:
    import contextlib
    import io

    from bench.bench import Tee

    terminal = io.StringIO()
    printed = Tee(terminal)
    with contextlib.redirect_stdout(printed):
        print("cpu: AMD EPYC")
        print("throughput ratio vs transformers: 3.45")
    assert terminal.getvalue() == printed.text.getvalue()
    assert printed.text.getvalue() == "cpu: AMD EPYC\nthroughput ratio vs transformers: 3.45\n"
