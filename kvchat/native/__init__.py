"""kvchat's C++ kernels for the CPU: attention over the paged pool and int4 linear layers."""
