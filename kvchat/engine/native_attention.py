"""kvchat's attention kernels over the pool (paged_decode.cpp): `kvchat::paged_decode_attention`,
one token in the compiled graph, and `kvchat::paged_attention`, the lean step's few tokens.

One token's attention read through a gather and two small matmuls costs, per layer of SmolLM2 in bf16,
~60 us at 50 positions and ~450 us at 4,096: the gather copies the layer's K/V, the matmuls read the
copy again, and torch's products are slow at these shapes. The kernel reads each past row once where
it lies in the pool, in fp32: ~7 and ~160-190 us.

It is built at first use with the machine's C++ compiler (`torch.utils.cpp_extension`, ~10 s) for this
CPU (`-march=native`), and cached by torch under a name that carries the CPU's features, so a cache
shared between machines never serves one CPU another's build. Where it cannot be built, decode
attention gathers the K/V instead; `build_error()` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch

SOURCE = "paged_decode.cpp"
FLAGS = ["-O3", "-march=native"]
DTYPES = frozenset({torch.float32, torch.bfloat16})


def paged_decode_attention() -> Callable | None:
    """The one-token op, or None where the kernels cannot be built (see `build_error`)."""
    return torch.ops.kvchat.paged_decode_attention if _build()[0] else None


def paged_attention() -> Callable | None:
    """The few-tokens op, or None where the kernels cannot be built (see `build_error`)."""
    return torch.ops.kvchat.paged_attention if _build()[0] else None


def build_error() -> str | None:
    """Why the kernels could not be built, in one line; None when they were."""
    return _build()[1]


def takes(pool_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels serve a pool of this dtype on this device."""
    return device.type == "cpu" and pool_dtype in DTYPES


def for_pool(pool_dtype: torch.dtype, device: torch.device) -> Callable | None:
    """The few-tokens op for a pool of this dtype on this device (building it if need be), or None."""
    return paged_attention() if takes(pool_dtype, device) else None


def gather_reason(pool_dtype: torch.dtype, device: torch.device) -> str:
    """Why a pool of this dtype on this device is attended by gathering, in a few words."""
    if not takes(pool_dtype, device):
        return f"kvchat's kernel takes no {str(pool_dtype).removeprefix('torch.')} pool on {device.type}"
    return build_error() or "kvchat's kernel is built"


@functools.cache
def _build() -> tuple[bool, str | None]:
    """Whether the kernels are built and registered, and if not, why."""
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        source = resources.files("kvchat.engine").joinpath(SOURCE)
        with resources.as_file(source) as path:
            cpp_extension.load(
                name=f"kvchat_paged_decode_{_cpu_tag()}",
                sources=[str(path)],
                extra_cflags=FLAGS,
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # a missing compiler or ninja, a failed build: attention gathers instead
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return False, f"{type(error).__name__}: {first_line}"
    _register_fakes()
    return True, None


def _register_fakes() -> None:
    """Output shapes for torch.compile's tracing: the query's, in fp32."""

    @torch.library.register_fake("kvchat::paged_decode_attention")
    def _(query, own_keys, own_values, keys, values, layer, slots, scale):
        return query.new_empty(query.shape, dtype=torch.float32)

    @torch.library.register_fake("kvchat::paged_attention")
    def _(query, keys, values, layer, slots, num_new, scale):
        return query.new_empty(query.shape, dtype=torch.float32)


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a virtual environment that was not activated has the ninja
    package's binary off it."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _cpu_tag() -> str:
    """A short hash of what -march=native compiles for: the machine type and its CPU's feature flags."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]
