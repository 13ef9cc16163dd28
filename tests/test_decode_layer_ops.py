"""kvchat's decoder-layer ops (native/decode_layer.cpp) against the torch arithmetic they replace: the
families' RMSNorm, the rotation with the K/V written to the pool, silu(gate) * up."""

import pytest
import torch
import torch.nn.functional as F

from kvchat.engine.decode_step import rope
from kvchat.native import kernels
from kvchat.native.kernels import has_cpp_compiler

pytestmark = pytest.mark.skipif(not has_cpp_compiler(), reason="the ops are built with a C++ compiler")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert kernels.built(), kernels.build_error()


def module_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, as transformers writes it."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [16, 50, 576])
def test_rms_norm_is_the_modules(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(width)
    x, weight = (torch.randn(3, width) * 4).to(dtype), torch.randn(width).to(dtype)
    got, want = torch.ops.kvchat.rms_norm(x, weight, 1e-5), module_rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    # the mean's sum in another order moves fp32 by an ulp; bf16 rounds that away almost always
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, atol=0, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_gate_times_up_within_its_roundings(dtype: torch.dtype) -> None:
    """silu rounded to the dtype, times up rounded again, as the module rounds them; kvchat's e^x is
    within a few fp32 steps of the exact one, so a bf16 rounding may go the other way next to a tie."""
    gate_up = (torch.randn(2, 3, 1000) * 3).to(dtype)
    gate, up = gate_up[..., :500].double(), gate_up[..., 500:].double()
    exact = gate / (1 + torch.exp(-gate)) * up
    got = torch.ops.kvchat.silu_mul(gate_up)
    assert got.shape == (2, 3, 500) and got.dtype == dtype
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-21  # two roundings, and fp32's e^x
    assert ((got.double() - exact).abs() <= step * exact.abs() + 1e-30).all()
    torchs = F.silu(gate_up[..., :500]) * gate_up[..., 500:]
    assert (got == torchs).float().mean() > (0.99 if dtype == torch.bfloat16 else 0.7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_a_row_is_the_same_alone_and_among_others(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(37, 2 * 75) * 3).to(dtype)  # 75 values a row: whole vectors and a rest
    together = torch.ops.kvchat.silu_mul(gate_up)
    assert all(torch.equal(torch.ops.kvchat.silu_mul(gate_up[i : i + 1])[0], together[i]) for i in range(37))


def rotation(num_new: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(num_new, head_dim // 2) * 3
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)  # (q, D)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    return cos, torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], dim=-1)  # cos, signed sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_new", [1, 3])
@pytest.mark.parametrize("head_norms", [False, True])
def test_rope_write_rotates_the_queries_and_keeps_the_keys_and_values(dtype, num_new, head_norms) -> None:
    torch.manual_seed(num_new)
    num_heads, num_kv_heads, head_dim, layers, slots_in_pool = 6, 2, 32, 3, 40
    qkv = torch.randn(num_new, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    cos, signed_sin = rotation(num_new, head_dim, dtype)
    norms = (torch.randn(head_dim).to(dtype), torch.randn(head_dim).to(dtype)) if head_norms else (None, None)
    keys = torch.zeros(layers, num_kv_heads, slots_in_pool, head_dim, dtype=dtype)
    values = torch.zeros_like(keys)
    slots = torch.tensor([7, 30, 2][:num_new])
    got = torch.ops.kvchat.rope_write(qkv, cos, signed_sin, *norms, 1e-6, keys, values, 1, slots, num_heads)

    heads = qkv.view(num_new, -1, head_dim).transpose(0, 1)  # (H, q, D), queries then keys then values
    query, new_keys, new_values = heads.split([num_heads, num_kv_heads, num_kv_heads])
    if head_norms:
        q_norm, k_norm = norms
        query, new_keys = (
            torch.ops.kvchat.rms_norm(query, q_norm, 1e-6),
            torch.ops.kvchat.rms_norm(new_keys, k_norm, 1e-6),
        )
    query, new_keys = rope(query, cos, signed_sin), rope(new_keys, cos, signed_sin)
    group = num_heads // num_kv_heads
    assert torch.equal(got, query.reshape(num_kv_heads, group * num_new, head_dim))  # grouped per KV head
    assert torch.equal(keys[1][:, slots], new_keys) and torch.equal(values[1][:, slots], new_values)
    others = torch.ones(slots_in_pool, dtype=torch.bool)
    others[slots] = False
    assert keys[1][:, others].eq(0).all() and keys[[0, 2]].eq(0).all() and values[[0, 2]].eq(0).all()


def test_rope_write_refuses_a_slot_outside_the_pool() -> None:
    keys = torch.zeros(1, 1, 4, 16)
    cos, signed_sin = rotation(1, 16, torch.float32)
    with pytest.raises(RuntimeError, match="slot"):
        torch.ops.kvchat.rope_write(
            torch.randn(1, 48), cos, signed_sin, None, None, 1e-6, keys, keys.clone(), 0, torch.tensor([4]), 1
        )
