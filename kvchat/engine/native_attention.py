"""kvchat's attention kernel over the pool (kvchat/native/paged_decode.cpp), `kvchat::paged_attention`:
the lean step's new tokens, whose K/V the pool holds.

One token's attention read through a gather and two small matmuls reads the layer's K/V twice (the
gather copies it, the matmuls read the copy), and torch's products are slow at these shapes. The kernel
reads each past row once where it lies in the pool, in fp32, several times faster at short and long
contexts alike (scripts/bench_decode.py measures decode at both). Where the kernels cannot be built
(kvchat/native/kernels.py), decode attention gathers the K/V instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvchat.native import kernels


def paged_attention() -> Callable | None:
    """The few-tokens op, or None where the kernels cannot be built (see `build_error`)."""
    return kernels.paged_attention()


def build_error() -> str | None:
    """Why the kernels could not be built, in one line; None when they were."""
    return kernels.build_error()


def takes(pool_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels serve a pool of this dtype on this device."""
    return device.type == "cpu" and pool_dtype in kernels.NATIVE_DTYPES


def for_pool(pool_dtype: torch.dtype, device: torch.device) -> Callable | None:
    """The few-tokens op for a pool of this dtype on this device (building it if need be), or None."""
    return paged_attention() if takes(pool_dtype, device) else None


def gather_reason(pool_dtype: torch.dtype, device: torch.device) -> str:
    """Why a pool of this dtype on this device is attended by gathering, in a few words."""
    if not takes(pool_dtype, device):
        return f"kvchat's kernel takes no {str(pool_dtype).removeprefix('torch.')} pool on {device.type}"
    return build_error() or "kvchat's kernel is built"
