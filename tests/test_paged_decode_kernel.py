"""kvchat's attention kernels over the pool (`kvchat::paged_decode_attention` for one token whose K/V
are given, `kvchat::paged_attention` for new tokens the pool holds) equal exact attention over the
same rows gathered by slot, for every head size they have a fast path for and ones they have not."""

import pytest
import torch

from kvchat.engine import native_attention
from kvchat.engine.compiled_step import has_cpp_compiler

pytestmark = pytest.mark.skipif(not has_cpp_compiler(), reason="the kernel is built with a C++ compiler")

SLOTS = 512  # per layer and head


@pytest.fixture(scope="module")
def attend():
    op = native_attention.paged_decode_attention()
    assert op is not None, native_attention.build_error()
    return op


@pytest.fixture(scope="module")
def attend_new():
    op = native_attention.paged_attention()
    assert op is not None, native_attention.build_error()
    return op


def exact(query, own_keys, own_values, keys, values, layer, slots, scale):
    """Softmax attention in float64 over the rows at `slots`, then the token's own."""
    past_keys = torch.cat([keys[layer][:, slots], own_keys[:, None]], dim=1).double()  # (Hk, T+1, D)
    past_values = torch.cat([values[layer][:, slots], own_values[:, None]], dim=1).double()
    probs = (query.double() @ past_keys.transpose(1, 2) * scale).softmax(-1)  # (Hk, G, T+1)
    return probs @ past_values  # (Hk, G, D)


def operands(dtype, num_kv_heads, group, head_dim, length, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    pool = (2, num_kv_heads, SLOTS, head_dim)
    slots = torch.randperm(SLOTS, generator=generator)[:length]  # scattered, as blocks of a reused prefix lie
    query = randn(num_kv_heads, group, head_dim)
    own_keys, own_values = randn(num_kv_heads, head_dim), randn(num_kv_heads, head_dim)
    return query, own_keys, own_values, randn(*pool), randn(*pool), 1, slots, head_dim**-0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim",
    [(3, 3, 64), (2, 8, 128), (4, 1, 16), (1, 7, 32), (1, 2, 256), (2, 5, 40), (1, 3, 96)],
)
@pytest.mark.parametrize("length", [0, 1, 33, 300])
def test_kernel_equals_exact_attention(attend, dtype, num_kv_heads, group, head_dim, length):
    args = operands(dtype, num_kv_heads, group, head_dim, length)
    got = attend(*args)
    assert got.dtype == torch.float32 and got.shape == (num_kv_heads, group, head_dim)
    torch.testing.assert_close(got.double(), exact(*args), atol=2e-6, rtol=1e-5)


def exact_causal(query, keys, values, layer, slots, num_new, scale):
    """Float64 attention of query rows g * num_new + i (new token i) over the rows at `slots`, token i
    seeing positions 0..T-num_new+i."""
    num_kv_heads, rows, head_dim = query.shape
    length = len(slots)
    seen = torch.arange(length)[None] <= length - num_new + torch.arange(rows)[:, None] % num_new  # (R, T)
    scores = query.double() @ keys[layer][:, slots].double().transpose(1, 2) * scale  # (Hk, R, T)
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return probs @ values[layer][:, slots].double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 8, 128), (4, 1, 16), (2, 5, 40)])
@pytest.mark.parametrize("num_new,length", [(1, 1), (1, 70), (5, 5), (5, 300), (16, 40)])
def test_kernel_over_new_tokens_in_the_pool_equals_exact_causal_attention(
    attend_new, dtype, num_kv_heads, group, head_dim, num_new, length
):
    query, _, _, keys, values, layer, slots, scale = operands(
        dtype, num_kv_heads, group * num_new, head_dim, length
    )
    got = attend_new(query, keys, values, layer, slots, num_new, scale)
    assert got.dtype == torch.float32 and got.shape == query.shape
    expected = exact_causal(query, keys, values, layer, slots, num_new, scale)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


def test_one_token_given_or_in_the_pool_is_the_same_attention(attend, attend_new):
    query, own_keys, own_values, keys, values, layer, slots, scale = operands(torch.bfloat16, 2, 3, 64, 90)
    given = attend(query, own_keys, own_values, keys, values, layer, slots[:-1], scale)
    keys[layer][:, slots[-1]], values[layer][:, slots[-1]] = own_keys, own_values
    torch.testing.assert_close(attend_new(query, keys, values, layer, slots, 1, scale), given, atol=0, rtol=0)


def test_kernel_takes_an_fp32_query_over_a_bf16_pool_unrounded(attend):
    query, *rest = operands(torch.bfloat16, 2, 3, 64, 50)
    query = torch.randn(query.shape)  # not bf16-representable
    got = attend(query, *rest)
    torch.testing.assert_close(got.double(), exact(query, *rest), atol=2e-6, rtol=1e-5)


def test_kernel_reads_the_layer_it_is_given(attend):
    query, own_keys, own_values, keys, values, _, slots, scale = operands(torch.float32, 2, 3, 64, 40)
    first, second = (attend(query, own_keys, own_values, keys, values, i, slots, scale) for i in (0, 1))
    expected = exact(query, own_keys, own_values, keys, values, 0, slots, scale)
    torch.testing.assert_close(first.double(), expected, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(first, second)


def test_kernel_refuses_a_slot_outside_the_pool(attend):
    query, own_keys, own_values, keys, values, layer, slots, scale = operands(torch.float32, 2, 3, 64, 10)
    for bad in (SLOTS, -1):
        slots[4] = bad
        with pytest.raises(RuntimeError, match="a slot outside the pool"):
            attend(query, own_keys, own_values, keys, values, layer, slots, scale)
    with pytest.raises(RuntimeError, match="no such layer"):
        attend(query, own_keys, own_values, keys, values, 2, slots.clamp(0, SLOTS - 1), scale)


def test_kernel_over_new_tokens_refuses_more_new_tokens_than_positions(attend_new):
    query, _, _, keys, values, layer, slots, scale = operands(torch.float32, 2, 6, 64, 2)
    with pytest.raises(RuntimeError, match="num_new tokens"):
        attend_new(query, keys, values, layer, slots, 3, scale)
