"""A paged K/V cache shared by every running sequence of a batched step (lp.engine.batch).

Contract: one pool of ``kv_tokens`` slots per layer, cut into fixed-size blocks of
``block_size`` slots; each sequence owns a block table (its blocks in order) and a
length (rows committed to the cache). Logical row i of a sequence lives in slot
``table[i // block_size] * block_size + i % block_size``.

Admission is by reservation: ``reserve(seq, tokens)`` hands a sequence the blocks of its
worst case (prompt + max_new_tokens + its largest step) -- one contiguous run of blocks
when the free list has one, else any free blocks -- so a running sequence never finds
the pool empty; its table is the prefix of those blocks its rows use. ``can_reserve``
says whether a waiting one fits now; a request larger than the whole pool is refused by
the caller up front. Everything a sequence owned returns to the free list when it leaves.
Tests can have freed blocks filled with NaN (``PagedCache.poison_released``: the
``BlockTable.on_release`` hook, None by default), so a step reading a block it does not
own (stale or foreign) shows.

``PagedCache`` is a ``transformers.Cache``: before a forward the caller ``plan``s the
step (which sequences, how many new rows each); the model's public forward then calls
``update(k, v, layer)`` once per layer, which writes the step's rows into their slots
and returns either (``gather=True``: eager and flex) the K/V of exactly the slots the
step reads, sequence after sequence -- the caller's mask hides other sequences -- or
(``gather=False``: lp.kernels.attention's per-sequence sdpa) the pool itself, no copy: a
contiguous sequence's keys are a slice of it, a fragmented one's are gathered by the
attention. Attention costs ~ (a sequence's rows) x (its length) summed over sequences,
never (step rows) x (all slots).

After verification, ``commit`` keeps a prefix of each sequence and moves its accepted
rows next to it (one gather/scatter per layer for the whole batch).

Automatic prefix caching (``prefix_cache=True``; under LP every rank's table makes the same
calls, so all hold the same digests): a full block whose rows are
all committed is immutable from then on, so it is registered under a chain digest of the
token ids of every row up to its end (sha256 over the parent block's digest and its own
ids: equal digests mean the same tokens at the same positions, hence the same K/V).
``reserve(seq, tokens, prompt)`` first takes the longest run of registered blocks that
covers a prefix of ``prompt`` (at most ``len(prompt) - 1`` rows: the last prompt token is
always fed, its logits start the decoding) and books only the rest; the sequence starts
with that many rows committed. A registered block is shared (a reference count); once no
sequence holds it, it stays registered but evictable (LRU), and is evicted only when a
reservation finds no free block -- so ``can_reserve`` counts free + evictable blocks. A
sequence never writes a shared block: its writes go past its committed rows, and a
shared block lies wholly before them. Hits and new blocks rarely form one run, and the
attention gathers a fragmented sequence's keys every layer of every step: so while the
free list has room to spare, the sequence owns one contiguous run and its hit blocks are
copied into it once before the next forward (``BlockTable.copies``, ``PagedCache.plan``),
still no recompute; under pressure the hits are shared.

Legend: H_kv key/value heads, D head size, Q rows of the step, K gathered key rows.
"""

from __future__ import annotations

import hashlib
import math
import mmap
from collections.abc import Sequence
from collections import OrderedDict

import torch
from transformers.cache_utils import Cache


# slots a block holds unless told otherwise (lp.serve: server.kv_block, whose default is this one)
BLOCK_SIZE = 8


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockTable:
    """Blocks owned per sequence, a table and a length per sequence.

    ``reserve`` hands a sequence all the blocks it may ever use (its worst case), as one
    contiguous run of block ids when the free list has one (first fit), else the lowest
    free ids; its table is the prefix of that run its rows use now. A contiguous run lets
    attention read the sequence's K/V as a view of the pool, with no gather.

    ``on_release``: a test hook, None by default (off, one ``is None`` test per release):
    called with a leaving sequence's blocks before they return to the free list."""

    on_release = None

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: set[int] = set(range(num_blocks))
        self.owned: dict[int, list[int]] = {}  # the blocks reserved for each sequence, in order
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        # automatic prefix caching (module doc); all empty when off
        self.prefix_cache = prefix_cache
        self.by_digest: dict[bytes, int] = {}  # registered full blocks
        self.digest_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}  # sequences holding each registered block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none, LRU first
        self.digests: dict[int, list[bytes]] = {}  # per sequence: the chain digest of each full committed block
        self._claimed: dict[int, list[int]] = {}  # per sequence: hit blocks pinned before its reservation
        self.copies: list[tuple[int, list[int], list[int]]] = []  # (seq, cached blocks, its own) to copy
        self.hit_blocks = 0  # blocks reused so far (metrics)
        self.evictions = 0

    @property
    def reserved(self) -> dict[int, int]:
        """Blocks booked per sequence."""
        return {seq: len(run) for seq, run in self.owned.items()}

    # -- admission ---------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks a reservation may take: free ones and evictable registered ones."""
        return len(self.free) + len(self.evictable)

    def can_reserve(self, tokens: int, prompt: Sequence[int] = ()) -> bool:
        return self.cost(tokens, prompt, set()) <= self.available

    def cost(self, tokens: int, prompt: Sequence[int], claimed: set[int]) -> int:
        """Available blocks a reservation of ``tokens`` rows with ``prompt`` takes: its new
        blocks plus the evictable ones it hits (they stop being evictable); ``claimed``
        (updated): evictable hits already counted for earlier reservations of the same round."""
        hits = self.lookup(prompt)
        fresh = [b for b in hits if b in self.evictable and b not in claimed]
        claimed.update(fresh)
        return blocks_for(tokens, self.block_size) - len(hits) + len(fresh)

    def lookup(self, prompt: Sequence[int]) -> list[int]:
        """The registered blocks holding the longest block-aligned prefix of ``prompt`` of at
        most ``len(prompt) - 1`` rows (none when prefix caching is off)."""
        if not self.prefix_cache or not self.by_digest:
            return []
        hits = []
        for d in self.chain(prompt, (len(prompt) - 1) // self.block_size):
            block = self.by_digest.get(d)
            if block is None:
                break
            hits.append(block)
        return hits

    def chain(self, tokens: Sequence[int], blocks: int):
        """The chain digests of the first ``blocks`` full blocks of ``tokens``, lazily."""
        bs, parent = self.block_size, b""
        for i in range(blocks):
            parent = _digest(parent, tokens[i * bs : (i + 1) * bs])
            yield parent

    def claim(self, seq: int, prompt: Sequence[int]) -> None:
        """Pin the blocks ``prompt`` hits for ``seq``'s coming ``reserve`` (so another
        reservation of the same round cannot evict them)."""
        assert seq not in self._claimed and seq not in self.tables, seq
        hits = self.lookup(prompt)
        for b in hits:
            self.evictable.pop(b, None)
            self.refs[b] = self.refs.get(b, 0) + 1
        self._claimed[seq] = hits

    def reserve(self, seq: int, tokens: int, prompt: Sequence[int] = (), spare: int | None = None) -> int:
        """Book ``seq``'s worst case of ``tokens`` rows, reusing the registered blocks its
        ``prompt`` hits; returns the rows already committed (hit blocks x block size).

        Hit blocks and new ones rarely form one run, and attention gathers a fragmented
        sequence's keys every layer of every step. So when ``spare`` free blocks (default:
        those this reservation leaves free; ``reserve_round``: those no reservation of the
        round needs) can hold the hits, the sequence takes one contiguous run of all its
        blocks instead and the cached rows are copied into its first blocks (``copies``,
        done by ``PagedCache.plan`` before the next forward writes anything): the prompt's
        K/V is still reused, not recomputed, and the hit blocks stay registered, evictable
        once no other sequence holds them."""
        assert seq not in self.tables, seq
        if seq not in self._claimed:
            self.claim(seq, prompt)
        hits = self._claimed.pop(seq)
        n = blocks_for(tokens, self.block_size) - len(hits)
        assert n <= self.available, (seq, n, self.available)
        if n > len(self.free):
            self._evict(n - len(self.free))
        run = self._first_fit(n)
        own = list(hits)
        if hits and not _one_run(hits + (run or [])) and len(hits) <= (len(self.free) - n if spare is None else spare):
            whole = self._first_fit(n + len(hits))
            if whole is not None:
                own, run = whole[: len(hits)], whole[len(hits):]
                self.copies.append((seq, hits, own))
                self.free.difference_update(own)
                for b in hits:
                    self._unref(b)
        if run is None:  # fragmented: any n free blocks (attention gathers this sequence's rows)
            run = sorted(self.free)[:n]
        self.free.difference_update(run)
        self.owned[seq], self.tables[seq], self.lengths[seq] = own + run, list(own), len(hits) * self.block_size
        if self.prefix_cache:
            self.digests[seq] = [self.digest_of[b] for b in hits]
        self.hit_blocks += len(hits)
        return len(hits) * self.block_size

    def reserve_round(self, round_: Sequence[tuple[int, int, Sequence[int]]]) -> list[int]:
        """One admission round [(seq, tokens, prompt)]: every cached prefix is pinned first,
        then each reserved, so one's new blocks never evict another's hits; the rows each
        starts with committed."""
        for seq, _, prompt in round_:
            self.claim(seq, prompt)
        spare = len(self.free) - sum(blocks_for(t, self.block_size) - len(self._claimed[s]) for s, t, _ in round_)
        rows = []
        for seq, tokens, prompt in round_:
            copies = len(self.copies)
            rows.append(self.reserve(seq, tokens, prompt, spare=spare))
            if len(self.copies) > copies:
                spare -= len(self.copies[-1][1])
        return rows

    def _evict(self, n: int) -> None:
        """The ``n`` least recently released registered blocks become free (unregistered)."""
        for _ in range(n):
            block, _ = self.evictable.popitem(last=False)
            del self.by_digest[self.digest_of.pop(block)], self.refs[block]
            self.free.add(block)
            self.evictions += 1

    def register(self, seq: int, tokens: Sequence[int]) -> None:
        """After a commit: register ``seq``'s full blocks whose rows are all committed
        (``tokens``: the sequence's ids, at least its committed rows). A block whose digest
        is already registered (another sequence computed the same rows) stays private."""
        if not self.prefix_cache:
            return
        bs, chain, length = self.block_size, self.digests[seq], self.lengths[seq]
        assert length <= len(tokens), (seq, length, len(tokens))
        for i in range(len(chain), length // bs):
            d = _digest(chain[-1] if chain else b"", tokens[i * bs : (i + 1) * bs])
            chain.append(d)
            block = self.tables[seq][i]
            if d not in self.by_digest and block not in self.digest_of:
                self.by_digest[d], self.digest_of[block], self.refs[block] = block, d, 1

    def _unref(self, block: int) -> None:
        """One sequence fewer holds a registered block: evictable once none does."""
        self.refs[block] -= 1
        assert self.refs[block] >= 0, block
        if self.refs[block] == 0:
            self.evictable[block] = None  # most recently released last

    def _first_fit(self, n: int) -> list[int] | None:
        start, size = None, 0
        for b in sorted(self.free):
            if start is not None and b == start + size:
                size += 1
            else:
                start, size = b, 1
            if size == n:
                return list(range(start, start + n))
        return None

    def release(self, seq: int) -> None:
        """The sequence leaves: every block it owned back to the free list, except registered
        ones (prefix cache): one reference fewer, evictable once none holds them. ``on_release``
        sees the blocks that go back to the free list."""
        freed = []
        for b in self.owned.pop(seq):
            if b in self.digest_of:
                self._unref(b)
            else:
                freed.append(b)
        self.copies = [c for c in self.copies if c[0] != seq]
        if self.on_release is not None:
            self.on_release(freed)
        self.free.update(freed)
        del self.tables[seq], self.lengths[seq]
        self.digests.pop(seq, None)

    # -- rows ----------------------------------------------------------------------

    def grow(self, seq: int, rows: int) -> None:
        """Blocks for logical rows [0, rows) of ``seq``."""
        need, run = blocks_for(rows, self.block_size), self.owned[seq]
        assert need <= len(run), f"sequence {seq} needs {need} blocks, reserved {len(run)}"
        if need > len(self.tables[seq]):
            self.tables[seq] = run[:need]

    def shrink(self, seq: int, rows: int) -> None:
        """Keep logical rows [0, rows); blocks past them are unused (still reserved). Never
        below a registered block's end (those rows are shared and immutable)."""
        assert rows >= len(self.digests.get(seq, ())) * self.block_size, (seq, rows)
        self.lengths[seq] = rows
        self.tables[seq] = self.tables[seq][: blocks_for(rows, self.block_size)]

    def slots(self, seq: int, start: int, stop: int) -> list[int]:
        """Slots of logical rows [start, stop) of ``seq``."""
        bs, table = self.block_size, self.tables[seq]
        return [table[i // bs] * bs + i % bs for i in range(start, stop)]

    def slot(self, seq: int, row: int) -> int:
        bs = self.block_size
        return self.tables[seq][row // bs] * bs + row % bs

    def first_slot(self, seq: int) -> int | None:
        """Slot of row 0 when the sequence's blocks are one contiguous run (rows i at
        first_slot + i), else None."""
        run = self.owned[seq]
        return run[0] * self.block_size if run[-1] - run[0] == len(run) - 1 else None

    @property
    def blocks_in_use(self) -> int:
        """Distinct blocks the sequences' tables use (a shared prefix-cache block counts once)."""
        return len({b for t in self.tables.values() for b in t})


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor; on the CPU, one of 1 MiB or more lies in an anonymous memory mapping, whose
    pages the OS hands out zeroed on first touch: a pool costs nothing until its slots are
    written (``torch.zeros`` writes every page at once: 1.0-1.6 s for SmolLM2's default 0.7 GiB
    pool on a 2-core VM, paid by the first step)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < 1 << 20:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def _one_run(blocks: list[int]) -> bool:
    return blocks[-1] - blocks[0] == len(blocks) - 1 and blocks == sorted(blocks)


def _digest(parent: bytes, ids: Sequence[int]) -> bytes:
    """Chain digest of one full block: its parent's digest and its own token ids."""
    return hashlib.sha256(parent + b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids)).digest()


class PagedCache(Cache):
    """``kv_tokens`` slots per layer in ``block_size`` blocks (see module doc)."""

    # lp.kernels.fused's one-call stack reads the pool in place: ``keys`` / ``values`` (a tensor a
    # layer), the step's write slots ``_write``, and ``_read`` None when attention reads the pool
    PAGED_POOL = True

    def __init__(self, kv_tokens: int, block_size: int = BLOCK_SIZE, prefix_cache: bool = False):
        if kv_tokens < block_size:
            raise ValueError(f"server.kv_tokens must be at least the block size {block_size}, got {kv_tokens}")
        self.blocks = BlockTable(kv_tokens // block_size, block_size, prefix_cache)
        self.kv_tokens = self.blocks.num_blocks * block_size
        self.keys: list[torch.Tensor] = []  # per layer [H_kv, slots, D], allocated on first write
        self.values: list[torch.Tensor] = []
        self._write = None  # [Q] slots the step's rows go to
        self._read = None  # [K] slots the step's rows read, sequence after sequence
        super().__init__(layers=[])

    def poison_released(self, value: float = float("nan")) -> None:
        """Test hook: from now on the slots of every block a leaving sequence owned are filled
        with ``value`` (NaN) in every layer's keys and values, so a later step that reads a
        block it does not own (a stale or a foreign one) gets NaN in its attention."""
        def fill(run: list[int]) -> None:
            if not self.keys:
                return
            bs = self.blocks.block_size
            slots = torch.tensor([b * bs + i for b in run for i in range(bs)], dtype=torch.long,
                                 device=self.keys[0].device)
            with torch.inference_mode():  # the pool is an inference tensor
                for t in self.keys + self.values:
                    t.index_fill_(1, slots, value)

        self.blocks.on_release = fill

    # -- the step ----------------------------------------------------------------------

    def plan(self, items: list[tuple[int, int]], device, gather: bool = True) -> list[tuple[int, object]]:
        """Prepare a forward over ``items`` = [(seq, new rows)] in row order: grow the tables,
        set the write slots. Returns each sequence's (prefix length, where its keys are).

        ``gather=True``: ``update`` returns the slots the step reads, gathered sequence after
        sequence; a sequence's keys are at that offset of the gathered rows (an int).
        ``gather=False``: ``update`` returns the whole pool (no copy); a sequence's keys are
        the pool's rows from its first slot on (an int: its blocks are one contiguous run)
        or a LongTensor of its slots (fragmented: the attention gathers them)."""
        self._copy_cached()
        write, read, spans = [], [], []
        for seq, q in items:
            length = self.blocks.lengths[seq]
            self.blocks.grow(seq, length + q)
            write += self.blocks.slots(seq, length, length + q)
            if gather:
                spans.append((length, len(read)))
                read += self.blocks.slots(seq, 0, length + q)
            else:
                first = self.blocks.first_slot(seq)
                where = first if first is not None else torch.tensor(self.blocks.slots(seq, 0, length + q),
                                                                     dtype=torch.long, device=device)
                spans.append((length, where))
        self._write = torch.tensor(write, dtype=torch.long, device=device)
        self._read = torch.tensor(read, dtype=torch.long, device=device) if gather else None
        return spans

    @torch.inference_mode()
    def _copy_cached(self) -> None:
        """The cached rows of ``BlockTable.copies`` into the blocks their sequences own."""
        copies, self.blocks.copies = self.blocks.copies, []
        if not copies:
            return
        assert self.keys, "prefix-cache hits before any K/V was written"
        bs, dev = self.blocks.block_size, self.keys[0].device
        src = torch.tensor([b * bs + i for _, hits, _ in copies for b in hits for i in range(bs)], device=dev)
        dst = torch.tensor([b * bs + i for _, _, own in copies for b in own for i in range(bs)], device=dev)
        for keys, values in zip(self.keys, self.values):
            keys.index_copy_(1, dst, keys.index_select(1, src))
            values.index_copy_(1, dst, values.index_select(1, src))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            _, h, _, d = key_states.shape
            self.keys.append(zeroed((h, self.kv_tokens, d), key_states.dtype, key_states.device))
            self.values.append(zeroed((h, self.kv_tokens, value_states.shape[-1]), value_states.dtype,
                                      value_states.device))
            # model.compile=on (whose first step, eager, allocates the pool): one graph for any pool size
            import torch._dynamo

            torch._dynamo.maybe_mark_dynamic(self.keys[-1], 1)
            torch._dynamo.maybe_mark_dynamic(self.values[-1], 1)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(1, self._write, key_states[0])
        values.index_copy_(1, self._write, value_states[0])
        if self._read is None:
            return keys[None], values[None]
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
        return (int(self._read.numel()) if self._read is not None else self.kv_tokens), 0

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


def kv_slot_bytes(config, dtype: torch.dtype) -> int:
    """Bytes one K/V slot takes over all layers (keys and values) for a model config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_tokens_for_memory(config, dtype: torch.dtype, device: torch.device, fraction: float) -> int:
    """``server.kv_memory_fraction``: the K/V pool that fills ``fraction`` of the device memory
    free now (after the weights are loaded), in slots. CUDA only (a CPU pool is sized by
    ``server.kv_tokens``)."""
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"server.kv_memory_fraction must be a number in (0, 1], got {fraction!r}")
    if device.type != "cuda":
        raise ValueError(f"server.kv_memory_fraction sizes the K/V pool from free GPU memory; the model is on "
                         f"{device.type}: set server.kv_tokens instead")
    free, _ = torch.cuda.mem_get_info(device)
    return int(fraction * free) // kv_slot_bytes(config, dtype)
