"""What weight-only quantization costs and gains: KL and top-1 against the unquantized model, decode speed.

    python scripts/bench_quant.py quality                       # packaged SmolLM2, ~400 tokens of prose
    python scripts/bench_quant.py quality --model FOLDER        # your own model folder
    python scripts/bench_quant.py speed --tokens 32 --repeats 5  # packaged SmolLM2
    python scripts/bench_quant.py speed --shape qwen2.5-3b --tokens 4 --repeats 3
    python scripts/bench_quant.py kernels                       # Qwen2.5-3B's linear shapes, one token

quality: every variant scores the same English text in one forward; the table gives the mean
KL(fp32 unquantized || variant) of the next-token distribution per position, how often the top-1 token
is the same, and the perplexity. `int4 (file)` keeps the packaged GGUF's own Q4_1 values, `int4
(requant)` quantizes the dequantized weights anew. The output layer ("head") is as --quantize makes it
(int8; under int4 modes, tied as SmolLM2's is, rescored: int4 with its highest logits computed again from
the embedding) unless the variant names another format for it; it runs one position at a time, as in
decode. A second table rounds the decoder's weights to int4 in
groups of 32, 64 and 128, the groups of 32 once on the file's blocks and once shifted off them: what
quantizing anew costs by group size where the weights are not already on a 4-bit grid.
speed: one thread, a 16-token prompt, then greedy decode through the model's own forward; the
variants take turns, `--repeats` times; tok/s is the median, GB/s the bytes of weights read per token
(linears, the output layer, not the embedding's one row) times tok/s. `--shape qwen2.5-3b` is a
random-weight model with Qwen2.5-3B's config (~6 GB in bf16; ~12 GB of memory for all variants).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from itertools import chain

import torch
from bench_common import QWEN25_3B, decode_tokens_per_s, machine
from bench_dtype import TEXT as RHINE
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from kvchat.linears import int4_rounding
from kvchat.linears.bf16_linears import PackedLinear, TiledLinear
from kvchat.linears.quantized_linears import Int4Linear, Int8Linear
from kvchat.linears.rescored_head import RescoredHead
from kvchat.models.gguf_quant import GGUFInt4Layers
from kvchat.models.packaged import ensure_converted, packaged_gguf
from kvchat.models.progress import quiet_transformers
from kvchat.models.quantize import quantize_model

TEXT = RHINE + (
    " Further south, the river forms the border between Germany and France for almost two hundred "
    "kilometres. Strasbourg lies a few kilometres from its western bank, and its port is one of the "
    "largest on any inland waterway in Europe. The Rhine also feeds Lake Constance, which three countries "
    "share, and the lake in turn evens out the flow of the river below it. Many of the cities along the "
    "river were founded by the Romans, who used it as a frontier and built forts at the places where the "
    "legions crossed. Later the bishops of Mainz, Cologne and Trier became powerful princes, and the "
    "tolls they charged on every passing ship paid for their cathedrals. Poets of the nineteenth century "
    "made the river a symbol of the nation, and painters came to draw its rocks and ruined towers. Today "
    "the water is much cleaner than it was fifty years ago, when factories and towns still emptied their "
    "waste into it, and salmon have begun to return to some of its tributaries."
)


def variant(model: nn.Module, mode: str, head: str | None = None, from_file=None) -> nn.Module:
    """A copy of `model` sharing its tensors, with its linears quantized (the original untouched)."""
    shared = {id(t): t for t in chain(model.parameters(), model.buffers())}
    quantized = copy.deepcopy(model, memo=shared)
    with torch.no_grad():
        quantize_model(quantized, mode, head_mode=head, from_file=from_file)
    return quantized


def file_layers(model: nn.Module) -> GGUFInt4Layers:
    config = model.config
    index = ensure_converted() / "gguf-tensors.json"
    heads, kv_heads, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    return GGUFInt4Layers(packaged_gguf(), index, heads, kv_heads, layers)


def quality(args: argparse.Namespace) -> None:
    packaged = args.model is None
    folder = ensure_converted() if packaged else args.model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with quiet_transformers():
        fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    variants = {
        "none, bf16": bf16,
        "int8": variant(bf16, "int8"),
        "int8, head bf16": variant(bf16, "int8", head="none"),
    }
    if packaged:  # the GGUF file's own 4-bit values
        variants |= {
            "int4 (file)": variant(bf16, "int4", from_file=file_layers(bf16)),
            "int4 (file), head int8": variant(bf16, "int4", head="int8", from_file=file_layers(bf16)),
            "int4 (file), head bf16": variant(bf16, "int4", head="none", from_file=file_layers(bf16)),
            "int4 (file), head int4": variant(bf16, "int4", head="int4", from_file=file_layers(bf16)),
        }
    variants |= {
        "int4 (requant)": variant(bf16, "int4"),
        "int4 (requant), head int8": variant(bf16, "int4", head="int8"),
        "int4-g128": variant(bf16, "int4-g128"),
        "int4-g128, head int8": variant(bf16, "int4-g128", head="int8"),
        "int4-g128, head int4-g128": variant(bf16, "int4-g128", head="int4-g128"),
    }
    ids = torch.tensor([tokenizer.encode(TEXT)[: args.tokens]])  # (1, T)
    targets = ids[0, 1:]  # (T-1,)
    with torch.inference_mode():
        log_p = fp32(input_ids=ids).logits[0, :-1].float().log_softmax(-1)  # (T-1, V)
        reference = "packaged SmolLM2 (its Q4_1 values dequantized)" if packaged else folder
        print(f"reference: {reference}, fp32; {targets.numel()} positions")
        print("| variant | KL per token | same top-1 | perplexity |")
        print("|---|---:|---:|---:|")
        print(f"| none, fp32 | 0 | 100% | {perplexity(log_p, targets):.3f} |")
        for name, model in variants.items():
            log_q = decode_log_probs(model, ids)  # (T-1, V)
            kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
            top1 = float((log_p.argmax(-1) == log_q.argmax(-1)).float().mean())
            print(f"| {name} | {kl:.4f} | {top1:.1%} | {perplexity(log_q, targets):.3f} |")

    if packaged:  # its weights lie on the file's 4-bit grid, which the groups below straddle or not
        fresh_groups(fp32, ids[0], log_p)


def decode_log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(T-1, V): the next-token log-probabilities of `ids` (1, T), the decoder run over all of it at once,
    the output layer one position at a time, as decode runs it (a RescoredHead given many positions at
    once computes them all exactly)."""
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]  # (T-1, d)
    return torch.cat([model.lm_head(row[None]) for row in hidden]).float().log_softmax(-1)


def fresh_groups(model: nn.Module, ids: torch.Tensor, log_p: torch.Tensor) -> None:
    """What int4 costs by group size on weights not already on a 4-bit grid. The packaged weights are
    the file's Q4_1 values, so groups of 32 on its blocks give them back exactly; groups shifted by 16
    inputs straddle two blocks, as any group does on weights quantized anew. Each decoder linear is
    rounded to int4 (the output layer as it is), each group from its min to its max or over kvchat's
    searched range, and the model scored in fp32."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    print("\nint4 quantized anew, decoder linears only (the output layer as it is), scored in fp32")
    print("| groups | weight error (relative, mean) | KL per token | same top-1 |")
    print("|---|---:|---:|---:|")
    rows: list[tuple[str, int, int, bool | str]]
    rows = [("32, on the file's blocks", 32, 0, False), ("32, shifted by 16", 32, 16, False),
            ("64", 64, 0, False), ("128 (64 where 576 inputs)", 128, 0, False),
            ("32, shifted by 16, ranges searched", 32, 16, True),
            ("32, shifted by 16, ranges searched, scales nested (kvchat's)", 32, 16, "nested"),
            ("128 (64 where 576), ranges searched (kvchat's)", 128, 0, True)]  # fmt: skip
    with torch.inference_mode():
        for label, group, shift, searched in rows:
            errors = []
            for name, linear in linears.items():
                weight = original[name]
                size = group if weight.shape[1] % group == 0 else 64
                rounded = int4_values(weight.roll(-shift, 1), size, searched).roll(shift, 1)
                errors.append(float((rounded - weight).norm() / weight.norm()))
                linear.weight.copy_(rounded)
            log_q = model(input_ids=ids[None]).logits[0, :-1].float().log_softmax(-1)
            kl = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
            top1 = float((log_p.argmax(-1) == log_q.argmax(-1)).float().mean())
            print(f"| {label} | {statistics.mean(errors):.4f} | {kl:.4f} | {top1:.1%} |")
        for name, linear in linears.items():
            linear.weight.copy_(original[name])


def int4_values(weight: torch.Tensor, group: int, searched: bool | str) -> torch.Tensor:
    """(N, K) rounded to int4 in groups as kvchat rounds them, in fp32: each group's range searched
    (scale and zero in bf16, or "nested" scales), or from its min to its max."""
    groups = weight.reshape(weight.shape[0], -1, group)  # (N, K/G, G)
    if searched:
        codes, params = int4_rounding.round_groups(groups, nested=searched == "nested")
        scales, lows = params.values()
        return (codes.float() * scales[..., None] + lows[..., None]).reshape(weight.shape)
    codes, scales, zeros, _ = int4_rounding.round_to(groups, groups.amin(-1), groups.amax(-1))
    values = (codes.float() - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return values.reshape(weight.shape)


def perplexity(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(float(-log_probs.gather(-1, targets[:, None]).mean()))


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: all but the embedding (one row), the output layer included
    (a rescored one: its int4 weight and the rows it reads again)."""
    embedding = model.get_input_embeddings().weight
    seen = {id(embedding)}
    total = 0
    for tensor in chain(model.parameters(), model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.nbytes
    head = model.get_output_embeddings()
    if isinstance(head, RescoredHead):
        total += head.exact_bytes
    elif isinstance(head, nn.Linear) and head.weight is embedding:
        total += embedding.nbytes
    return total


def speed_model(shape: str) -> nn.Module:
    if shape == "smollm2":
        with quiet_transformers():
            return AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.bfloat16).eval()
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_3B)
    return Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()


def speed(args: argparse.Namespace) -> None:
    base = speed_model(args.shape)
    head_bf16 = variant(base, "int4", head="none")
    variants = {  # the int4 variants share their decoder layers: only the head is quantized anew
        "bf16": base,
        "int8": variant(base, "int8"),
        "int4": variant(head_bf16, "int4", head="rescored"),
        "int4, head int8": variant(head_bf16, "int4", head="int8"),
        "int4, head int4": variant(head_bf16, "int4", head="int4"),
        "int4, head bf16": head_bf16,
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved: the machine's drift falls on every variant alike
        for name, model in variants.items():
            rates[name].append(decode_tokens_per_s(model, args.tokens))
    print(f"{args.shape}, 1 thread, {args.tokens} tokens x {args.repeats}, variants interleaved")
    print("| variant | MB read per token | tok/s (median) | min | max | GB/s | vs bf16 (median of ratios) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, model in variants.items():
        rs, size = rates[name], weight_bytes_per_token(model)
        ratio = statistics.median(r / b for r, b in zip(rs, rates["bf16"], strict=True))
        med = statistics.median(rs)
        print(
            f"| {name} | {size / 1e6:.0f} | {med:.2f} | {min(rs):.2f} | {max(rs):.2f} | "
            f"{size * med / 1e9:.1f} | {ratio:.2f}x |"
        )


@torch.inference_mode()
def kernels(args: argparse.Namespace) -> None:
    """One bf16 token through each of Qwen2.5-3B's linear shapes: F.linear against oneDNN's and kvchat's
    bf16 kernels, and torch's and kvchat's int8 and int4 kernels (kvchat's int4 with nested scales, as
    `--quantize int4` makes them, and with bf16 ones, as a GGUF's Q4_1 layers)."""
    shapes = (("q, o", 2048, 2048), ("k, v", 2048, 256), ("gate, up", 2048, 11008), ("down", 11008, 2048),
              ("head", 2048, 151936))  # fmt: skip
    print(f"1 thread, one token (M = 1), {args.repeats} interleaved rounds; median ms and speed-up over bf16")
    quantized_kinds = (
        "bf16 oneDNN", "bf16 kvchat", "int8 torch", "int8 kvchat", "int4 torch", "int4 kvchat, bf16 scales",
        "int4 kvchat",
    )  # fmt: skip
    print(
        "| layer | in x out | bf16 ms | bf16 GB/s | "
        + " | ".join(f"{k} ms | vs bf16" for k in quantized_kinds)
        + " |"
    )
    print("|---|---|---:|---:|" + "---:|---:|" * len(quantized_kinds))
    for name, in_features, out_features in shapes:
        # Distinct copies, called in turn, so that every call reads its weights from memory: one matrix
        # called again and again stays in the L3 cache where it fits (32 MB here: int4's 2048 x 11008).
        copies = max(1, int(4e8 // (2 * in_features * out_features)))
        linears = [
            nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16) for _ in range(copies)
        ]
        layers: dict[str, list[nn.Module]] = {
            "bf16": linears,
            "bf16 oneDNN": [PackedLinear(linear) for linear in linears],
            "bf16 kvchat": [TiledLinear.of(linear) for linear in linears],
            "int8 torch": [Int8Linear.from_linear(linear, "torch") for linear in linears],
            "int8 kvchat": [Int8Linear.from_linear(linear, "kvchat") for linear in linears],
            "int4 torch": [Int4Linear.from_linear(linear, "torch") for linear in linears],
            "int4 kvchat, bf16 scales": [plain_int4(linear) for linear in linears],
            "int4 kvchat": [Int4Linear.from_linear(linear, "kvchat") for linear in linears],  # nested scales
        }
        x = torch.randn(1, in_features, dtype=torch.bfloat16)  # (1, K)
        rounds = max(1, int(2e8 // (2 * in_features * out_features * copies)))
        times: dict[str, list[float]] = {kind: [] for kind in layers}
        for _ in range(args.repeats):
            for kind, copied in layers.items():
                start = time.perf_counter()
                for _ in range(rounds):
                    for layer in copied:
                        layer(x)
                times[kind].append((time.perf_counter() - start) / (rounds * copies))
        ms = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        rate = linears[0].weight.nbytes / ms["bf16"] / 1e6
        quantized = " | ".join(f"{ms[kind]:.2f} | {ms['bf16'] / ms[kind]:.2f}x" for kind in quantized_kinds)
        print(f"| {name} | {in_features} x {out_features} | {ms['bf16']:.2f} | {rate:.1f} | {quantized} |")


def plain_int4(linear: nn.Linear) -> Int4Linear:
    """int4 in groups of 32 on kvchat's kernel with a bf16 scale and zero a group, as a GGUF's Q4_1."""
    groups = linear.weight.detach().float().reshape(linear.out_features, -1, 32)
    codes, scales = int4_rounding.round_groups(groups, nested=False)
    return Int4Linear(codes.reshape(linear.weight.shape), scales, None, "kvchat")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("part", choices=("quality", "speed", "kernels"))
    parser.add_argument("--tokens", type=int, help="quality: text tokens (400); speed: decoded tokens (32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", choices=("smollm2", "qwen2.5-3b"), default="smollm2")
    parser.add_argument("--model", help="quality: a local model folder (default: the packaged SmolLM2)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.part != "quality":
        print(machine())
    if args.part == "quality":
        args.tokens = args.tokens or 400
        quality(args)
    elif args.part == "kernels":
        kernels(args)
    else:
        args.tokens = args.tokens or 32
        speed(args)


if __name__ == "__main__":
    main()
