"""An int4 output layer whose highest logits are computed again from the exact weight.

The output layer is the largest matrix a token reads (Qwen2.5-3B: 151,936 x 2,048; 0.31 GB in int8,
a sixth of an int4 token), and the most sensitive to rounding: in int4 alone it costs SmolLM2 a KL of
0.065 and a top-1 of 84%. But only the highest logits decide what is sampled, and a model whose output
layer is tied to its embedding keeps the exact rows in memory anyway. So the layer runs in int4 over the
whole vocabulary, and at least its `num_exact` highest logits are computed again from those rows
(kvchat::rescore_top, native/rescore.cpp; torch's top-k and gather where that is not built): the int4
weight (4.5 bits a weight) and ~1,024 rows (4 MB on a 3B model) read a token instead of 8 bits a weight,
0.18 GB instead of 0.31 on Qwen2.5-3B's shapes. On SmolLM2 the error left is in the tail's mass (~2%
of it beyond the 1,024 highest, whose logits stay int4's; sampling at a temperature without top-k or
top-p draws from it): KL 0.0037 against an int8 layer's 0.0022 (docs/quantization.md), the
top-1 that of the exact layer.

Every row is rescored alike however many are asked for at once (speculation's drafts): a row's logits
are the same bits alone or among others.
"""

from __future__ import annotations

import torch
from torch import nn

from kvchat.linears.quantized_linears import Int4Linear
from kvchat.native import kernels

NUM_EXACT = 1024  # the logits of each row computed again from the exact weight (at least)


class RescoredHead(nn.Module):
    """`coarse` (the layer in int4) over the vocabulary, its `num_exact` highest logits a row taken from
    `weight` (V, K), the exact weight it was quantized from, shared with the embedding."""

    def __init__(self, coarse: nn.Module, weight: torch.Tensor, num_exact: int = NUM_EXACT) -> None:
        super().__init__()
        if not isinstance(coarse, Int4Linear) or coarse.bias is not None:
            raise ValueError("a rescored head's coarse layer is int4, without a bias")
        if tuple(weight.shape) != (coarse.out_features, coarse.in_features):
            raise ValueError("a rescored head needs the exact weight of its int4 layer")
        self.coarse = coarse
        self.weight = weight
        self.num_exact = min(num_exact, coarse.out_features)

    @property
    def in_features(self) -> int:
        return self.coarse.in_features

    @property
    def out_features(self) -> int:
        return self.coarse.out_features

    @property
    def exact_bytes(self) -> int:
        """Bytes of the exact weight read for a row of logits."""
        return self.num_exact * self.in_features * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.reshape(-1, self.in_features)  # (M, K)
        logits = self.coarse(hidden)  # (M, V)
        kernels.rescore(logits, self.weight, hidden, self.num_exact)
        return logits.view(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"its {self.num_exact} highest logits a row from the exact weight"
