"""Builds and registers kvchat's C++ kernels (`torch.ops.kvchat`): the one seam the engine and the
linear layers ask, none of them checking a build. Where torch computes the same thing, the op runs with
its fallback beside it (`rms_norm`, `rescore`); where the fallback is another layout or another path
(the linear layers' weights, attention by gather, the decoder layers looped in Python), it gives the op
or None and the caller keeps its other path. Every tier builds:
- paged_decode.cpp: attention over the paged pool that reads each past row once in place
  (`paged_attention`, `paged_attention_rows`; engine/native_attention.py and the lean decode step
  use them);
- decode_layer.cpp: a decoder layer's small steps between its products, one op each (`rms_norm`,
  `rope_write`, `silu_mul`), and every decoder layer of a model in one (`decoder_layers`);
  engine/decode_step.py uses them;
- rescore.cpp: the highest logits of a rescored output layer computed again from the exact weight
  (`rescore_top`; linears/rescored_head.py runs it through `rescore`).
And each tier its linear layers (`bf16_linear`, `fp32_linear`, `int8_linear`, `int4_linear`; the
layers of kvchat/linears use them), at the machine's read bandwidth for one row of input, one order
of sums for any number of rows:
- avx512: bf16_linear.cpp (AVX-512 BF16; several rows on AMX's tiles where the CPU has them and batch
  invariance is off, `set_batch_invariant`), fp32_linear.cpp, quantized_linear.cpp (AVX-512 VNNI);
- avx2: the *_avx2.cpp files (AVX2, FMA), on the same tiles;
- neon: linear_neon.cpp over neon_linear.h (Arm64), on the same tiles.

They are compiled, once, with the machine's C++ compiler into two libraries for the CPU's tier
(kvchat/native/tiers.py): the first three sources, plain C++, make the one every start loads (compiled
with the tier's flags); the tier's linear kernels make the second (none with the `portable` tier).
A first start builds them in a process of its own while the model loads (kvchat/native/build.py,
runner.py); later starts load the libraries they left after checking them whole. Where they cannot be
built (no compiler, a build that failed), attention gathers the K/V, quantized layers run torch's own
kernels and bf16 ones oneDNN's; `build_error()` says why, and `status()` says it for /info with what
to install. A linear library that fails leaves the first one working, and the other way round.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from kvchat.native import tiers
from kvchat.native.build import BUILDING, Build, Library, Progress, plan

CORE_SOURCES = ("paged_decode.cpp", "decode_layer.cpp", "rescore.cpp")
NATIVE_DTYPES = frozenset({torch.float32, torch.bfloat16})  # what the core ops take


@functools.cache
def core_library(tier: str) -> Library:
    """The kernels every start loads, compiled with the tier's flags."""
    return Library(f"kernels_{tier}", CORE_SOURCES, tiers.flags(tier))


@functools.cache
def linear_library(tier: str) -> Library | None:
    """The tier's linear kernels; None for the portable tier (torch's run instead)."""
    sources, flags = tiers.SOURCES.get(tier), tiers.flags(tier)
    # with AMX's flags in a folder of its own: a cache shared with a CPU without them keeps both
    name = f"linears_{tier}" + ("_amx" if set(tiers.AMX_FLAGS) <= set(flags) else "")
    return Library(name, sources, flags) if sources else None


SOURCES = CORE_SOURCES + tuple(source for tier in tiers.TIERS for source in tiers.SOURCES.get(tier, ()))
# What decode loses without them, measured on SmolLM2-135M (bf16, one thread, Zen 4): see docs/caches.md.
COST_WITHOUT = "decode runs about 3x slower without them"
INSTALL = (
    "install a C++ compiler (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++) and start again"
)

__all__ = ["BUILDING", "built", "build_error", "failure_note", "start_build", "status", "tier"]

_builds: dict[str, Build] = {}  # each library's build in this process, once started


def tier() -> str:
    """The tier of kernels this process runs (kvchat/native/tiers.py); raises ConfigError where
    $KVCHAT_CPU_TIER asks for one this CPU cannot run."""
    return tiers.chosen()


def _libraries() -> list[Library]:
    linears = linear_library(tier())
    return [core_library(tier())] + ([linears] if linears else [])


def start_build(progress: Progress | None = None) -> None:
    """Start building the kernels of this CPU's tier in the background where they are not built yet,
    reporting to `progress`; returns at once. Asking for an op waits."""
    missing = [library for library in _libraries() if library.name not in _builds]
    if missing:
        folder = Path(str(resources.files("kvchat.native")))
        build = Build([plan(library, folder) for library in missing])
        build.start(progress)
        _builds.update((library.name, build) for library in missing)


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on PATH ($CXX, g++ or clang++), which building the kernels needs."""
    return any(shutil.which(name) for name in (os.environ.get("CXX") or "g++", "clang++"))


def built() -> bool:
    """Whether the kernels every start uses are built and registered (building them if need be)."""
    return _build()[0]


def build_error() -> str | None:
    """Why the kernels could not be built, in one line; None when they were."""
    return _build()[1]


def linears_built() -> bool:
    """Whether the tier's linear kernels are built and registered (never with the portable tier)."""
    library = linear_library(tier())
    return library is not None and built() and _load(library.name)[0]


def status() -> str:
    """The kernels' state in one line, for /info: built, or why not, what to install, what it costs."""
    error = build_error()
    if error is None:
        linears = linear_library(tier())
        if linears is None:
            return f"kvchat's, built for this CPU ({tier()} tier: linears run torch's)"
        problem = _load(linears.name)[1]
        if problem is not None:
            return f"kvchat's, built for this CPU; its {tier()} linears are not ({problem})"
        return f"kvchat's, built for this CPU ({tier()} tier)"
    if error.startswith("no C++ compiler"):
        return f"not built: {error}; {INSTALL} ({COST_WITHOUT})"
    return f"not built: {error} ({COST_WITHOUT})"


def failure_note() -> str | None:
    """The line a start tells where the kernels failed to build (a compile error, a folder it may not
    write); None where they are built, or where there is no compiler (/info says that)."""
    error = build_error()
    if error is None or error.startswith("no C++ compiler"):
        return None
    return f"kvchat's kernels are not built ({error}); running without them: {COST_WITHOUT}"


def int4_linear() -> Callable | None:
    """`kvchat::int4_linear`, or None where the tier's linears are not built (or the tier is portable)."""
    return _linear_op("int4_linear")


def int8_linear() -> Callable | None:
    """`kvchat::int8_linear`, or None where the tier's linears are not built (or the tier is portable)."""
    return _linear_op("int8_linear")


def bf16_linear() -> Callable | None:
    """`kvchat::bf16_linear`, or None where the tier's linears are not built (or the tier is portable)."""
    return _linear_op("bf16_linear")


def fp32_linear() -> Callable | None:
    """`kvchat::fp32_linear`, or None where the tier's linears are not built (or the tier is portable)."""
    return _linear_op("fp32_linear")


def set_batch_invariant(on: bool) -> None:
    """Whether the linear kernels keep to their batch-invariant paths, process-wide (where the kernels
    are built): on, a row's outputs are the same bits whatever rows come with it; off, several rows may
    go to AMX's tiles where the CPU has them, faster, in another order of sums."""
    op = _linear_op("set_batch_invariant")
    if op is not None:
        op(on)


def rescore_top() -> Callable | None:
    """`kvchat::rescore_top`, or None where the kernels are not built (`rescore` falls back then)."""
    return _core_op("rescore_top")


def rescore(logits: torch.Tensor, weight: torch.Tensor, hidden: torch.Tensor, num_exact: int) -> None:
    """The `num_exact` highest of each row of `logits` (M, V) computed again, in place, from `weight`
    (V, K) and `hidden` (M, K): kvchat::rescore_top on CPU bf16/fp32 where built (it may take more than
    `num_exact`, alike for every row), else torch's top-k, gather and products."""
    op = rescore_top() if logits.device.type == "cpu" else None
    if op is not None and {logits.dtype, weight.dtype} <= NATIVE_DTYPES:
        op(logits, weight, hidden.to(weight.dtype), num_exact)
        return
    top = logits.topk(num_exact, dim=-1, sorted=False).indices  # (M, n)
    rows = weight.index_select(0, top.reshape(-1)).view(*top.shape, -1)  # (M, n, K)
    exact = torch.bmm(rows, hidden.to(rows.dtype).unsqueeze(-1)).squeeze(-1)  # (M, n)
    logits.scatter_(1, top, exact.to(logits.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) in fp32, cast back to x's dtype, times the weight (the families'
    RMSNorm): kvchat::rms_norm on CPU bf16/fp32 where built, else torch's fused kernel for the middle."""
    native = x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in NATIVE_DTYPES
    op = _core_op("rms_norm") if native else None
    if op is not None:
        return op(x, weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def paged_attention() -> Callable | None:
    """`kvchat::paged_attention`, or None where the kernels are not built."""
    return _core_op("paged_attention")


def decoder_layers() -> Callable | None:
    """`kvchat::decoder_layers`, or None where the kernels are not built."""
    return _core_op("decoder_layers")


def _core_op(name: str) -> Callable | None:
    return getattr(torch.ops.kvchat, name) if built() else None


def _linear_op(name: str) -> Callable | None:
    # an op of the tier's linear library, registered only where it was built and loaded
    return getattr(torch.ops.kvchat, name, None) if linears_built() else None


def _build() -> tuple[bool, str | None]:
    """Whether the kernels every start uses are registered, and if not, why (tests replace it)."""
    return _load(core_library(tier()).name)


@functools.cache
def _load(name: str) -> tuple[bool, str | None]:
    """Wait for the library's build and load it; whether its ops are registered, and if not, why."""
    start_build()
    result = _builds[name].wait()[name]
    if isinstance(result, str):
        return False, result
    try:
        torch.ops.load_library(str(result))
    except OSError as exc:
        return False, f"{name} did not load: {str(exc).strip().splitlines()[0]}"
    return True, None
