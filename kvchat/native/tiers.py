"""Which tier of kvchat's kernels this CPU runs, chosen once a process.

A tier is a set of linear kernels (bf16, fp32, int8, int4) built for one instruction set, each in a
library of its own, so a tier that fails to build takes no other down:
- `avx512`: x86 with AVX-512 (F, BW, VL, BF16, VNNI), and AMX's tiles where the CPU has them;
- `avx2`: x86 with AVX2, FMA and F16C (every x86 laptop and desktop CPU since about 2015);
- `neon`: Arm64 (NEON is part of every aarch64 CPU);
- `portable`: no linear kernels of kvchat's: linears run torch's own (oneDNN's, MKL's).
The kernels every tier shares (attention over the pool, the decoder-layer op, rescore) are plain C++
compiled with the tier's flags; with `portable` with none beyond -O3.

The highest tier the CPU has is used; `KVCHAT_CPU_TIER` forces a lower one (tests reach every path
with it, as torchao's TORCHAO_CPU_DISPATCH). A tier the CPU lacks is refused in one line.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from kvchat.errors import ConfigError

ENV = "KVCHAT_CPU_TIER"
PORTABLE, AVX2, AVX512, NEON = "portable", "avx2", "avx512", "neon"
TIERS = (PORTABLE, AVX2, AVX512, NEON)
# what each tier needs of the CPU (its /proc/cpuinfo flags), and compiles with
NEEDS = {
    AVX2: ("avx2", "fma", "f16c"),
    AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
}
FLAGS = {
    PORTABLE: ("-O3",),
    AVX2: ("-O3", "-mtune=native", "-mavx2", "-mfma", "-mf16c"),
    AVX512: (
        "-O3",
        "-mtune=native",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512bf16",
        "-mavx512vnni",
    ),
    NEON: ("-O3",),
}
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")  # with avx512, where the CPU has AMX's tiles
# each tier's linear sources, in kvchat/native
SOURCES = {
    AVX2: ("fp32_linear_avx2.cpp", "bf16_linear_avx2.cpp", "quantized_linear_avx2.cpp"),
    AVX512: ("fp32_linear.cpp", "bf16_linear.cpp", "quantized_linear.cpp"),
    NEON: ("linear_neon.cpp",),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is no such file)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    lines = cpuinfo.read_text().splitlines()
    line = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def available() -> tuple[str, ...]:
    """The tiers this CPU can run, lowest first."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return (PORTABLE, NEON)
    if machine not in ("x86_64", "amd64"):
        return (PORTABLE,)
    flags = cpu_flags()
    found = [PORTABLE]
    for tier in (AVX2, AVX512):
        if all(flag in flags for flag in NEEDS[tier]) and all(flag in flags for flag in NEEDS[AVX2]):
            found.append(tier)
    return tuple(found)


def choose(requested: str | None = None) -> str:
    """The tier to run: `requested` (else $KVCHAT_CPU_TIER) where this CPU has it, else the highest."""
    wanted = (requested if requested is not None else os.environ.get(ENV, "")).strip().lower()
    tiers = available()
    if wanted in ("", "auto"):
        return tiers[-1]
    if wanted not in TIERS:
        raise ConfigError(f"{ENV}={wanted} is not a tier: use one of auto, {', '.join(TIERS)}")
    if wanted not in tiers:
        raise ConfigError(f"{ENV}={wanted}: this CPU cannot run it; it runs {', '.join(tiers)}")
    return wanted


@functools.cache
def chosen() -> str:
    """This process's tier (decided once: the libraries it loads cannot be unloaded)."""
    return choose()


def flags(tier: str) -> tuple[str, ...]:
    """What the tier's sources are compiled with on this CPU."""
    amx = tier == AVX512 and {"amx_tile", "amx_bf16"} <= cpu_flags()
    return FLAGS[tier] + (AMX_FLAGS if amx else ())


def describe() -> str:
    """The tier in use and why, in a few words, for /info: "avx2 (forced by KVCHAT_CPU_TIER; this CPU
    runs up to avx512)", "avx512 (the highest this CPU runs)"."""
    tier, highest = chosen(), available()[-1]
    if tier == highest:
        return f"{tier} (the highest this CPU runs)"
    return f"{tier} (forced by {ENV}; this CPU runs up to {highest})"
