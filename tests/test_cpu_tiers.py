"""The CPU tiers of kvchat's kernels (kvchat/native/tiers.py): which one a CPU runs and how
KVCHAT_CPU_TIER forces a lower one; the kernel tests and the greedy text tests again at every other tier
this machine runs (each in a process of its own: a process loads one tier); and the Arm64 tier, which
no machine here runs: its sources compiled for aarch64 with a cross compiler, and its arithmetic
(kvchat/native/neon_linear.h) checked against a float64 reference under qemu-user."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvchat.errors import ConfigError
from kvchat.native import kernels, tiers

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "kvchat" / "native"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
NO_CROSS = f"needs {CROSS} (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu)"
NO_QEMU = f"needs {QEMU} (Debian/Ubuntu: apt-get install qemu-user)"
KERNEL_TESTS = [
    "tests/test_bf16_linear.py",
    "tests/test_fp32_linear.py",
    "tests/test_quantized_kernels.py",
    "tests/test_decode_layer_ops.py",
    "tests/test_paged_decode_kernel.py",
    "tests/test_batch_invariance.py",
]
GREEDY_TESTS = ["tests/test_smollm2.py", "tests/test_exact_end_to_end.py"]


def on_x86(monkeypatch, *flags: str) -> None:
    monkeypatch.setattr(tiers.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(tiers, "cpu_flags", lambda: frozenset(flags))


def test_the_highest_tier_the_cpu_has_is_chosen(monkeypatch) -> None:
    monkeypatch.delenv(tiers.ENV, raising=False)
    on_x86(monkeypatch, "avx2", "fma", "f16c")
    assert tiers.available() == ("portable", "avx2") and tiers.choose() == "avx2"
    on_x86(monkeypatch, "avx2", "fma", "f16c", *tiers.NEEDS["avx512"])
    assert tiers.choose() == "avx512"
    on_x86(monkeypatch, "sse4_2")
    assert tiers.choose() == "portable"
    monkeypatch.setattr(tiers.platform, "machine", lambda: "aarch64")
    assert tiers.available() == ("portable", "neon") and tiers.choose() == "neon"


def test_the_environment_forces_a_lower_tier_and_a_higher_one_is_refused_in_one_line(monkeypatch) -> None:
    on_x86(monkeypatch, "avx2", "fma", "f16c")
    monkeypatch.setenv(tiers.ENV, "portable")
    assert tiers.choose() == "portable"
    assert tiers.choose("AVX2 ") == "avx2" and tiers.choose("auto") == "avx2"
    refusal = r"KVCHAT_CPU_TIER=avx512: this CPU cannot run it; it runs portable, avx2$"
    with pytest.raises(ConfigError, match=refusal):
        tiers.choose("avx512")
    with pytest.raises(ConfigError, match="KVCHAT_CPU_TIER=sse is not a tier"):
        tiers.choose("sse")


def test_each_tier_compiles_with_its_own_flags_not_the_machines() -> None:
    assert "-march=native" not in {flag for tier in tiers.TIERS for flag in tiers.flags(tier)}
    assert {"-mavx2", "-mfma"} <= set(tiers.flags("avx2")) and "-mavx512f" not in tiers.flags("avx2")
    assert kernels.linear_library("portable") is None
    linears = [kernels.linear_library(t) for t in tiers.TIERS[1:]]
    names = {kernels.core_library(t).name for t in tiers.TIERS} | {lib.name for lib in linears if lib}
    assert len(names) == 2 * len(tiers.TIERS) - 1  # each tier's libraries in folders of their own


def test_the_tier_in_use_is_the_one_chosen() -> None:
    assert kernels.tier() == tiers.choose()
    if kernels.built() and kernels.tier() != "portable":
        assert kernels.linears_built() and kernels.bf16_linear() is not None


def run_tests_at(tier: str, paths: list[str]) -> None:
    env = dict(os.environ, **{tiers.ENV: tier})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    tail = "\n".join(done.stdout.splitlines()[-15:])
    assert done.returncode == 0, f"at the {tier} tier:\n{tail}\n{done.stderr[-2000:]}"
    assert " passed" in tail


OTHER_TIERS = [tier for tier in tiers.available() if tier != tiers.choose()]


@pytest.mark.slow
@pytest.mark.skipif(not kernels.has_cpp_compiler(), reason="the kernels are built with a C++ compiler")
@pytest.mark.parametrize("tier", OTHER_TIERS)
def test_the_kernel_tests_pass_at_every_other_tier_this_cpu_runs(tier: str) -> None:
    run_tests_at(tier, KERNEL_TESTS)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.has_cpp_compiler(), reason="the kernels are built with a C++ compiler")
@pytest.mark.parametrize("tier", OTHER_TIERS)
def test_the_greedy_text_tests_pass_at_every_other_tier_this_cpu_runs(tier: str) -> None:
    run_tests_at(tier, GREEDY_TESTS)


def torch_includes() -> list[str]:
    torch_dir = Path(torch.__file__).resolve().parent
    api = torch_dir / "include/torch/csrc/api/include"
    return ["-isystem", str(torch_dir / "include"), "-isystem", str(api)]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(CROSS) is None, reason=NO_CROSS)
@pytest.mark.parametrize("source", [*kernels.CORE_SOURCES, *tiers.SOURCES["neon"]])
def test_the_portable_and_neon_sources_compile_for_aarch64(source: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            CROSS,
            "-std=c++20",
            "-O2",
            "-fPIC",
            *torch_includes(),
            "-c",
            str(NATIVE / source),
            "-o",
            str(tmp_path / "x.o"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    symbols = subprocess.run(["nm", "-C", str(tmp_path / "x.o")], capture_output=True, text=True).stdout
    if source in tiers.SOURCES["neon"]:  # compiled in, not skipped by its guard
        assert "kvchat_neon" in symbols or "int4_linear" in symbols


@pytest.mark.skipif(shutil.which(CROSS) is None, reason=NO_CROSS)
@pytest.mark.skipif(shutil.which(QEMU) is None, reason=NO_QEMU)
def test_the_neon_arithmetic_matches_float64_under_qemu(tmp_path: Path) -> None:
    program = tmp_path / "neon_check"
    built = subprocess.run(
        [
            CROSS,
            "-std=c++20",
            "-O2",
            "-static",
            f"-I{NATIVE}",
            str(ROOT / "tests/native/neon_check.cpp"),
            "-o",
            str(program),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    emulated = [QEMU, "-L", "/usr/aarch64-linux-gnu", str(program)]
    done = subprocess.run(emulated, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 12 and all(line.startswith("ok ") for line in lines), done.stdout
