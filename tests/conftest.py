import pytest


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
