import pytest


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny forwards run many times faster on one thread than on two busy ones (as kvchat itself
    runs on these 2-core machines: `threads = 0` picks 1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
