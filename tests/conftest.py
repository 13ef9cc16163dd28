import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# No example may fail for taking long: hypothesis's deadline (200 ms an example) and its check that
# data is drawn quickly both fail a test on a slow or busy machine, whatever the code does.
settings.register_profile("kvchat", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvchat")


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny forwards run many times faster on one thread than on two busy ones (as kvchat itself
    runs on these 2-core machines: `threads = 0` picks 1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def on_one_then_two_threads():
    """Runs a function on one thread, then on two, and returns both results; the thread count is
    restored after."""
    import torch

    def run(function):
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = function()
            torch.set_num_threads(2)
            return one, function()
        finally:
            torch.set_num_threads(threads)

    return run


def pytest_collection_modifyitems(config, items):
    from tests.support.real_model import unmarked_real_model_tests

    unmarked = unmarked_real_model_tests(items)
    if unmarked:
        raise pytest.UsageError("a test of the real model must be marked slow: " + ", ".join(unmarked))


@pytest.fixture(scope="session")
def packaged_model_files():
    from tests.support.real_model import packaged_files

    return packaged_files()


@pytest.fixture(autouse=True)
def no_real_model_unless_slow(request, monkeypatch, packaged_model_files):
    """The fast lane loads no real model: a test not marked slow is refused its weights."""
    from tests.support.real_model import refuse_real_model

    if request.node.get_closest_marker("slow") is None:
        refuse_real_model(monkeypatch, packaged_model_files)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (packaged GGUF, converted once), fp32, with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvchat.models.packaged import ensure_converted

    folder = ensure_converted()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(autouse=True)
def isolated_user_dirs(tmp_path, monkeypatch):
    """Point home, config and history at a temp dir so no test reads or writes the user's.

    Model caches stay where they are: a real-model test must not convert or download again. Quantized
    layers are kept in the temp dir: each test quantizes, and none reads another's layers.
    """
    from kvchat.models import quantized_cache

    monkeypatch.setattr(quantized_cache, "folder", lambda: tmp_path / "quantized")
    home = Path.home()
    monkeypatch.setenv(
        "KVCHAT_CACHE_DIR", os.environ.get("KVCHAT_CACHE_DIR") or str(home / ".cache" / "kvchat")
    )
    monkeypatch.setenv("HF_HOME", os.environ.get("HF_HOME") or str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("XDG_CACHE_HOME", os.environ.get("XDG_CACHE_HOME") or str(home / ".cache"))
    for var in ("HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME"):
        (tmp_path / var).mkdir(exist_ok=True)
        monkeypatch.setenv(var, str(tmp_path / var))
    for var in ("NO_COLOR", "FORCE_COLOR", "KVCHAT_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path
