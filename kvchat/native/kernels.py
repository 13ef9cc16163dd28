"""Builds and registers kvchat's C++ kernels (`torch.ops.kvchat`):
- paged_decode.cpp: attention over the paged pool that reads each past row once in place
  (`paged_attention`, `paged_attention_rows`; engine/native_attention.py and the lean decode step
  use them);
- decode_layer.cpp: a decoder layer's small steps between its products, one op each (`rms_norm`,
  `rope_write`, `silu_mul`), and every decoder layer of a model in one (`decoder_layers`);
  engine/decode_step.py uses them; and `set_batch_invariant`, whether the linear kernels keep to
  their batch-invariant paths (`set_batch_invariant` below);
- quantized_linear.cpp: int4 and int8 linear layers at the machine's read bandwidth, on CPUs with
  AVX-512 VNNI (`int4_linear`, `int8_linear`; models/quantized_linears.py uses them);
- bf16_linear.cpp: the bf16 linear layer at the machine's read bandwidth, on CPUs with AVX-512 BF16,
  several rows (prefill, speculation's drafts) on AMX's tiles where the CPU has them and batch
  invariance is off (`bf16_linear`; engine/bf16_linears.py's TiledLinear uses it);
- fp32_linear.cpp: the fp32 linear layer, one order of sums for any number of rows, on CPUs with
  AVX-512 (`fp32_linear`; TiledLinear over fp32 tiles uses it);
- rescore.cpp: the highest logits of a rescored output layer computed again from the exact weight
  (`rescore_top`; models/rescored_head.py uses it).

They are built at first use with the machine's C++ compiler (`torch.utils.cpp_extension`, ~25 s) for
this CPU (`-march=native`), and cached by torch under a name that carries the CPU's features, so a
cache shared between machines never serves one CPU another's build, and the sources' folder, so two
copies of kvchat on one machine (a checkout and a clone of it) keep a build each instead of rebuilding
over each other. Where they cannot be built, attention gathers the K/V, quantized layers run torch's
own kernels and bf16 ones oneDNN's; `build_error()` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

import torch

SOURCES = (
    "paged_decode.cpp",
    "decode_layer.cpp",
    "quantized_linear.cpp",
    "bf16_linear.cpp",
    "fp32_linear.cpp",
    "rescore.cpp",
)
FLAGS = ["-O3", "-march=native"]
LOADING = "Loading kvchat's kernels (built at the first start on a machine, ~25 s)"  # for progress


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on PATH ($CXX, g++ or clang++), which building the kernels needs."""
    return any(shutil.which(name) for name in (os.environ.get("CXX") or "g++", "clang++"))


def built() -> bool:
    """Whether the kernels are built and registered (building them if need be)."""
    return _build()[0]


def build_error() -> str | None:
    """Why the kernels could not be built, in one line; None when they were."""
    return _build()[1]


def int4_linear() -> Callable | None:
    """`kvchat::int4_linear`, or None where it is not built: no compiler, or no AVX-512 VNNI."""
    return _cpu_specific_op("int4_linear")


def int8_linear() -> Callable | None:
    """`kvchat::int8_linear`, or None where it is not built: no compiler, or no AVX-512 VNNI."""
    return _cpu_specific_op("int8_linear")


def bf16_linear() -> Callable | None:
    """`kvchat::bf16_linear`, or None where it is not built: no compiler, or no AVX-512 BF16."""
    return _cpu_specific_op("bf16_linear")


def fp32_linear() -> Callable | None:
    """`kvchat::fp32_linear`, or None where it is not built: no compiler, or no AVX-512."""
    return _cpu_specific_op("fp32_linear")


def set_batch_invariant(on: bool) -> None:
    """Whether the linear kernels keep to their batch-invariant paths, process-wide (where the kernels
    are built): on, a row's outputs are the same bits whatever rows come with it; off, several rows may
    go to AMX's tiles where the CPU has them, faster, in another order of sums."""
    if built():
        torch.ops.kvchat.set_batch_invariant(on)


def rescore_top() -> Callable | None:
    """`kvchat::rescore_top`, or None where the kernels are not built."""
    return torch.ops.kvchat.rescore_top if built() else None


def _cpu_specific_op(name: str) -> Callable | None:
    # the linear kernels are registered only when compiled for the instructions they need
    return getattr(torch.ops.kvchat, name, None) if built() else None


@functools.cache
def _build() -> tuple[bool, str | None]:
    """Whether the kernels are built and registered, and if not, why."""
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        with ExitStack() as stack:
            folder = resources.files("kvchat.native")
            paths = [str(stack.enter_context(resources.as_file(folder.joinpath(name)))) for name in SOURCES]
            cpp_extension.load(
                name=f"kvchat_kernels_{_build_tag(Path(paths[0]).parent)}",
                sources=paths,
                extra_cflags=FLAGS,
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # a missing compiler or ninja, a failed build
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return False, f"{type(error).__name__}: {first_line}"
    return True, None


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


def _build_tag(sources: Path) -> str:
    """A short hash of what -march=native compiles for (the machine type and its CPU's feature flags)
    and of where the sources are."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(f"{platform.machine()} {flags} {sources.resolve()}".encode()).hexdigest()[:12]
