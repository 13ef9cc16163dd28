"""kvchat's attention kernel over the pool (`kvchat::paged_attention`, new tokens whose K/V the pool
holds) equals exact attention over the same rows gathered by slot, for every head size it has a fast
path for and ones it has not."""

import pytest
import torch

from kvchat.engine import native_attention
from kvchat.native.kernels import has_cpp_compiler

pytestmark = pytest.mark.skipif(not has_cpp_compiler(), reason="the kernel is built with a C++ compiler")

SLOTS = 512  # per layer and head


@pytest.fixture(scope="module")
def attend_new():
    op = native_attention.paged_attention()
    assert op is not None, native_attention.build_error()
    return op


def operands(dtype, num_kv_heads, rows, head_dim, length, seed=0):
    """A query (Hk, rows, D), a pool of two layers and `length` slots of layer 1 scattered in it."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    pool = (2, num_kv_heads, SLOTS, head_dim)
    slots = torch.randperm(SLOTS, generator=generator)[:length]  # scattered, as blocks of a reused prefix lie
    query = randn(num_kv_heads, rows, head_dim)
    return query, randn(*pool), randn(*pool), 1, slots, head_dim**-0.5


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
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim",
    [(3, 3, 64), (2, 8, 128), (4, 1, 16), (1, 7, 32), (1, 2, 256), (2, 5, 40), (1, 3, 96)],
)
@pytest.mark.parametrize("length", [1, 2, 34, 301])
def test_kernel_for_one_token_equals_exact_attention(
    attend_new, dtype, num_kv_heads, group, head_dim, length
):
    query, keys, values, layer, slots, scale = operands(dtype, num_kv_heads, group, head_dim, length)
    got = attend_new(query, keys, values, layer, slots, 1, scale)
    assert got.dtype == torch.float32 and got.shape == (num_kv_heads, group, head_dim)
    expected = exact_causal(query, keys, values, layer, slots, 1, scale)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 8, 128), (4, 1, 16), (2, 5, 40)])
@pytest.mark.parametrize("num_new,length", [(1, 1), (1, 70), (5, 5), (5, 300), (16, 40)])
def test_kernel_over_new_tokens_in_the_pool_equals_exact_causal_attention(
    attend_new, dtype, num_kv_heads, group, head_dim, num_new, length
):
    query, keys, values, layer, slots, scale = operands(
        dtype, num_kv_heads, group * num_new, head_dim, length
    )
    got = attend_new(query, keys, values, layer, slots, num_new, scale)
    assert got.dtype == torch.float32 and got.shape == query.shape
    expected = exact_causal(query, keys, values, layer, slots, num_new, scale)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


def test_kernel_takes_an_fp32_query_over_a_bf16_pool_unrounded(attend_new):
    query, *rest = operands(torch.bfloat16, 2, 3, 64, 50)
    query = torch.randn(query.shape)  # not bf16-representable
    got = attend_new(query, *rest[:-1], 1, rest[-1])
    torch.testing.assert_close(
        got.double(), exact_causal(query, *rest[:-1], 1, rest[-1]), atol=2e-6, rtol=1e-5
    )


def test_kernel_reads_the_layer_it_is_given(attend_new):
    query, keys, values, _, slots, scale = operands(torch.float32, 2, 3, 64, 40)
    first, second = (attend_new(query, keys, values, i, slots, 1, scale) for i in (0, 1))
    expected = exact_causal(query, keys, values, 0, slots, 1, scale)
    torch.testing.assert_close(first.double(), expected, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(first, second)


def test_kernel_refuses_a_slot_outside_the_pool(attend_new):
    query, keys, values, layer, slots, scale = operands(torch.float32, 2, 3, 64, 10)
    for bad in (SLOTS, -1):
        slots[4] = bad
        with pytest.raises(RuntimeError, match="a slot outside the pool"):
            attend_new(query, keys, values, layer, slots, 1, scale)
    with pytest.raises(RuntimeError, match="no such layer"):
        attend_new(query, keys, values, 2, slots.clamp(0, SLOTS - 1), 1, scale)


def test_kernel_over_new_tokens_refuses_more_new_tokens_than_positions(attend_new):
    query, keys, values, layer, slots, scale = operands(torch.float32, 2, 6, 64, 2)
    with pytest.raises(RuntimeError, match="num_new tokens"):
        attend_new(query, keys, values, layer, slots, 3, scale)
