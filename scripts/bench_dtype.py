"""Does the model answer the same in bf16 as in fp32? Greedy agreement and perplexity, side by side.

    python scripts/bench_dtype.py --threads 1

For each prompt of a fixed set of plain questions (through the chat template), both dtypes generate
`--tokens` greedy tokens with transformers' `generate`; the table counts identical answers and the
leading tokens that agree. Then both score a fixed English text: perplexity, and the mean KL divergence
of bf16's next-token distribution from fp32's.
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_common import machine
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvchat.models.packaged import ensure_converted
from kvchat.models.progress import quiet_transformers

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What does a thermometer measure?",
    "Write one sentence about the sea.",
    "Why is the sky blue?",
    "What is 12 plus 30?",
    "Give a synonym for happy.",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
)

TEXT = (
    "The Rhine rises in the Swiss Alps and flows north through Germany and the Netherlands into the "
    "North Sea. For centuries it has carried goods between the mountains and the coast, and towns grew "
    "along its banks wherever a bridge or a ford made crossing possible. Barges still move coal, grain "
    "and containers on the river today, although railways and roads now carry most of the freight. In "
    "summer, tourists take boats through the gorge between Bingen and Koblenz, where castles stand on "
    "the hills above the vineyards. The river's level rises with the melting snow in spring and falls in "
    "late summer, and in dry years ships must leave part of their cargo behind to pass the shallow "
    "stretches. Engineers straightened its course in the nineteenth century to prevent floods and to make "
    "navigation easier, but the work also changed the habitats of fish and birds along the old channels."
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a local model folder (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per answer")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    folder = args.model or ensure_converted()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with quiet_transformers():
        models = {
            name: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        }
    same, leading, total = 0, 0, 0
    for prompt in PROMPTS:
        answers = {name: greedy(model, tokenizer, prompt, args.tokens) for name, model in models.items()}
        agree = leading_agreement(answers["fp32"], answers["bf16"])
        same += answers["fp32"] == answers["bf16"]
        leading += agree
        total += len(answers["fp32"])
        print(f"{agree:3d}/{len(answers['fp32']):<3d} {prompt}")
        for name, ids in answers.items():
            print(f"    {name}: {tokenizer.decode(ids, skip_special_tokens=True)!r}")
    print(f"\nidentical greedy answers: {same} of {len(PROMPTS)}")
    print(f"leading tokens that agree: {leading} of {total} ({leading / total:.0%})")
    ids = torch.tensor([tokenizer.encode(TEXT)])  # (1, T)
    with torch.inference_mode():
        logits = {
            name: model(input_ids=ids).logits[0, :-1].float() for name, model in models.items()
        }  # (T-1, V)
    targets = ids[0, 1:]  # (T-1,)
    for name, rows in logits.items():
        nll = torch.nn.functional.cross_entropy(rows, targets)
        print(f"perplexity {name}: {math.exp(float(nll)):.3f} over {targets.numel()} tokens")
    log_p = logits["fp32"].log_softmax(-1)  # (T-1, V)
    log_q = logits["bf16"].log_softmax(-1)  # (T-1, V)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    top1 = (logits["fp32"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean()
    print(f"KL(fp32 || bf16) per token: {float(kl):.4f}; same top-1 at {float(top1):.0%} of positions")


def greedy(model, tokenizer, prompt: str, num_tokens: int) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False)  # (1, T + N)
    return out[0, ids.shape[1] :].tolist()


def leading_agreement(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


if __name__ == "__main__":
    main()
