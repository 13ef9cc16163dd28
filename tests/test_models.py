import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvchat.config import ModelSettings
from kvchat.errors import ConfigError, ModelLoadError
from kvchat.models import device as device_module
from kvchat.models import gguf, packaged
from kvchat.models import loader as loader_module
from kvchat.models.loader import LoadedModel, apply_threads, choose_dtype, load_model, resolve_model
from kvchat.models.sources import ModelSource
from tests.support.hf_tokenizers import load_smollm2_tokenizer
from tests.support.models_on_disk import fake_conversion

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    # The default cache dir on purpose: the real conversion runs once per machine, not once per test run.
    return load_model(ModelSettings(device="cpu"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer (read from the packaged GGUF: no model loaded)."""
    tokenizer = load_smollm2_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [0, 5]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_resolve_aliases_paths_and_hub_ids(tmp_path: Path) -> None:
    assert resolve_model("smollm2-135m") == ModelSource("packaged", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_model("qwen2.5-0.5b") == ModelSource("hub", "Qwen/Qwen2.5-0.5B-Instruct")
    assert resolve_model("Qwen3-0.6B") == ModelSource("hub", "Qwen/Qwen3-0.6B")
    assert resolve_model("llama-3.2-1b").location == "meta-llama/Llama-3.2-1B-Instruct"
    assert resolve_model("org/some-model_v1.5") == ModelSource("hub", "org/some-model_v1.5")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == ModelSource("local", str(tmp_path.resolve()))
    gguf = packaged.packaged_gguf()
    assert resolve_model(str(gguf)) == ModelSource("gguf", str(gguf))


@pytest.mark.parametrize("spec", ["garbage!", "", "a/b/c"])
def test_resolve_garbage_lists_the_aliases(spec: str) -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m.*qwen2.5-0.5b"):
        resolve_model(spec)


@pytest.mark.parametrize("spec", ["../x/y", "/no/such/folder", "./missing"])
def test_resolve_a_missing_path_says_the_folder_does_not_exist(spec: str) -> None:
    with pytest.raises(ModelLoadError, match=f"no such model folder: {re.escape(spec)}$"):
        resolve_model(spec)


def test_resolve_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_a_folder_without_a_tokenizer_says_so_in_a_whole_sentence(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError) as refused:
        loader_module.prepare_model(ModelSettings(model=str(tmp_path), device="cpu"))
    assert "holds no tokenizer" in str(refused.value) and str(refused.value).endswith("config.json")


def test_a_message_whose_first_line_ends_in_a_colon_is_given_whole() -> None:
    from kvchat.models.hub_files import first_line

    listed = ValueError("could not use one of:\n(1) this,\n(2) that.\nInstall something.")
    assert first_line(listed) == "could not use one of: (1) this, (2) that. Install something."
    assert first_line(ValueError("one line\nand the traceback's rest")) == "one line"
    assert first_line(ValueError("")) == "ValueError"


def test_uncached_hub_model_offline_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSettings(model="kvchat-tests/not-a-cached-model", device="cpu"))
    message = str(info.value)
    assert "kvchat-tests/not-a-cached-model" in message
    assert "hf download kvchat-tests/not-a-cached-model" in message
    assert "--model PATH" in message


def test_uncached_hub_model_without_network_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreachable(*args: object, **kwargs: object) -> None:
        raise socket.gaierror("no network in this test")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    with pytest.raises(ModelLoadError, match="hf download kvchat-tests/not-a-cached-model"):
        load_model(ModelSettings(model="kvchat-tests/not-a-cached-model", device="cpu"))


@pytest.mark.slow  # the real model
def test_packaged_smollm2_converts_once_and_chats(smollm2: LoadedModel, tiny_folder: Path) -> None:
    assert packaged.is_converted(packaged.converted_dir())
    assert smollm2.model_id == packaged.HUB_ID
    assert not smollm2.model.training
    tokenizer = smollm2.tokenizer
    assert "<|im_start|>" in tokenizer.chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in smollm2.eos_token_ids
    assert tokenizer.model_max_length == smollm2.model.config.max_position_embeddings
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    input_ids = encoded["input_ids"]  # (1, T)
    output = smollm2.model.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, input_ids.shape[1] :])
    tiny = load_model(ModelSettings(model=str(tiny_folder), dtype="fp32", device="cpu", threads=1))
    assert smollm2.fingerprint != tiny.fingerprint


def test_local_folder_loads_with_eos_union_and_dtype(tiny_folder: Path) -> None:
    calls: list[tuple[str, float, float | None]] = []
    loaded = load_model(
        ModelSettings(model=str(tiny_folder), dtype="bf16", device="cpu", threads=1),
        progress=lambda description, completed, total: calls.append((description, completed, total)),
    )
    assert loaded.eos_token_ids == frozenset({0, 2, 5})  # tokenizer <|im_end|> 2, generation config [0, 5]
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.device == CPU
    assert not loaded.model.training
    assert calls[-1][1] == calls[-1][2]
    fp32 = load_model(ModelSettings(model=str(tiny_folder), dtype="fp32", device="cpu", threads=1))
    assert fp32.fingerprint == loaded.fingerprint
    assert len(loaded.fingerprint) == 16


def test_a_quantized_load_reports_loading_then_quantizing(tiny_folder: Path) -> None:
    calls: list[tuple[str, float, float | None]] = []
    load_model(
        ModelSettings(model=str(tiny_folder), dtype="bf16", device="cpu", threads=1, quantize="int4-g128"),
        progress=lambda description, completed, total: calls.append((description, completed, total)),
    )
    stages = [description for description, _, _ in calls]
    loading = next(d for d in stages if d.startswith("loading "))
    keeping = ["keeping the int4-g128 weights for the next start"] * 2  # begun, done
    assert (
        stages[stages.index(loading) :]
        == [loading, loading]
        + ["quantizing to int4-g128"] * (len(stages) - stages.index(loading) - 4)
        + keeping
    )
    done, total = calls[-3][1:]
    assert done == total and total is not None and total > 0  # every linear layer, then all of them
    assert (loading, 1, 1) in calls  # loading is complete before quantizing starts


def test_fingerprint_changes_with_the_model(tiny_folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_folder, copy)
    original = load_model(ModelSettings(model=str(tiny_folder), dtype="fp32", device="cpu", threads=1))
    assert load_model(ModelSettings(model=str(copy), dtype="fp32", device="cpu", threads=1)).fingerprint != (
        original.fingerprint
    )


def test_choose_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_dtype("fp32", CPU) == torch.float32
    assert choose_dtype("bf16", CPU) == torch.bfloat16
    assert choose_dtype("fp16", CPU) == torch.float16  # explicit only
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: True)
    assert choose_dtype("auto", CPU) == torch.bfloat16
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(device_module, "cpu_bf16_kernels", lambda: False)
    assert choose_dtype("auto", CPU) == torch.float32
    monkeypatch.setattr(device_module, "cpu_bf16_kernels", lambda: True)  # the avx2 tier's bf16 kernel
    assert choose_dtype("auto", CPU) == torch.bfloat16
    with pytest.raises(ConfigError, match="int8"):
        choose_dtype("int8", CPU)


def test_apply_threads() -> None:
    before = torch.get_num_threads()
    try:
        assert apply_threads(1) == 1
        assert torch.get_num_threads() == 1
        assert apply_threads(0) == max(1, device_module.num_physical_cores() - 1)
        with pytest.raises(ConfigError):
            apply_threads(-1)
        cpus = device_module.num_cpus()
        assert apply_threads(cpus) == cpus
        with pytest.raises(ConfigError, match=f"--threads {cpus + 1}: kvchat may run on {cpus} CPU"):
            apply_threads(cpus + 1)  # refused before torch is asked (100,000 crashed it)
    finally:
        torch.set_num_threads(before)


def test_physical_cores_count_hyperthreads_once(monkeypatch: pytest.MonkeyPatch) -> None:
    siblings = [(0, 0), (1, 1), (2, 0), (3, 1)]  # (processor, core id): two cores with two threads each
    cpuinfo = "\n\n".join(f"processor\t: {p}\nphysical id\t: 0\ncore id\t\t: {c}" for p, c in siblings)
    monkeypatch.setattr(device_module, "_read_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(device_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert device_module.num_physical_cores() == 2
    monkeypatch.setattr(device_module.os, "sched_getaffinity", lambda pid: {0})
    assert device_module.num_physical_cores() == 1


def test_conversion_is_atomic_and_runs_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conversions: list[Path] = []
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    fake_conversion(monkeypatch, conversions)
    target = packaged.converted_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("half-written by a crashed converter")
    leftover = target.with_name(f".{target.name}.999999999-0.part")  # a dead converter's staging folder
    leftover.mkdir()
    assert packaged.ensure_converted() == target
    assert packaged.ensure_converted() == target
    assert len(conversions) == 1
    assert conversions[0] != target
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # staging folders removed
    assert packaged.is_converted(target)


@pytest.mark.slow
def test_a_users_gguf_converts_once_with_progress_then_loads_from_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    user_file = tmp_path / "mine.gguf"
    shutil.copy(packaged.packaged_gguf(), user_file)
    calls: list[tuple[str, float, float | None]] = []
    settings = ModelSettings(model=str(user_file), dtype="fp32", device="cpu", threads=1)
    first = load_model(settings, progress=lambda d, done, total: calls.append((d, done, total)))
    stages = list(dict.fromkeys(d for d, _, _ in calls if d.startswith("converting mine.gguf (once): ")))
    assert [d.rsplit(": ", 1)[1] for d in stages] == ["tokenizer", "metadata", "tensors", "saving"]
    tensors = [(done, total) for d, done, total in calls if d == "converting mine.gguf (once): tensors"]
    totals = {total for _, total in tensors if total is not None}
    assert len(totals) == 1 and totals.pop() > 100  # one report per tensor, out of ~270
    assert [done for done, _ in tensors if done] == sorted(done for done, _ in tensors if done)
    assert tensors[-1][0] == tensors[-1][1]
    folder = gguf.converted_gguf_dir(user_file)
    assert gguf.is_converted(folder) and folder.parent == tmp_path / "cache" / "models"

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "read_gguf", no_conversion)
    again = load_model(settings)
    assert again.model_id == first.model_id == str(user_file.resolve())
    assert again.fingerprint == first.fingerprint and 2 in again.eos_token_ids
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(tensor, again.model.state_dict()[name]), name
    os.utime(user_file, ns=(0, 0))  # touched, not changed: the same conversion
    assert gguf.converted_gguf_dir(user_file) == folder


def test_the_conversion_key_follows_the_whole_content_not_the_name_or_time(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40_000  # ~10 MiB
    first, copy = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(data)
    copy.write_bytes(data)
    os.utime(copy, ns=(0, 0))
    assert gguf.content_key(first) == gguf.content_key(copy)
    for at in (len(data) // 3 + 12_345, len(data) // 2 + 100):  # anywhere, sampled piece or not
        edited = bytearray(data)
        edited[at] ^= 1
        copy.write_bytes(bytes(edited))
        assert gguf.content_key(first) != gguf.content_key(copy)
    stamp = copy.stat()
    copy.write_bytes(data)
    os.utime(copy, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the same size and time, other bytes
    assert gguf.content_key(first) == gguf.content_key(copy)
    copy.write_bytes(data + b"x")
    assert gguf.content_key(first) != gguf.content_key(copy)


def test_the_content_key_is_remembered_and_a_damaged_memory_is_hashed_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "a.gguf"
    path.write_bytes(b"GGUF" + bytes(5000))
    key = gguf.content_key(path)
    hashed: list[Path] = []
    real = gguf.cache_files.sha256_of
    monkeypatch.setattr(gguf.cache_files, "sha256_of", lambda p: hashed.append(p) or real(p))
    assert gguf.content_key(path) == key and hashed == []  # remembered
    (tmp_path / "cache" / gguf.DIGESTS_FILE).write_text('{"x": [')
    assert gguf.content_key(path) == key and hashed == [path]


def test_a_copy_of_the_packaged_gguf_shares_its_conversion_and_an_edited_one_does_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copy(packaged.packaged_gguf(), copy)
    assert gguf.converted_gguf_dir(copy) == packaged.converted_dir()
    edited = bytearray(copy.read_bytes())
    edited[len(edited) // 2 + 777] ^= 0x10  # the same size, one weight byte between sampled pieces
    copy.write_bytes(bytes(edited))
    assert gguf.converted_gguf_dir(copy) != packaged.converted_dir()
    seen: list[Path] = []
    monkeypatch.setattr(loader_module, "ensure_gguf_converted", lambda path, progress: seen.append(path))
    loader_module._conversion(ModelSource("packaged", packaged.HUB_ID), None)
    loader_module._conversion(ModelSource("gguf", str(copy)), None)
    assert seen == [packaged.packaged_gguf(), copy]
