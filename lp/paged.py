"""A paged K/V cache shared by every running sequence of a batched step (lp.batch).

Contract: one pool of ``kv_tokens`` slots per layer, cut into fixed-size blocks of
``block_size`` slots; each sequence owns a block table (its blocks in order) and a
length (rows committed to the cache). Logical row i of a sequence lives in slot
``table[i // block_size] * block_size + i % block_size``. A sequence's blocks are
taken from the free list as its rows grow and handed back when it shrinks or leaves.

``PagedCache`` is a ``transformers.Cache``: before a forward the caller ``plan``s the
step (which sequences, how many new rows each); the model's public forward then
calls ``update(k, v, layer)`` once per layer, which writes the step's rows into their
slots and returns the K/V of exactly the slots the step reads -- each running
sequence's used rows, sequence after sequence -- so attention costs ~ (step rows) x
(sum of the running lengths), never (step rows) x (all slots). The caller builds the
mask over that gathered key order (lp.batch: a row sees its own sequence's prefix and
its own ancestors only).

After verification, ``commit`` keeps a prefix of each sequence and moves its accepted
rows next to it (one gather/scatter per layer for the whole batch); blocks past the new
length return to the free list.

Admission is by reservation: ``reserve(seq, tokens)`` books the most rows a sequence
can ever hold (prompt + max_new_tokens + its largest step), so a running sequence never
finds the pool empty; ``can_reserve`` says whether a waiting one fits now, and a
request larger than the whole pool is refused by the caller up front.

Legend: H_kv key/value heads, D head size, Q rows of the step, K gathered key rows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockTable:
    """Free list of blocks, a table and a length per sequence, and the reservations."""

    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.reserved: dict[int, int] = {}  # blocks booked per sequence

    # -- admission ---------------------------------------------------------------

    def can_reserve(self, tokens: int) -> bool:
        return sum(self.reserved.values()) + blocks_for(tokens, self.block_size) <= self.num_blocks

    def reserve(self, seq: int, tokens: int) -> None:
        assert seq not in self.tables and self.can_reserve(tokens)
        self.tables[seq], self.lengths[seq] = [], 0
        self.reserved[seq] = blocks_for(tokens, self.block_size)

    def release(self, seq: int) -> None:
        """The sequence leaves: every block back to the free list."""
        self.free.extend(reversed(self.tables.pop(seq)))
        del self.lengths[seq], self.reserved[seq]

    # -- rows ----------------------------------------------------------------------

    def grow(self, seq: int, rows: int) -> None:
        """Blocks for logical rows [0, rows) of ``seq``."""
        table = self.tables[seq]
        need = blocks_for(rows, self.block_size)
        assert need <= self.reserved[seq], f"sequence {seq} needs {need} blocks, reserved {self.reserved[seq]}"
        while len(table) < need:
            table.append(self.free.pop())

    def shrink(self, seq: int, rows: int) -> None:
        """Keep logical rows [0, rows); blocks past them go back to the free list."""
        self.lengths[seq] = rows
        table = self.tables[seq]
        keep = blocks_for(rows, self.block_size)
        while len(table) > keep:
            self.free.append(table.pop())

    def slots(self, seq: int, start: int, stop: int) -> list[int]:
        """Slots of logical rows [start, stop) of ``seq``."""
        bs, table = self.block_size, self.tables[seq]
        return [table[i // bs] * bs + i % bs for i in range(start, stop)]

    def slot(self, seq: int, row: int) -> int:
        bs = self.block_size
        return self.tables[seq][row // bs] * bs + row % bs

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - len(self.free)


class PagedCache(Cache):
    """``kv_tokens`` slots per layer in ``block_size`` blocks (see module doc)."""

    def __init__(self, kv_tokens: int, block_size: int = 16):
        if kv_tokens < block_size:
            raise ValueError(f"server.kv_tokens must be at least the block size {block_size}, got {kv_tokens}")
        self.blocks = BlockTable(kv_tokens // block_size, block_size)
        self.kv_tokens = self.blocks.num_blocks * block_size
        self.keys: list[torch.Tensor] = []  # per layer [H_kv, slots, D], allocated on first write
        self.values: list[torch.Tensor] = []
        self._write = None  # [Q] slots the step's rows go to
        self._read = None  # [K] slots the step's rows read, sequence after sequence
        super().__init__(layers=[])

    # -- the step ----------------------------------------------------------------------

    def plan(self, items: list[tuple[int, int]], device) -> list[tuple[int, int]]:
        """Prepare a forward over ``items`` = [(seq, new rows)] in row order: grow the tables,
        set the write/read slots. Returns each sequence's (prefix length, gathered key offset)."""
        write, read, spans = [], [], []
        for seq, q in items:
            length = self.blocks.lengths[seq]
            self.blocks.grow(seq, length + q)
            spans.append((length, len(read)))
            write += self.blocks.slots(seq, length, length + q)
            read += self.blocks.slots(seq, 0, length + q)
        self._write = torch.tensor(write, dtype=torch.long, device=device)
        self._read = torch.tensor(read, dtype=torch.long, device=device)
        return spans

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            _, h, _, d = key_states.shape
            self.keys.append(key_states.new_zeros(h, self.kv_tokens, d))
            self.values.append(value_states.new_zeros(h, self.kv_tokens, value_states.shape[-1]))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(1, self._write, key_states[0])
        values.index_copy_(1, self._write, value_states[0])
        return keys.index_select(1, self._read)[None], values.index_select(1, self._read)[None]

    @torch.inference_mode()
    def commit(self, edits: list[tuple[int, int, list[int]]]) -> None:
        """Per sequence (seq, keep_len, src_rows): keep logical rows [0, keep_len), move rows
        ``src_rows`` (ascending, >= keep_len) to keep_len.., free everything after them."""
        src, dst = [], []
        for seq, keep_len, rows in edits:
            moved = [(r, keep_len + i) for i, r in enumerate(rows) if r != keep_len + i]
            if moved:
                src += [self.blocks.slot(seq, r) for r, _ in moved]
                dst += [self.blocks.slot(seq, d) for _, d in moved]
            self.blocks.shrink(seq, keep_len + len(rows))
        if src and self.keys:
            src_t = torch.tensor(src, dtype=torch.long, device=self.keys[0].device)
            dst_t = torch.tensor(dst, dtype=torch.long, device=self.keys[0].device)
            for keys, values in zip(self.keys, self.values):
                # index_select copies first, so overlapping source/destination is safe
                keys.index_copy_(1, dst_t, keys.index_select(1, src_t))
                values.index_copy_(1, dst_t, values.index_select(1, src_t))

    # -- what transformers asks of a Cache -------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and the 4-D mask are always given explicitly

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return int(self._read.numel()) if self._read is not None else query_length, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.kv_tokens

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.keys)


class SeqView:
    """One sequence's face of the paged cache, for the decoder's stages (``get_seq_length``)."""

    def __init__(self, cache: PagedCache, seq: int):
        self.cache = cache
        self.seq = seq

    def get_seq_length(self) -> int:
        return self.cache.blocks.lengths[self.seq]
