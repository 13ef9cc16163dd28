"""Refusals that come before the work they would waste, and listings that do not trip over what
reading the context registers."""

from __future__ import annotations

import pytest

from kvchat.chunks.types import Role
from kvchat.engine.engine import Engine
from kvchat.errors import CacheFullError
from tests.support.managers import make_manager, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_a_text_larger_than_the_budget_is_refused_after_tokenizing_about_the_budget(model):
    block_bytes = Engine(model, kv_memory_bytes=1 << 23, block_size=4, prefill_chunk=512).bytes_per_block
    cm = make_manager(model, kv_memory=block_bytes * 16)  # 64 tokens
    tokenized: list[int] = []
    encode = cm.tokenizer.encode

    def counting(text: str, **kwargs: object) -> list[int]:
        tokenized.append(len(text))
        return encode(text, **kwargs)

    cm.tokenizer.encode = counting
    huge = "rivers run to the sea. " * 200_000  # 4.6 MB, as /context @FILE of a big file
    try:
        cm.add_context(huge)
        raise AssertionError("not refused")
    except CacheFullError as err:
        assert "context chunk of more than 64 tokens is larger than the whole KV budget" in str(err)
    finally:
        del cm.tokenizer.encode
    assert sum(tokenized) <= 1 << 14  # one piece, not the 4.6 MB
    assert cm.registry.chunks == {} and cm.middle == []
    cm.add_context("rivers run to the sea")  # what fits still goes in


def test_chunks_lists_the_templates_default_after_clear(model):
    cm = make_manager(model)
    cm.set_system("be brief")
    cm.clear()  # no system prompt now: reading the context registers the template's default one
    listed = cm.chunks()
    assert [c.role for c in listed] == [Role.SYSTEM, Role.SYSTEM]
    assert len(cm.registry.chunks) == 2 and listed == cm.chunks()
