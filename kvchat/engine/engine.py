"""The engine: runs a transformers causal LM over sequences whose KV lives in the paged pool.

It deals in token ids only. A sequence starts by reusing whatever exact KV the pool already holds for
its leading tokens; `compute` runs the model over the rest, in pieces of at most `prefill_chunk`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn

from kvchat.engine import native_attention
from kvchat.engine.block_manager import ROOT_HASH, BlockManager, Sequence, chain_hash
from kvchat.engine.costs import VERIFY_COSTS
from kvchat.engine.decode_step import MAX_LEAN_TOKENS, make_decode_step
from kvchat.engine.forward_cache import ForwardCache, cache_argument
from kvchat.engine.paged_attention import KVPool, PagedKV
from kvchat.errors import CacheFullError
from kvchat.linears.bf16_linears import TiledLinear, UpcastLinear, serve_bf16_linears_, tile_linears_
from kvchat.linears.quantized_linears import Int4Linear, Int8Linear
from kvchat.native import kernels


def kv_shape(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers decoder config."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def quantized_kernel(model: nn.Module) -> str | None:
    """Which of kvchat's quantized kernels the model's decoder layers run: "int4", "int8" or None."""
    kinds = {
        type(m) for m in model.modules() if isinstance(m, Int4Linear | Int8Linear) and m.kernel == "kvchat"
    }
    return "int4" if Int4Linear in kinds else "int8" if Int8Linear in kinds else None


class Engine:
    """Paged KV cache + model forward for one sequence at a time."""

    def __init__(
        self,
        model,
        *,
        kv_memory_bytes: int,
        block_size: int,
        prefill_chunk: int,
        lean_decode: bool = True,
        batch_invariant: bool = True,
    ):
        self.model = model
        self.batch_invariant = batch_invariant
        kernels.set_batch_invariant(batch_invariant)
        if lean_decode:  # bf16 and fp32 linears on kvchat's kernels, else bf16 on torch's, in place
            tile_linears_(model)
            serve_bf16_linears_(model)
        self._decode_step = make_decode_step(model) if lean_decode else None
        self.block_size, self.prefill_chunk = block_size, prefill_chunk
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_layers, self.num_kv_heads, self.head_dim = kv_shape(model.config)
        self.bytes_per_block = KVPool.bytes_per_block(
            self.num_layers, block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
        num_blocks = kv_memory_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise CacheFullError(
                f"KV memory {kv_memory_bytes} bytes holds no block of {self.bytes_per_block} bytes"
            )
        self.blocks = BlockManager(num_blocks, block_size)
        self.pool = KVPool(
            self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype, self.device
        )
        kernel = native_attention.for_pool(self.dtype, self.device) if self._decode_step is not None else None
        self._kv = PagedKV(self.pool, kernel)
        # batch invariance on, every chunk takes the lean step where its layers are one native op
        native = self._decode_step is not None and self._decode_step.parts is not None and self._kv.in_place
        self._every_chunk_lean = batch_invariant and native
        self._cache = ForwardCache(self._kv, self.num_layers)
        self._seq_ids = itertools.count(1)
        # kvchat's quantized kernels: a step's extra rows cost more of a token than bf16's (verify_cost)
        self._quantized = quantized_kernel(model)
        self._tiled = any(isinstance(m, TiledLinear) for m in model.modules())
        self._upcast = any(isinstance(m, UpcastLinear) for m in model.modules())

    @property
    def decode_path(self) -> str:
        """How single tokens decode, in words."""
        if self._decode_step is None:
            return "module forward"
        if self._kv.kernel is not None:
            return "lean step"
        return f"lean step, attention by gather ({native_attention.gather_reason(self.dtype, self.device)})"

    @property
    def batch_invariance(self) -> str | None:
        """Why a token's logits may depend on the tokens computed with it (its prefill chunk, the drafts
        checked with it, how much of the context was cached), in a few words; None where they cannot."""
        if not self.batch_invariant:
            return "off (model.batch_invariant)"
        if self._decode_step is None:
            return "the module forward decodes this model"
        if not self._kv.in_place:
            return "attention by gather"
        return self._decode_step.batch_invariance()

    def verify_cost(self, num_drafts: int, context: int = 0) -> float:
        """What a forward over the last token and `num_drafts` drafts costs, in single-token steps of
        this engine's decode path, after `context` tokens: what speculation's draft budget weighs a
        step's tokens against (kvchat.engine.costs, measured as it says)."""
        if self._decode_step is not None and self._quantized:
            path = f"lean-{self._quantized}"
        elif self._decode_step is not None and self.dtype == torch.float32 and self.device.type == "cpu":
            path = "lean-fp32-tiled" if self._tiled else "lean-fp32"
        elif self._decode_step is not None and self._tiled:
            path = "lean-tiled"
        elif self._decode_step is not None and self._upcast:
            path = "lean-upcast"
        else:
            path = "lean"
        cost, thousands = VERIFY_COSTS[path], context / 1000
        checked = max(1.0, cost.fixed + cost.fixed_per_1k * thousands)
        return checked + (cost.per_draft + cost.per_draft_per_1k * thousands) * num_drafts

    @property
    def max_positions(self) -> int | None:
        """The most positions the model was trained for, when its config says."""
        return getattr(self.model.config, "max_position_embeddings", None)

    # -- the blocks, as callers read them ---------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most tokens the KV budget holds."""
        return self.blocks.capacity_tokens

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now (cached KV among them is evicted as they are taken)."""
        return self.blocks.num_free

    def evict_cached(self) -> int:
        """Forget the KV of every block that nothing holds; returns how many blocks did hold some."""
        return self.blocks.evict_cached()

    # -- sequence lifecycle ------------------------------------------------------------------------

    def start(self, token_ids: list[int], reuse: bool = True, index: bool = True) -> Sequence:
        """A new sequence over `token_ids` with its blocks (see `admit`). The caller owns it: free it or
        hand it on. A failure part-way frees what it took."""
        seq = self.new_sequence(token_ids, index)
        try:
            self.admit(seq, reuse)
        except BaseException:
            self.free(seq)
            raise
        return seq

    def new_sequence(self, token_ids: list[int], index: bool = True) -> Sequence:
        """A sequence over `token_ids` holding no block yet; with `index`, the KV it computes is declared
        reusable in turn."""
        assert token_ids, "a sequence needs at least one token"
        return Sequence(list(token_ids), self.block_size, seq_id=next(self._seq_ids), indexed=index)

    def admit(self, seq: Sequence, reuse: bool = True) -> None:
        """Give a new sequence its blocks, sharing the longest exact prefix already cached (unless not
        `reuse`). Each block is in `seq.block_table` from the moment it is taken, so freeing the sequence
        after a failure part-way returns all of them. At least the last token is left to compute, so
        the caller always gets logits."""
        assert not seq.block_table and seq.num_computed == 0, "admit a new sequence once"
        token_ids = seq.token_ids
        match = self.blocks.match_prefix(token_ids, max_tokens=len(token_ids) - 1) if reuse else None
        shared = match.shared_block_ids if match else []
        copy_from = [match.copy_from] if match and match.copy_from is not None and match.num_copy else []
        for block_id in shared:
            self.blocks.acquire(block_id)
            seq.block_table.append(block_id)
        with self.blocks.hold(copy_from):  # kept from being evicted by the allocation below
            seq.block_table += self.blocks.allocate(seq.num_blocks_needed - len(shared))
            seq.num_computed = seq.num_recorded = len(shared) * self.block_size
            if copy_from:
                assert match is not None
                src = torch.arange(match.num_copy, device=self.device) + copy_from[0] * self.block_size
                dst = self._slots(seq, seq.num_computed, seq.num_computed + match.num_copy)
                self.pool.copy(src, dst)
                seq.num_computed += match.num_copy
        self._record(seq)

    def extend(self, seq: Sequence, token_ids: Iterable[int]) -> None:
        """Append tokens to a sequence (their KV is computed by the next `compute`)."""
        seq.token_ids.extend(token_ids)
        if seq.num_blocks_needed > len(seq.block_table):
            seq.block_table += self.blocks.allocate(seq.num_blocks_needed - len(seq.block_table))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the tokens from `num_tokens` on, and their KV: blocks past the end go back unrecorded, a
        block recorded with dropped tokens keeps only the kept ones.
        The dropped positions must be private to the sequence (anything it computed itself is)."""
        assert 0 <= num_tokens <= seq.num_tokens
        bs = self.block_size
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[num_tokens // bs :]
        seq.num_computed = min(seq.num_computed, num_tokens)
        if seq.num_exact is not None:
            seq.num_exact = min(seq.num_exact, num_tokens)
        dropped = seq.block_table[seq.num_blocks_needed :]
        del seq.block_table[seq.num_blocks_needed :]
        self.blocks.discard(dropped)
        limit = min(seq.num_computed, seq.exact_limit)
        if seq.num_recorded > limit:
            first = limit // bs
            for block_id in seq.block_table[first : -(-seq.num_recorded // bs)]:
                self.blocks.unrecord(block_id)
            seq.num_recorded = first * bs
        self._record(seq)

    def index(self, seq: Sequence) -> None:
        """Declare a sequence started with `index=False` reusable from now on (a load, once committed)."""
        seq.indexed = True
        self._record(seq)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; their exact KV stays findable until evicted."""
        self.blocks.release(seq.block_table)
        seq.block_table = []

    # -- running the model -------------------------------------------------------------------------

    @torch.inference_mode()
    def compute(
        self, seq: Sequence, all_logits: bool = False, until: int | None = None, record: bool = True
    ) -> torch.Tensor:
        """Run the model over the tokens without KV, up to `until` (default: all). Returns the last
        computed token's logits (V,), or with `all_logits` those of every computed token (q, V).
        Without `record` the new KV is not declared reusable (tokens that may be rolled back: the
        next `truncate` records what stays)."""
        until = seq.num_tokens if until is None else until
        assert seq.num_computed < until <= seq.num_tokens, "nothing to compute"
        pieces = []
        while seq.num_computed < until:
            end = min(until, seq.num_computed + self.prefill_chunk)
            logits = self._forward(seq, seq.num_computed, end, all_logits, record)
            if all_logits:
                pieces.append(logits)
        return torch.cat(pieces) if all_logits else logits[-1]

    def _forward(self, seq: Sequence, start: int, end: int, all_logits: bool, record: bool) -> torch.Tensor:
        input_ids = torch.tensor([seq.token_ids[start:end]], device=self.device)  # (1, q)
        position_ids = torch.arange(start, end, device=self.device).unsqueeze(0)  # (1, q)
        if self._decode_step is not None and (end - start <= MAX_LEAN_TOKENS or self._every_chunk_lean):
            self._kv.bind(self._slots(seq, start, end), seq.block_table, end)
            logits = self._decode_step(input_ids, position_ids, self._kv, end - start if all_logits else 1)
        else:
            self._kv.bind(self._slots(seq, start, end), seq.block_table, end)
            self._cache.bind(start)
            logits = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                **cache_argument(self.model, self._cache),
                use_cache=True,
                logits_to_keep=0 if all_logits else 1,
            ).logits[0]
        seq.num_computed = end
        if record:
            self._record(seq)
        return logits  # (q, V) or (1, V)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        return torch.tensor(seq.slots(start, end), dtype=torch.long, device=self.device)

    def _record(self, seq: Sequence) -> None:
        """Declare the sequence's newly computed exact KV reusable, block by block."""
        limit = min(seq.num_computed, seq.exact_limit)
        if not seq.indexed or limit <= seq.num_recorded:
            return
        bs = self.block_size
        for index in range(seq.num_recorded // bs, (limit - 1) // bs + 1):
            piece = seq.token_ids[index * bs : min((index + 1) * bs, limit)]
            self.blocks.record(seq.block_table[index], self._prefix_hash(seq, index), piece)
        seq.num_recorded = limit

    def _prefix_hash(self, seq: Sequence, num_blocks: int) -> int:
        """Chained hash of the sequence's first `num_blocks` full blocks (memoized: they never change)."""
        chain = seq.block_hashes
        while len(chain) < num_blocks:
            index = len(chain)
            piece = seq.token_ids[index * self.block_size : (index + 1) * self.block_size]
            chain.append(chain_hash(chain[-1] if chain else ROOT_HASH, piece))
        return chain[num_blocks - 1] if num_blocks else ROOT_HASH

    # -- KV access for the chunk layer --------------------------------------------------------------

    def read_kv(self, seq: Sequence, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions start..end-1 of a sequence: (L, T, H, D) each."""
        assert end <= seq.num_computed
        return self.pool.gather(self._slots(seq, start, end))

    def gather(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at pool slots: (L, T, H, D) each."""
        return self.pool.gather(torch.tensor(slots, dtype=torch.long, device=self.device))

    def write_kv(
        self, seq: Sequence, start: int, keys: torch.Tensor, values: torch.Tensor, exact: bool = False
    ) -> None:
        """Place K/V (L, T, H, D) at positions start.. of a sequence. Unless `exact` (KV known to be
        what a forward would compute, e.g. loaded from a file), nothing from `start` on is reusable."""
        assert start == seq.num_computed
        end = start + keys.shape[1]
        self.pool.scatter(self._slots(seq, start, end), keys, values)
        if not exact:
            seq.num_exact = min(seq.exact_limit, start)
        seq.num_computed = end
        self._record(seq)
