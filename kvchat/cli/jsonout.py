"""The `--json` form of each command's result: one JSON object per command, one per line."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from kvchat.chunks.blockmap import BlockMap
from kvchat.chunks.reports import AttentionReport, Comparison, FidelityReport, ModeAnswer
from kvchat.chunks.types import CacheStats, ChunkDetail, InferenceResult
from kvchat.cli.results import (
    ChunkChange,
    ChunkHeat,
    ChunkList,
    HelpView,
    Notice,
    OutputList,
    Quit,
    SettingsView,
)
from kvchat.cli.slash_commands import Command
from kvchat.models.info import ModelInfo


def result_json(cmd: str, record: object, line: int | None = None) -> dict[str, Any]:
    """The JSON object for one command that succeeded.

    Every object has `cmd` (the command's name without the slash, "chat" for plain text), `ok`
    (true/false), `error` (null or one line) and, when read from a script or stdin, `line` (where the
    command starts, 1-based). The rest depends on the command:

    - chat, infer, retry: `output` (the text), `output_number`, `chunk_id`, `finish_reason` ("stop",
      "stop_string", "length", "cancelled"), `mode`, `prompt_tokens`, `reused_tokens`,
      `repositioned_tokens`, `computed_tokens`, `generated_tokens`, `ttft_s`, `prefill_tok_s`,
      `decode_tok_s`, `had_think`, `drafted_tokens` and `accepted_tokens` (speculative decoding),
      `prompt_ids` (the prompt's token ids as the model read them: the chunks in the chat template, then
      the answer prompt), `output_ids` (the answer's token ids as generated, an end-of-turn token that
      stopped it included; `generated_tokens` counts them), and `chunks`: one object per chunk of the
      context, with `chunk_id`, `role`, `num_tokens`, `num_reused`, `num_repositioned`, `num_computed`,
      `num_recomputed` (of the computed ones, tokens whose moved KV repair replaced), then one for the
      answer prompt (the template's assistant header) with `chunk_id` and `role` null; the rows add up
      to the totals.
    - system, context, query, use-output, delete-output, drop: `action` and `chunk`, a chunk object:
      `number`, `chunk_id`, `role`, `text`, `num_tokens`, `num_blocks`, `num_refs`, `place` (1-based
      place in the context or null), `pinned`, `output_number` and `finish_reason` (null unless an
      output; "length" and "cancelled" mark a truncated one).
    - chunks: `chunks`, a list of chunk objects. output: `outputs`, a list of chunk objects.
    - show: `chunk`, a chunk object plus `token_ids`, `positions` and `kv_positions` (each
      `[start, stop)` as a two-number list, or null), `block_ids`, `had_think`, `source`.
    - stats: `stats` with `num_blocks`, `num_used`, `num_pinned`, `num_cached`, `num_free`,
      `block_size`, `bytes_total`, `bytes_per_block`, `hit_tokens`, `lookup_tokens`, `hit_rate`,
      `num_tokens` (the budget in tokens: blocks times block size) and `num_used_tokens`.
    - verify: `fidelity` with `mode`, `identical` (the logits bitwise equal at every compared position),
      `first_difference` (the first compared position, from 0, whose logits differ; null when identical),
      `kl_divergence`, `top1_agree`, `top5_overlap`, `max_logit_diff`, `greedy_agree`, `greedy_tokens`,
      `top1_rate`, `reused_tokens`, `repositioned_tokens`, `computed_tokens`.
    - blocks: `blocks`, one object per block that is not free: `block_id`, `state` ("pinned", "used"
      or "cached": unreferenced, holding reusable KV), `ref_count`, `chunk_ids` (chunks whose KV it
      holds), `exact` (false: moved KV, or KV computed after moved KV); `chunks`, the legend: `chunk_id`,
      `number`, `role`, `output_number`, `num_blocks`; and `counts`: `num_blocks`, `num_used`,
      `num_pinned`, `num_shared` (more than one reference), `num_cached`, `num_moved`, `num_free`.
    - attention: `output_number`, `num_queries`, `num_layers`, `over_live_kv`, and `chunks`: the sink
      tokens (role "sink"), each context chunk, then the answer (role "answer"), each with `chunk_id`,
      `role`, `number`, `num_tokens`, `attention_share` and `by_layer_group` ({"early": share, ...});
      the shares sum to 1.
    - compare: `reference` (the mode the others are compared with) and `results`, one per mode:
      `mode`, `output`, `ttft_s`, `reused_tokens`, `repositioned_tokens`, `computed_tokens`,
      `generated_tokens`, `first_difference` (token index, null when identical), `agreement`.
    - show with heat: `chunk` as for show, `output_number`, `pieces` (each token's text) and `heat`
      (each token's share of the answer's attention).
    - set: `settings` ({"table.key": value}) and `resolved` (what `auto` model settings resolved to,
      {"model.dtype": "bf16", ...}) when listing; `key` and `value` when showing or changing one
      (showing adds `resolved` where `auto` resolved to something).
    - info: `info` with `model_id`, `source`, `family`, `architecture`, `num_parameters`, `dtype`,
      `quantization`, `decode`, `reuse`, `context_length`, `chat_template`, `default_system_prompt`,
      `kv_tokens`, `kv_bytes`, `block_size`, `device`, `threads`.
    - mode: `mode`. save, load: `path`, `num_chunks`. clear, reset: `message`. evict: `num_evicted`.
    - help: `commands`, a list of {`name`, `usage`, `summary`, `aliases`}; `/help NAME` adds `command`,
      with `details` (the longer help).
    - quit: nothing more.
    """
    out: dict[str, Any] = {"cmd": cmd, "ok": True, "error": None}
    if line is not None:
        out["line"] = line
    out.update(_fields(record))
    return out


def error_json(cmd: str | None, message: str, line: int | None = None) -> dict[str, Any]:
    """The JSON object for one command that failed; `cmd` is null when the line could not be read."""
    out: dict[str, Any] = {"cmd": cmd, "ok": False, "error": message}
    if line is not None:
        out["line"] = line
    return out


def dumps(obj: dict[str, Any]) -> str:
    """One line of strict JSON: a number that is not finite (a KL of inf, a NaN) becomes null,
    since `Infinity` and `NaN` are not JSON. ensure_ascii=False keeps model text readable; ranges
    become [start, stop]."""
    return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, default=_range_as_list)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _fields(record: object) -> dict[str, Any]:
    match record:
        case InferenceResult():
            return _inference_fields(record)
        case ChunkChange(action=action, chunk=chunk):
            return {"action": action, "chunk": asdict(chunk)}
        case ChunkList(chunks=chunks):
            return {"chunks": [asdict(c) for c in chunks]}
        case OutputList(outputs=outputs):
            return {"outputs": [asdict(c) for c in outputs]}
        case ChunkDetail():
            detail = asdict(record)
            return {"chunk": {**detail.pop("info"), **detail}}
        case CacheStats():
            tokens = {"num_tokens": record.num_blocks * record.block_size}
            tokens["num_used_tokens"] = record.num_used * record.block_size
            return {"stats": {**asdict(record), **tokens, "hit_rate": record.hit_rate}}
        case FidelityReport():
            return {"fidelity": {**asdict(record), "identical": record.identical}}
        case BlockMap():
            return {
                "blocks": [asdict(b) for b in record.blocks],
                "chunks": [asdict(k) for k in record.chunks],
                "counts": record.counts(),
            }
        case AttentionReport():
            fields = asdict(record)
            del fields["token_weights"], fields["positions"]
            return fields
        case Comparison(reference=reference, results=results):
            return {"reference": reference, "results": [_answer_fields(r) for r in results]}
        case ChunkHeat(detail=detail, output_number=number, pieces=pieces, weights=weights):
            return {**_fields(detail), "output_number": number, "pieces": pieces, "heat": weights}
        case SettingsView(values=values, resolved=resolved):
            return {"settings": values, "resolved": resolved}
        case HelpView(commands=commands, topic=topic):
            topic_fields = {"command": {**_command_fields(topic), "details": topic.details}} if topic else {}
            return {"commands": [_command_fields(c) for c in commands], **topic_fields}
        case ModelInfo():
            return {"info": asdict(record)}
        case Notice(text=text, data=data):
            return data or {"message": text}
        case Quit():
            return {}
    raise TypeError(f"no JSON form for {type(record).__name__}")


def _inference_fields(result: InferenceResult) -> dict[str, Any]:
    fields = asdict(result)
    fields["output"] = fields.pop("text")
    fields["output_ids"] = fields.pop("token_ids")
    fields["generated_tokens"] = len(fields["output_ids"])
    return fields


def _answer_fields(answer: ModeAnswer) -> dict[str, Any]:
    fields = asdict(answer)
    fields["generated_tokens"] = len(fields.pop("token_ids"))
    del fields["first_difference_char"]
    return fields


def _command_fields(cmd: Command) -> dict[str, Any]:
    return {"name": cmd.name, "usage": cmd.usage, "summary": cmd.summary, "aliases": list(cmd.aliases)}


def _range_as_list(value: object) -> list[int]:
    if isinstance(value, range):
        return [value.start, value.stop]
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
