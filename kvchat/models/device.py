"""Device, dtype and CPU thread choices."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

from kvchat.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = Path("/proc/cpuinfo")


def choose_device(name: str) -> torch.device:
    """`auto` is cuda when available, else cpu; otherwise the named device, which must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def choose_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weights dtype for `name` (auto|bf16|fp32|fp16) on `device`.

    auto is bf16 where the hardware computes it natively (CUDA with bf16, a CPU with AVX512_BF16 or
    AMX) or kvchat's kernels run bf16 weights at the memory's pace without it (the avx2 tier: its bf16
    kernel read a one-row product's weights at ~3.5x the GB/s of its fp32 kernel, and they are half
    the bytes; 4096x4096, one thread, a Zen 4 forced to avx2), else fp32. On the packaged SmolLM2
    bf16 scores the same perplexity as fp32 and prefills ~2.5x faster (scripts/bench_dtype.py). fp16
    on a CPU is slow: only an explicit request gets it.
    """
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ConfigError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and (cpu_has_native_bf16() or cpu_bf16_kernels()):
        return torch.bfloat16
    return torch.float32


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 instructions (torch's capability string stops at "AVX512")."""
    return any(flag in _cpu_flags() for flag in _CPU_BF16_FLAGS)


def cpu_bf16_kernels() -> bool:
    """Whether kvchat's kernels of this CPU's tier (kvchat/native/tiers.py) run bf16 weights without
    bf16 instructions: the avx2 tier's, where a C++ compiler can build them."""
    from kvchat.native import tiers

    compiler = os.environ.get("CXX") or "c++"
    return tiers.chosen() == tiers.AVX2 and shutil.which(compiler) is not None


def describe_runtime(model_id: str, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """What the model settings resolved to in this process (`auto` dtype and device, 0 threads)."""
    return {
        "model.model": model_id,
        "model.dtype": DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        "model.device": str(device),
        "model.threads": str(torch.get_num_threads()),
    }


def apply_threads(num_threads: int) -> int:
    """Set torch's CPU thread count (0 = automatic) and return the count used. More threads than the
    CPUs this process may run on is refused: they only wait for each other (and tens of thousands
    crash OpenMP)."""
    if num_threads < 0:
        raise ConfigError(f"threads must be >= 0, not {num_threads}")
    cpus = num_cpus()
    if num_threads > cpus:
        raise ConfigError(
            f"--threads {num_threads}: kvchat may run on {cpus} CPU{'s' if cpus > 1 else ''} here; "
            f"give at most {cpus}, or 0 to pick"
        )
    # SmolLM2 decode on 2 cores (scripts/bench_threads.py): in kvchat's engine a 2nd thread gains nothing,
    # one already reading at the memory's pace; through the module forward it was 5-10x slower when
    # another process wanted a core. Rule: all physical cores but one, at least 1.
    count = num_threads or max(1, num_physical_cores() - 1)
    torch.set_num_threads(count)
    return count


def num_cpus() -> int:
    """The CPUs this process may run on (hyper-threads counted each)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def num_physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads counted once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    cores: set[tuple[str, str]] = set()
    processor, physical_id = None, "0"
    for line in _read_cpuinfo().splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "processor":
            processor, physical_id = int(value), "0"
        elif key == "physical id":
            physical_id = value
        elif key == "core id" and (not allowed or processor in allowed):
            cores.add((physical_id, value))
    return len(cores) or len(allowed) or os.cpu_count() or 1


def _cpu_flags() -> set[str]:
    for line in _read_cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _read_cpuinfo() -> str:
    try:
        return _CPUINFO.read_text()
    except OSError:
        return ""


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation can take now: free GPU memory, or the kernel's MemAvailable estimate."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
