"""The linear layers that replace `nn.Linear` where kvchat's kernels (or torch's) run them: bf16 and
fp32 weights in kvchat's tiles (bf16_linears), int4 and int8 codes (quantized_linears, int4_rounding),
the rescored output layer (rescored_head), and the tiles' layouts (weight_layout). Imported by the
model preparation (models/) and the engine (engine/); imports neither: only kvchat/native for the ops."""
