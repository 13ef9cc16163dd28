"""GGUF files for llama.cpp in bench_peer.py: the packaged model in other weight types, and the
random-weight model with Qwen2.5-3B's shapes.

The packaged file holds Q4_1 matrices (and a Q8_0 embedding); kvchat runs their dequantized values. A
BF16 or Q8_0 file written from those same values gives llama.cpp the same weights kvchat reads, so a
comparison measures the engines, not the weights. The 3B-shaped model's files are written from the
seeded model kvchat runs; its Q4_K file (4.5 bits a weight, as kvchat's int4 with nested scales) is
made by llama.cpp's own quantizer from the BF16 one. Each is written
once, next to kvchat's converted model.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from kvchat.models.packaged import cache_dir, packaged_gguf

KEPT_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16})
BIG_SEED = 0  # make_big_model's weights


def packaged_as(type_name: str) -> Path:
    """The packaged model as a GGUF file whose matrices are `type_name` (Q4_1: the packaged file)."""
    source = packaged_gguf()
    if type_name == "Q4_1":
        return source
    target = cache_dir() / "bench" / f"{source.stem.rsplit('.', 1)[0]}.{type_name}.gguf"
    if not target.is_file():
        _write_once(target, lambda partial: _rewrite(source, partial, gguf.GGMLQuantizationType[type_name]))
    return target


def weight_bytes(path: Path) -> int:
    """Bytes of all tensors in a GGUF file (what one token's decode reads, the embedding being tied)."""
    return sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(path).tensors)


def _write_once(target: Path, write: Callable[[Path], None]) -> Path:
    """`target`, written by `write` under a partial name and renamed when whole: a stopped run leaves
    no half-written file where a later run would take it as done."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    write(partial)
    partial.rename(target)
    return target


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rewrite(source: Path, target: Path, qtype: gguf.GGMLQuantizationType) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.tensor_type in KEPT_TYPES:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # (rows, cols) fp32
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    _close(writer)


def big_path(type_name: str) -> Path:
    """Where `write_big` keeps the 3B-shaped model as a GGUF file whose matrices are `type_name`."""
    return cache_dir() / "bench" / f"qwen2.5-3b-shaped-seed{BIG_SEED}.{type_name}.gguf"


def write_big(type_name: str, model) -> Path:
    """`model` (make_big_model's, Qwen2.5-3B's shapes, its weights seeded) as a GGUF file whose
    matrices are `type_name`, the tied embedding in Q8_0 where they are 4-bit (as in the packaged file).
    Its tokenizer is the packaged one, padded to
    the model's vocabulary: the benchmark feeds token ids. Q4_K is quantized by llama.cpp from the
    BF16 file (written first where missing)."""
    if type_name == "Q4_K":
        source = write_big("BF16", model) if not big_path("BF16").is_file() else big_path("BF16")
        return _write_once(big_path(type_name), lambda partial: _llama_quantize_q4_k(source, partial))
    return _write_once(
        big_path(type_name), lambda partial: _write_big(model, partial, gguf.GGMLQuantizationType[type_name])
    )


def _llama_quantize_q4_k(source: Path, target: Path) -> None:
    """Every matrix of `source` in Q4_K ("pure": no layer in another type), the tied embedding in Q8_0,
    by llama.cpp's quantizer (llama-cpp-python, the `bench` extra)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S
    params.pure = True
    params.token_embedding_type = llama_cpp.GGML_TYPE_Q8_0
    params.output_tensor_type = llama_cpp.GGML_TYPE_Q8_0
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to Q4_K (status {status})")


HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def _write_big(model, target: Path, qtype: gguf.GGMLQuantizationType) -> None:
    config = model.config
    writer = gguf.GGUFWriter(target, "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    source = gguf.GGUFReader(packaged_gguf())
    tokens = source.fields[gguf.Keys.Tokenizer.LIST].contents()
    padding = config.vocab_size - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([*tokens, *(f"[PAD{i}]" for i in range(padding))])
    types = source.fields[gguf.Keys.Tokenizer.TOKEN_TYPE].contents()
    writer.add_token_types([*types, *[gguf.TokenType.UNUSED] * padding])
    writer.add_token_merges(source.fields[gguf.Keys.Tokenizer.MERGES].contents())
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    four_bit = qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        values = tensor.float().numpy()
        if values.ndim == 1:
            writer.add_tensor(_gguf_name(name), values)
            continue
        kind = gguf.GGMLQuantizationType.Q8_0 if four_bit and "embed" in name else qtype
        writer.add_tensor(_gguf_name(name), gguf.quants.quantize(values, kind), raw_dtype=kind)
    _close(writer)
