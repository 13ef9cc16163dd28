"""What measuring reuse from outside needs: token ids in an answer's result and `--json`, and `/evict`,
which drops the cached KV nothing holds so the next answer is a cold start."""

import pytest
import torch

from kvchat.cli import jsonout
from kvchat.cli.commands import Shell
from kvchat.cli.results import HelpView, Notice
from kvchat.cli.slash_commands import split_command
from kvchat.config import Settings
from kvchat.engine.block_manager import BlockManager
from tests.support.managers import GREEDY, drain, make_manager, text
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=49152)


def naive_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_the_result_carries_the_prompt_and_answer_ids_the_model_saw(model):
    cm = make_manager(model)
    cm.set_system("You are terse.")
    cm.add_context(text(1))
    cm.set_query(text(2, 5))
    result = drain(cm.infer(GREEDY))
    assert len(result.prompt_ids) == result.prompt_tokens
    expected = [t for c in cm.context_chunks() for t in c.token_ids] + list(cm.format.generation_prompt_ids)
    assert result.prompt_ids == expected
    assert result.token_ids == naive_greedy(model, result.prompt_ids, len(result.token_ids))
    fields = jsonout.result_json("infer", result)
    assert fields["prompt_ids"] == result.prompt_ids and fields["output_ids"] == result.token_ids
    assert fields["generated_tokens"] == len(result.token_ids) and "token_ids" not in fields
    assert jsonout.dumps(fields).count('"output_ids"') == 1


def test_evict_forgets_unreferenced_kv_only():
    blocks = BlockManager(num_blocks=6, block_size=2)
    kept, dropped = blocks.allocate(1), blocks.allocate(2)
    blocks.record(kept[0], 0, [1, 2])
    blocks.record(dropped[0], 0, [5, 6])
    blocks.record(dropped[1], blocks.blocks[dropped[0]].hash, [7, 8])
    generations = [blocks.blocks[b].generation for b in dropped]
    blocks.release(dropped)
    assert blocks.num_cached == 2 and blocks.match_prefix([5, 6, 7, 8]).shared_block_ids == dropped
    assert blocks.evict_cached() == 2
    assert blocks.num_cached == 0 and blocks.match_prefix([5, 6, 7, 8]).shared_block_ids == []
    assert [blocks.blocks[b].generation for b in dropped] > generations  # old handles are invalid
    assert blocks.match_prefix([1, 2]).shared_block_ids == kept  # held: untouched
    assert blocks.evict_cached() == 0
    blocks.check_invariants()


def test_evict_after_reset_makes_the_next_answer_a_cold_start(model):
    cm = make_manager(model)
    cm.add_context(text(3))
    cm.set_query(text(4, 5))
    first = drain(cm.infer(GREEDY))
    cm.reset()
    cm.add_context(text(3))
    cm.set_query(text(4, 5))
    shell = Shell(cm, Settings())
    cmd, notice = shell.execute("/evict", split_command("/evict"))
    assert cmd == "evict" and isinstance(notice, Notice) and notice.data["num_evicted"] > 0
    assert cm.stats().num_cached == 0
    cold = drain(cm.infer(GREEDY))
    assert cold.reused_tokens == 0 and cold.computed_tokens == cold.prompt_tokens
    assert cold.token_ids == first.token_ids


def test_evict_keeps_what_is_held(model):
    cm = make_manager(model)
    cm.add_context(text(5))
    cm.set_query(text(6, 5))
    first = drain(cm.infer(GREEDY))
    cm.evict_cached()
    again = drain(cm.infer(GREEDY))  # the live conversation and the kept output hold their blocks
    assert again.reused_tokens == again.prompt_tokens - 1 and again.token_ids == first.token_ids


def test_help_lists_evict():
    shell = Shell(make_manager(make_tiny_model("llama", vocab_size=49152)), Settings())
    _, view = shell.execute("/help", split_command("/help"))
    assert isinstance(view, HelpView) and "evict" in [c.name for c in view.commands]
    _, topic = shell.execute("/help evict", split_command("/help evict"))
    assert topic.topic is not None and "cold start" in topic.topic.details
