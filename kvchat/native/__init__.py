"""kvchat's C++ kernels for the CPU: attention over the paged pool, the decoder layer's small steps, and
the bf16, fp32, int8 and int4 linear layers (kernels.py builds and registers them)."""
