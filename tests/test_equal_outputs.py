"""Two outputs of the same text match the same tokens: the views must still name the one an answer read."""

from kvchat.chunks.attention import attention_map
from kvchat.chunks.blockmap import live_chunks
from kvchat.chunks.chunk import ChunkRegistry
from kvchat.chunks.types import Role
from kvchat.chunks.view_state import make_view_state
from kvchat.engine.block_manager import BlockManager, Sequence
from kvchat.engine.sampling import SamplingParams
from tests.support.managers import drain, make_manager, text
from tests.support.tiny_models import make_tiny_model


def test_the_live_chunks_are_those_the_answer_read():
    registry = ChunkRegistry()
    system = registry.add(Role.SYSTEM, "s", [1, 2])
    query = registry.add(Role.QUERY, "q", [3])
    first = registry.add_output("a", [7, 8], source_ids=(system.chunk_id, query.chunk_id))
    second = registry.add_output("a", [7, 8], source_ids=(system.chunk_id, first.chunk_id, query.chunk_id))
    live = Sequence([1, 2, 7, 8, 3, 7, 8], block_size=4)
    state = make_view_state(BlockManager(4, 4), list(registry.chunks.values()), [], live)
    assert [c.number for c in live_chunks(state)] == [c.number for c in (system, first, query, second)]


def test_attention_labels_an_output_reused_beside_its_twin():
    # At init scale a tiny model answers the same token whatever it reads: two outputs of equal text.
    cm = make_manager(make_tiny_model("llama", vocab_size=49152))
    params = SamplingParams(max_tokens=3)
    cm.add_context(text(7))
    cm.set_query(text(8, 5))
    first = drain(cm.infer(params))
    cm.use_output(first.output_number)
    second = drain(cm.infer(params))
    assert second.text == first.text  # the case this test is about
    report = attention_map(cm)
    reused = [c for c in report.chunks if c.role == "output"]
    assert [c.chunk_id for c in reused] == [first.chunk_id]
    assert reused[0].number == cm.chunk(first.chunk_id or "").info.number
    assert report.chunks[-1].chunk_id == second.chunk_id and report.output_number == second.output_number
