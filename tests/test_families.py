"""The family matrix: each family kvchat runs, as a tiny random model of its own transformers config with
a real tokenizer and its real chat template (tests/support/families.py). For each: prompt ids equal
apply_chat_template's for a 3-turn chat with a system prompt, a /context + /query composition and a first
message without one; fp32 greedy answers equal transformers' generate re-templating each turn; a moved
chunk's keys equal what a full forward computes at the new positions; exact /verify is KL 0."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from transformers import GenerationConfig

from kvchat.chunks.context import ContextManager
from kvchat.chunks.rendering import Part
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import ReuseMode, Role
from kvchat.engine.engine import Engine
from kvchat.engine.rope import KeyRotation, refusal
from kvchat.engine.sampling import SamplingParams
from tests.support.families import FAMILIES, family_template, family_tokenizer, make_family_model

SYSTEM = "You answer briefly."
TURNS = ("What is the capital of France?", "And of Italy?", "Thanks, bye.")
PASSAGES = ("Paris is the capital of France.", "Rome is the capital of Italy.\n\nIt is old.")
NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)


# The fast lane leaves out the families of 128k-152k-token vocabularies, whose tokenizers and output
# layers take most of the time (tiny Llama, Qwen2 and Qwen3 models run there in other modules); the
# full suite runs them all.
SLOW_FAMILIES = ("llama3", "phi4-mini", "olmo2", "qwen2", "qwen3")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_FAMILIES else []) for name in FAMILIES
    ],
)
def family(request: pytest.FixtureRequest):
    name = request.param
    tokenizer = family_tokenizer(name)
    return name, make_family_model(name), tokenizer, ChatFormat(tokenizer, family_template(name))


def manager(model, tokenizer, fmt, mode=ReuseMode.EXACT) -> ContextManager:
    engine = Engine(model, kv_memory_bytes=1 << 23, block_size=4, prefill_chunk=16)
    eos = frozenset({tokenizer.eos_token_id} - {None})
    return ContextManager(engine, fmt, tokenizer, eos, mode=mode)


def templated(tokenizer, fmt: ChatFormat, parts: list[Part]) -> list[int]:
    messages = fmt.messages(parts)
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, chat_template=fmt.template
    )
    return list(encoded["input_ids"])


def generated(model, prompt: list[int], stop_ids: frozenset[int]) -> list[int]:
    config = GenerationConfig(
        max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=sorted(stop_ids), pad_token_id=min(stop_ids)
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def test_three_turns_with_a_system_prompt_equal_transformers_retemplating(family) -> None:
    name, model, tokenizer, fmt = family
    cm = manager(model, tokenizer, fmt)
    cm.set_system(SYSTEM)
    parts = [Part("system", SYSTEM)]
    for text in TURNS:
        result = cm.chat_blocking(text, GREEDY)
        parts.append(Part("user", text))
        prompt = templated(tokenizer, fmt, parts)
        assert cm.live is not None and cm.live.token_ids[: result.prompt_tokens] == prompt, name
        expected = generated(model, prompt, cm.eos_token_ids)
        assert result.token_ids == expected, name
        parts.append(Part("assistant", tokenizer.decode(expected, skip_special_tokens=True)))
    if not fmt.layout.folds_system:  # the messages are the conversation as it is
        assert fmt.messages(parts[:2])[0] == {"role": "system", "content": SYSTEM}


def test_context_and_query_compose_to_the_template_rendering(family) -> None:
    name, model, tokenizer, fmt = family
    cm = manager(model, tokenizer, fmt)
    cm.set_system(SYSTEM)
    for passage in PASSAGES:
        cm.add_context(passage)
    cm.set_query("Which city is old?")
    parts = [Part("system", SYSTEM), *(Part("user", p) for p in PASSAGES), Part("user", "Which city is old?")]
    placement = cm.placement()
    assert placement.token_ids == templated(tokenizer, fmt, parts), name
    assert [c.chunk_id for c in placement.sources][-3:] == [*cm.middle, cm.query]


def test_a_first_message_without_system_prompt_is_what_the_template_renders(family) -> None:
    name, model, tokenizer, fmt = family
    cm = manager(model, tokenizer, fmt)
    result = cm.chat_blocking("Hello there!", GREEDY)
    plain = [{"role": "user", "content": "Hello there!"}]
    expected = tokenizer.apply_chat_template(
        plain, tokenize=True, add_generation_prompt=True, chat_template=fmt.template
    )["input_ids"]
    assert cm.live is not None and cm.live.token_ids[: result.prompt_tokens] == list(expected), name


def test_exact_verify_is_kl_zero_in_fp32(family) -> None:
    name, model, tokenizer, fmt = family
    cm = manager(model, tokenizer, fmt)
    cm.set_system(SYSTEM)
    cm.add_context(PASSAGES[0])
    cm.set_query("Which city?")
    cm.infer_blocking(GREEDY)  # the KV is cached: verify composes from it
    report = cm.verify(4)
    assert report.kl_divergence == pytest.approx(0.0, abs=1e-6), name
    assert report.top1_rate == 1.0 and report.greedy_agree == report.greedy_tokens


def test_a_moved_chunk_has_the_keys_a_full_forward_computes_there(family) -> None:
    name, model, tokenizer, fmt = family
    cm = manager(model, tokenizer, fmt, mode=ReuseMode.REPOSITION)
    cm.set_system(SYSTEM)
    first, second = (cm.add_context(p).chunk_id for p in PASSAGES)
    cm.set_query("Which city is old?")
    cm.infer_blocking(GREEDY)
    cm.middle = [second, first]  # the passages swap places: their KV moves
    composed = cm.compose()
    try:
        assert composed.repositioned, name
        engine = cm.engine
        full = engine.start(list(composed.seq.token_ids), reuse=False, index=False)
        try:
            engine.compute(full)
            for a, b in composed.repositioned:
                moved, _ = engine.read_kv(composed.seq, a, b)
                fresh, _ = engine.read_kv(full, a, b)
                # layer 0 sees only the token and its position: moved keys equal a full forward's
                torch.testing.assert_close(moved[0], fresh[0], atol=1e-5, rtol=1e-5)
        finally:
            engine.free(full)
    finally:
        cm.engine.free(composed.seq)


def test_each_layer_rotates_by_the_models_own_rotary_embedding(family) -> None:
    """Keys re-rotated by a delta equal keys rotated anew at the absolute positions by the family's own
    apply_rotary_pos_emb, layer by layer (Gemma 3's two frequency tables, Phi-4-mini's partial rotary,
    Llama 3's scaled frequencies)."""
    name, model, _, _ = family
    assert_rotation_matches_the_model(model, name)


def assert_rotation_matches_the_model(model, name: str) -> None:
    rotation = KeyRotation(model)
    base = model.model
    apply = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    num_layers, head_dim = model.config.num_hidden_layers, base.layers[0].self_attn.head_dim
    torch.manual_seed(1)
    keys = torch.randn(num_layers, 5, 2, head_dim)  # (L, T, H, D), as computed at positions 3..7
    moved = rotation.rotate_(keys.clone(), 40)
    takes_type = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
    for layer, key in enumerate(rotation.layer_keys):
        extra = (key,) if takes_type else ()
        cos_old, sin_old = _cos_sin(base.rotary_emb, list(range(3, 8)), extra)
        cos_new, sin_new = _cos_sin(base.rotary_emb, list(range(43, 48)), extra)
        k = keys[layer].transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
        _, unrotated = apply(k, k, cos_old, -sin_old)
        _, expected = apply(unrotated, unrotated, cos_new, sin_new)
        torch.testing.assert_close(moved[layer], expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def _cos_sin(rotary, positions: list[int], extra: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos and sin (1, T, rot) at `positions`, the attention factor (YaRN's) divided out."""
    cos, sin = rotary(torch.zeros(1), torch.tensor([[0, *positions]]), *extra)
    scale = cos[:, :1, :1]
    return cos[:, 1:] / scale, sin[:, 1:] / scale


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_scaled_variants_rotate_exactly(rope) -> None:
    model = make_family_model("smollm2", rope_parameters=rope)
    assert refusal(model) is None
    assert_rotation_matches_the_model(model, rope["rope_type"])


def test_dynamic_ntk_refuses_moving_keys_by_name() -> None:
    from kvchat.chunks.compare import runnable_modes
    from kvchat.config import Settings, replace_setting
    from kvchat.errors import ConfigError
    from kvchat.session import apply_live_settings

    model = make_family_model(
        "smollm2", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    )
    tokenizer = family_tokenizer("smollm2")
    cm = manager(model, tokenizer, ChatFormat(tokenizer))
    assert cm.move_refusal is not None and "dynamic NTK" in cm.move_refusal
    with pytest.raises(ConfigError, match="dynamic NTK") as refused:
        apply_live_settings(cm, replace_setting(Settings(), "reuse.mode", "reposition"))
    assert str(refused.value).endswith("Exact reuse is: /mode exact (or --reuse exact)")
    assert cm.mode is ReuseMode.EXACT
    assert runnable_modes(cm, list(ReuseMode)) == [ReuseMode.EXACT]  # /compare answers in exact alone
    assert "exact only" in cm.model_info().reuse


def test_chat_template_names_a_builtin_or_a_file(tmp_path) -> None:
    from kvchat.chunks.template import CHATML_TEMPLATE, read_template
    from kvchat.errors import ChunkError

    assert read_template("ChatML") == (CHATML_TEMPLATE, "generic chatml (--chat-template)")
    path = tmp_path / "gemma.jinja"
    path.write_text(family_template("gemma3") or "")
    text, source = read_template(str(path))
    assert text == path.read_text() and str(path) in source
    fmt = ChatFormat(family_tokenizer("gemma3"), text, source)
    assert "Gemma" in fmt.describe() and str(path) in fmt.describe()
    with pytest.raises(ChunkError, match="no such built-in"):
        read_template(str(tmp_path / "missing.jinja"))


@pytest.mark.slow
def test_a_gguf_without_chat_template_starts_with_the_generic_one_and_says_so(tmp_path, monkeypatch) -> None:
    import subprocess
    import sys

    from kvchat.config import Settings, replace_setting
    from kvchat.models.packaged import packaged_gguf
    from kvchat.session import open_session

    stripped = tmp_path / "no-template.gguf"
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force",
         "--remove-metadata", "tokenizer.chat_template", str(packaged_gguf()), str(stripped)],
        check=True, capture_output=True,
    )  # fmt: skip
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    settings = Settings()
    for key, value in (("model.model", str(stripped)), ("model.device", "cpu"), ("model.threads", "1")):
        settings = replace_setting(settings, key, value)
    stages: list[str] = []

    class Progress:
        def __call__(self, description: str, completed: float, total: float | None) -> None:
            stages.append(description)

        def note(self, message: str) -> None:
            stages.append(f"note: {message}")

    cm = open_session(settings, progress=Progress())
    notes = [s for s in stages if s.startswith("note: ")]
    assert len(notes) == 1 and "no chat template" in notes[0] and "ChatML" in notes[0]
    assert stages.index(notes[0]) < min(i for i, s in enumerate(stages) if s.startswith("converting"))
    assert cm.format.uses_fallback_template and "generic ChatML" in cm.model_info().chat_template
    result = cm.chat_blocking("Hello!", SamplingParams(temperature=0.0, max_tokens=4))
    assert result.prompt_tokens > 0


def test_an_answer_ending_in_whitespace_leaves_the_history_the_template_renders(family) -> None:
    # An answer cut by --max-tokens can end in a space or a newline; Gemma's and Llama 3's templates trim
    # it. The next prompt is what the template renders for the answer's text, whatever it trims.
    name, model, tokenizer, fmt = family
    cm = manager(model, tokenizer, fmt)
    cm.set_system(SYSTEM)
    question = cm.register(Role.USER, "Hi?", unique=True)
    answer_ids = [*fmt.generation_prompt_ids, *tokenizer.encode("Sure. \n", add_special_tokens=False)]
    answer = cm.registry.add_output(
        "Sure.", answer_ids + list(fmt.assistant_close_ids), finish_reason="length"
    )
    cm.turns = [question.chunk_id, answer.chunk_id]
    parts = [
        Part("system", SYSTEM),
        Part("user", "Hi?"),
        Part("assistant", "Sure. \n"),
        Part("user", "More?"),
    ]
    turn = cm.register(Role.USER, "More?", unique=True)
    assert cm.placement(turn=turn).token_ids == templated(tokenizer, fmt, parts), name
