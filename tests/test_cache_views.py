"""The cache views on tiny random models: attention shares against a full eager forward, the block map
against the block manager, /compare exact against /infer, and every view at 40 and 160 columns."""

import io
import json

import pytest
import torch

from kvchat.chunks.attention import attention_map, layer_groups
from kvchat.chunks.blockmap import block_map
from kvchat.chunks.chunk import ChunkRegistry, KVSpan
from kvchat.chunks.compare import compare_modes
from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import ReuseMode, Role
from kvchat.chunks.view_state import make_view_state
from kvchat.cli.commands import Shell, Status, run_line
from kvchat.cli.ui import UI
from kvchat.config import load_settings
from kvchat.engine.block_manager import BlockManager, Sequence
from kvchat.engine.engine import Engine
from kvchat.engine.sampling import SamplingParams
from tests.support.managers import GREEDY, make_manager, text
from tests.support.tiny_models import KINDS, make_tiny_model

VOCAB = 49152  # the SmolLM2 tokenizer's


def full_eager_weights(kind: str, token_ids: list[int], start: int) -> torch.Tensor:
    """Attention of each layer to each position, averaged over heads and the queries start..: (L, T)."""
    model = make_tiny_model(kind, vocab_size=VOCAB)
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([token_ids]), output_attentions=True)
    return torch.stack([a[0, :, start:].mean(dim=(0, 1)) for a in out.attentions])  # (L, T)


def setup_context(cm) -> None:
    cm.set_system(text(0))
    cm.add_context(text(1, 30))
    cm.add_context(text(2, 20))
    cm.set_query("what fell over the hills?")


@pytest.mark.parametrize("kind", KINDS)
def test_attention_shares_equal_a_full_eager_forward(kind):
    cm = make_manager(make_tiny_model(kind, vocab_size=VOCAB))
    setup_context(cm)
    cm.infer_blocking(GREEDY)
    cm.set_query("and where do the rivers run?")
    cm.infer_blocking(GREEDY)
    for number, over_live in ((2, True), (1, False)):  # the last answer over its KV; an older one recomputed
        report = attention_map(cm, number)
        assert report.over_live_kv is over_live
        output = cm.registry.output(number)
        tokens = [t for i in output.source_ids for t in cm.registry.chunks[i].token_ids] + output.token_ids
        end = len(report.token_weights)
        expected = full_eager_weights(kind, tokens[:end], end - report.num_queries)  # (L, end)
        got = torch.tensor(report.token_weights)
        assert (got - expected.mean(dim=0)).abs().max() <= 1e-4
        groups = layer_groups(expected.shape[0])
        for share in report.chunks[1:-1]:
            a, b = report.positions[share.chunk_id]  # type: ignore[index]
            a = max(a, report.chunks[0].num_tokens)
            assert share.attention_share == pytest.approx(float(expected[:, a:b].sum(dim=1).mean()), abs=1e-4)
            for name, layers in groups.items():
                direct = float(expected[layers.start : layers.stop, a:b].sum(dim=1).mean())
                assert share.by_layer_group[name] == pytest.approx(direct, abs=1e-4)
        assert sum(c.attention_share for c in report.chunks) == pytest.approx(1.0, abs=1e-5)
        assert [c.role for c in report.chunks] == ["sink", "system", "context", "context", "query", "answer"]


def test_attention_over_moved_kv_reads_the_kv_the_answer_used():
    cm = make_manager(make_tiny_model("llama", vocab_size=VOCAB), mode=ReuseMode.REPOSITION)
    setup_context(cm)
    cm.infer_blocking(GREEDY)
    cm.set_system("a different system prompt")
    result = cm.infer_blocking(GREEDY)
    assert result.repositioned_tokens > 0
    report = attention_map(cm)
    assert report.over_live_kv and report.output_number == result.output_number
    assert sum(c.attention_share for c in report.chunks) == pytest.approx(1.0, abs=1e-5)


def make_shell(cm, json_lines: bool, width: int = 120):
    out = io.StringIO()
    ui = UI(color=not json_lines, json_lines=json_lines, file=out, err_file=out)
    ui.console.width = width
    shell = Shell(cm, load_settings(None, {"sampling": {"max_tokens": 8}}))

    def run(line: str) -> str:
        out.seek(0)
        out.truncate()
        assert run_line(shell, ui, line) is Status.OK, out.getvalue()
        return out.getvalue()

    return run


def check_counts(cm, record: dict) -> None:
    blocks = cm.engine.blocks
    counts = record["counts"]
    assert counts["num_used"] == blocks.num_used
    assert counts["num_pinned"] == blocks.num_pinned
    assert counts["num_cached"] == blocks.num_cached
    assert counts["num_free"] == blocks.num_free - blocks.num_cached
    assert counts["num_shared"] == sum(1 for b in blocks.blocks if b.ref_count > 1)
    for cell in record["blocks"]:
        assert cell["ref_count"] == blocks.blocks[cell["block_id"]].ref_count
    assert len(record["blocks"]) == counts["num_blocks"] - counts["num_free"]


def test_blocks_json_agrees_with_the_block_manager():
    cm = make_manager(make_tiny_model("llama", vocab_size=VOCAB))
    run = make_shell(cm, json_lines=True)
    assert json.loads(run("/blocks"))["blocks"] == []
    run(f"/system {text(0)}")
    run(f"/context {text(1, 30)}")
    run("/query what fell?")
    run("/infer")
    check_counts(cm, json.loads(run("/blocks")))
    run("/use-output 1")  # the output's pinned blocks are shared by the next inference
    run("/mode reposition")
    run("/system another system prompt")
    run("/infer")
    record = json.loads(run("/blocks"))
    check_counts(cm, record)
    assert record["counts"]["num_pinned"] > 0 and record["counts"]["num_moved"] > 0
    live = cm.live
    moved = {c["block_id"] for c in record["blocks"] if not c["exact"]}
    assert moved == set(live.blocks_covering(live.exact_limit, live.num_computed))
    run("/delete-output 1")
    record = json.loads(run("/blocks"))
    check_counts(cm, record)
    run("/reset")
    check_counts(cm, json.loads(run("/blocks")))


def test_a_view_state_is_a_copy_and_reading_old_kv_gives_its_blocks_back():
    cm = make_manager(make_tiny_model("llama", vocab_size=VOCAB))
    setup_context(cm)
    cm.infer_blocking(GREEDY)
    state = cm.view_state()
    assert state.live is not None and state.live.token_ids == cm.live.token_ids
    state.live.token_ids.append(7)
    state.chunks[0].token_ids.append(7)
    assert cm.live.token_ids != state.live.token_ids
    assert cm.registry.chunks[state.chunks[0].chunk_id].token_ids != state.chunks[0].token_ids
    cm.set_system("another system prompt")
    cm.infer_blocking(GREEDY)
    used = cm.engine.blocks.num_used
    old = [t for c in cm.view_state().chunks[:4] for t in c.token_ids]  # the first answer's context
    keys, values, over_live = cm.read_prefix_kv(old, len(old) - 1)
    assert not over_live and keys.shape[1] == values.shape[1] == len(old) - 1
    assert cm.engine.blocks.num_used == used


def test_block_map_names_owners_shared_and_pinned_blocks():
    blocks = BlockManager(num_blocks=8, block_size=4)
    registry = ChunkRegistry()
    a = registry.add(Role.SYSTEM, "a", [1, 2, 3, 4, 5, 6])
    b = registry.add(Role.CONTEXT, "b", [7, 8, 9, 10])
    live = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 4, block_table=blocks.allocate(3), num_computed=11)
    live.num_exact = 6  # b's KV was moved
    b.span = KVSpan.of(blocks, live, 6, 10, exact=False, pinned=True)
    m = block_map(make_view_state(blocks, [a, b], [a, b], live))
    cells = {c.block_id: c for c in m.blocks}
    assert cells[0].chunk_ids == [a.chunk_id] and cells[0].state == "used" and cells[0].exact
    assert cells[1].chunk_ids == [a.chunk_id, b.chunk_id] and cells[1].state == "pinned"
    assert cells[1].ref_count == 2 and not cells[1].exact
    assert m.counts() == {
        "num_blocks": 8,
        "num_used": 3,
        "num_pinned": 2,
        "num_shared": 2,
        "num_cached": 0,
        "num_moved": 2,
        "num_free": 5,
    }
    assert [(k.number, k.num_blocks) for k in m.chunks] == [(a.number, 2), (b.number, 2)]


def test_compare_exact_equals_the_infer_greedy_answer_and_keeps_nothing():
    cm = make_manager(make_tiny_model("qwen2", vocab_size=VOCAB, seed=3))
    run = make_shell(cm, json_lines=True)
    run(f"/system {text(0)}")
    run(f"/context {text(1, 30)}")
    run("/query what fell?")
    run("/set temperature 0.9")  # /compare decodes greedily anyway
    before = (len(cm.registry.chunks), cm.engine.blocks.num_used, cm.live)
    compared = json.loads(run("/compare exact"))["results"]
    assert (len(cm.registry.chunks), cm.engine.blocks.num_used, cm.live) == before
    run("/set temperature 0")
    inferred = json.loads(run("/infer"))
    assert compared[0]["mode"] == "exact" and compared[0]["first_difference"] is None
    assert compared[0]["output"] == inferred["output"]
    eos = inferred["finish_reason"] == "stop"  # /infer counts the end-of-turn token, /compare does not
    assert compared[0]["generated_tokens"] == inferred["generated_tokens"] - eos
    results = json.loads(run("/compare"))["results"]
    assert [r["mode"] for r in results] == ["exact", "reposition", "repair"]
    assert results[0]["output"] == inferred["output"]
    assert all(set(r) >= {"mode", "output", "ttft_s", "computed_tokens", "first_difference"} for r in results)


def test_compare_decodes_without_drafts_where_infer_drafts(monkeypatch):
    import kvchat.chunks.inference as inference

    cm = make_manager(make_tiny_model("qwen2", vocab_size=VOCAB, seed=3))
    run = make_shell(cm, json_lines=True)
    run(f"/context {text(1, 30)}")
    run("/query what fell?")
    run("/set decode.speculate prompt-lookup")
    drafting: list[bool] = []
    generate = inference.generate

    def spy(engine, seq, params, eos, detokenizer, speculation=None):
        drafting.append(speculation is not None)
        return generate(engine, seq, params, eos, detokenizer, speculation)

    monkeypatch.setattr(inference, "generate", spy)
    run("/compare exact reposition")
    assert drafting == [False, False]
    run("/infer")
    assert drafting[-1]


@pytest.mark.parametrize("width", [40, 160])
def test_views_render_at_narrow_and_wide_widths(width):
    cm = make_manager(make_tiny_model("llama", vocab_size=VOCAB), mode=ReuseMode.REPOSITION)
    run = make_shell(cm, json_lines=False, width=width)
    setup_context(cm)
    run("/infer")
    run("/use-output 1")
    run("/system another system prompt")
    run("/infer")
    lines = ("/blocks", "/attention", "/attention 1", "/compare", "/compare repair exact", "/show 2 heat")
    for line in lines:
        out = run(line)
        assert out.strip()
        assert max(len(x) for x in out.splitlines()) <= width, (line, out)
    assert "×" in run("/blocks")  # the long run of free blocks is one line
    assert "context" in run("/attention") and "repair" in run("/compare repair exact")


@pytest.mark.slow
def test_compare_exact_equals_infer_on_smollm2(smollm2):
    """A real model answers with words, so equal answers mean something; the other modes are reported."""
    model, tokenizer = smollm2
    engine = Engine(model, kv_memory_bytes=64 << 20, block_size=16, prefill_chunk=512)
    cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({tokenizer.eos_token_id}))
    cm.set_system("You are a concise assistant.")
    cm.add_context("The Rhine rises in the Swiss Alps and flows north into the North Sea.")
    cm.set_query("Where does the Rhine end?")
    params = SamplingParams(max_tokens=12)
    comparison = compare_modes(cm, [ReuseMode.EXACT, ReuseMode.REPOSITION], params)
    inferred = cm.infer_blocking(params)
    exact = comparison.results[0]
    assert exact.output == inferred.text and exact.output
    assert exact.token_ids == [t for t in inferred.token_ids if t not in cm.eos_token_ids]
    assert exact.agreement == 1.0 and exact.first_difference is None


def test_heat_of_a_chunk_sums_to_its_attention_share_and_errors_are_one_line():
    cm = make_manager(make_tiny_model("qwen3", vocab_size=VOCAB))
    run = make_shell(cm, json_lines=True)
    out = io.StringIO()
    ui = UI(color=False, json_lines=True, file=out, err_file=io.StringIO())  # JSON alone on stdout
    shell = Shell(cm, load_settings(None, {}))
    for line in ("/attention", "/compare", "/compare exact sideways"):
        assert run_line(shell, ui, line) is Status.FAILED
    errors = [json.loads(x)["error"] for x in out.getvalue().splitlines()]
    assert errors == [
        "no answer yet: /infer or chat first",
        "no query to answer: set one with /query TEXT",
        "unknown mode 'sideways': choose from exact, reposition, repair",
    ]
    setup_context(cm)
    run("/infer")
    shares = {c["chunk_id"]: c["attention_share"] for c in json.loads(run("/attention"))["chunks"]}
    heat = json.loads(run("/show 2 heat"))
    assert len(heat["heat"]) == len(heat["pieces"]) == heat["chunk"]["num_tokens"]
    assert "".join(heat["pieces"]) == cm.tokenizer.decode(heat["chunk"]["token_ids"])
    assert sum(heat["heat"]) == pytest.approx(shares[heat["chunk"]["chunk_id"]], abs=1e-5)
