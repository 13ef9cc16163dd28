"""kvchat: see and steer what a local language model keeps in its KV cache."""

__version__ = "0.1.0"
