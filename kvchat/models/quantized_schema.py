"""The declared schema of a kept quantized-layers file (models/quantized_cache.py): its metadata, and the
names, dtypes and sizes of its tensors, checked before any layer is built from them.

`parse_kept(metadata, mode)` returns the validated `KeptLayers` or raises `KeptLayersError` naming the
first thing wrong; `check_tensors` does the same for the tensors. Plain Python over what the file says
(pydantic, no torch): the file is untrusted, whatever its seal says.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Kernel = Literal["kvchat", "torch"]
Mode = Literal["int8", "int4", "int4-g128"]
TILE_ROWS = 16  # the rows of a tile of kvchat's layouts (linears/weight_layout.py)
NESTED_HEAD_BYTES = 64  # a nested tile's bf16 row scales and lows
GROUP_SIZES = (32, 64, 128)  # linears/quantized_linears.py's INT4_GROUP_SIZES


class KeptLayersError(ValueError):
    """The file breaks the schema; the message names the first thing wrong."""


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Int8Spec(_Record):
    kind: Literal["Int8Linear"] = Field(alias="class")
    kernel: Kernel
    in_features: int = Field(ge=16, multiple_of=16)
    out_features: int = Field(ge=1)

    def buffer_sizes(self) -> dict[str, tuple[tuple[str, ...], int]]:
        """Each buffer's allowed dtypes and number of elements."""
        n, k = self.out_features, self.in_features
        return {"codes": (("int8", "uint8"), n * k), "scales": (("bfloat16",), n), "bias": (("bfloat16",), n)}


class Int4Spec(_Record):
    kind: Literal["Int4Linear"] = Field(alias="class")
    kernel: Kernel
    in_features: int = Field(ge=32)
    out_features: int = Field(ge=16, multiple_of=16)
    group_size: int  # 32, 64 or 128 (a Literal of ints would take 32.0)
    nested: bool
    num_exact: int | None = Field(default=None, ge=1)  # set on an output layer run as a RescoredHead

    @model_validator(mode="after")
    def _groups_fit(self) -> Int4Spec:
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"groups of {self.group_size} inputs; int4 takes {GROUP_SIZES}")
        if self.in_features % self.group_size:
            raise ValueError(f"{self.in_features} inputs are no whole number of groups of {self.group_size}")
        if self.nested and (self.kernel != "kvchat" or self.group_size != 32):
            raise ValueError("nested scales are for groups of 32 on kvchat's kernel only")
        return self

    def buffer_sizes(self) -> dict[str, tuple[tuple[str, ...], int]]:
        n, k, g = self.out_features, self.in_features, self.group_size
        params = (
            (("uint8",), n // TILE_ROWS * (NESTED_HEAD_BYTES + k))
            if self.nested
            else (("bfloat16",), 2 * n * k // g)
        )
        return {"packed": (("uint8",), n * k // 2), "params": params, "bias": (("bfloat16",), n)}


LayerSpec = Annotated[Int8Spec | Int4Spec, Field(discriminator="kind")]


class Report(_Record):
    """models/quantize.py's QuantizeReport, as kept."""

    mode: Mode
    quantized: list[str]
    kept_from_file: list[str]
    nested: list[str]
    rescored: list[str]
    refused: list[str]


class KeptLayers(_Record):
    code: str
    layers: dict[str, LayerSpec]
    report: Report

    @model_validator(mode="after")
    def _consistent(self) -> KeptLayers:
        replaced = self.report.quantized + self.report.kept_from_file
        if sorted(replaced) != sorted(self.layers) or len(set(replaced)) != len(replaced):
            raise ValueError("the layers kept are not the layers the report names")
        rescored = {name for name, spec in self.layers.items() if getattr(spec, "num_exact", None)}
        if rescored != set(self.report.rescored):
            raise ValueError("the rescored output layers are not the ones the report names")
        nested = {name for name, spec in self.layers.items() if getattr(spec, "nested", False)}
        if nested != set(self.report.nested):
            raise ValueError("the layers with nested scales are not the ones the report names")
        if self.report.mode == "int8" and any(isinstance(s, Int4Spec) for s in self.layers.values()):
            raise ValueError("an int8 file holds int4 layers")
        return self


def parse_kept(metadata: dict[str, str], mode: str, code: str) -> KeptLayers:
    """The file's metadata, validated: made by this code (`code`) for `mode`."""
    try:
        kept = KeptLayers.model_validate(
            {
                "code": metadata.get("code"),
                "layers": json.loads(metadata.get("layers", "null")),
                "report": json.loads(metadata.get("report", "null")),
            }
        )
    except ValueError as err:  # ValidationError or bad JSON
        raise KeptLayersError(_first_error(err)) from None
    if kept.code != code:
        raise KeptLayersError("made by another version of kvchat")
    if kept.report.mode != mode:
        raise KeptLayersError(f"made for {kept.report.mode}, not {mode}")
    return kept


def check_tensors(kept: KeptLayers, tensors: dict[str, tuple[str, int]]) -> None:
    """`tensors` ({name: (dtype, number of elements)}) are exactly the buffers the layers take (a bias
    may be absent), each of its dtype and size."""
    expected: set[str] = set()
    for layer, spec in kept.layers.items():
        for buffer, (dtypes, size) in spec.buffer_sizes().items():
            key = f"{layer}.{buffer}"
            if key not in tensors:
                if buffer == "bias":
                    continue
                raise KeptLayersError(f"{key} is missing")
            dtype, numel = tensors[key]
            if dtype not in dtypes or numel != size:
                raise KeptLayersError(f"{key} holds {numel} {dtype} values, not {size} {dtypes[0]}")
            expected.add(key)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise KeptLayersError(f"{extra[0]} belongs to no layer")


def _first_error(err: ValueError) -> str:
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return f"its metadata is not JSON ({err})"
