"""Static K/V cache for packed lookahead steps, through transformers' public Cache interface.

Contract: ``PackedCache(capacity)`` is a ``transformers.Cache`` whose layers hold one
buffer each, ``[1, H_kv, capacity, D]``, allocated once on the first write (dtype and
device from the model's keys). A forward over Q new rows writes them at
``[length, length + Q)`` in place and hands attention a *view* of the filled part
``[:length + Q]``, so early steps do not pay for the whole buffer. ``dtype`` (default: the
keys' own) stores K/V wider than the model computes them: float64 for lp.kernels.exact_attention,
which then reads them without converting the whole prefix at every layer of every step
(float32 -> float64 is exact, so attention sees the same values). With
``full_view=True`` (CUDA graphs) attention gets the whole buffer instead and the
mask hides the unfilled tail, so every shape is static.

After a step the caller publishes by ``crop(length)`` (keep a prefix) or
``compact(keep_len, src_rows)`` (move accepted rows next to the prefix, then crop):
both are in-place copies, no allocation, no concatenation. In static mode
(``write_index`` set, lp.model.graphs) rows are written at positions read from a device
tensor and the caller sets the length.

Legend: H_kv key/value heads, D head size, Q rows written this step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PackedLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, capacity: int, full_view: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity = capacity
        self.full_view = full_view
        self.dtype = dtype
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        assert b == 1, "lookahead decodes one sequence"
        self.device = key_states.device
        self.keys = torch.zeros(1, h, self.capacity, d, dtype=self.dtype or key_states.dtype, device=self.device)
        self.values = torch.zeros(1, h, self.capacity, value_states.shape[-1], dtype=self.dtype or value_states.dtype,
                                  device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; this step needs {end}")
        self.keys[:, :, self.length : end].copy_(key_states)
        self.values[:, :, self.length : end].copy_(value_states)
        self.length = end
        if self.full_view:
            return self.keys, self.values
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write_at(self, key_states: torch.Tensor, value_states: torch.Tensor, index_Q: torch.Tensor):
        """Static mode (lp.model.graphs): write at positions from a device tensor, return the whole
        buffer; the caller sets the length (a captured graph runs no Python)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, index_Q, key_states)
        self.values.index_copy_(2, index_Q, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length


class PackedCache(Cache):
    """One ``PackedLayer`` per decoder layer (added as the model writes them)."""

    def __init__(self, capacity: int, full_view: bool = False, dtype: torch.dtype | None = None):
        self.capacity = capacity
        self.full_view = full_view
        self.dtype = dtype
        self.write_index = None  # static mode: device tensor of write positions (lp.model.graphs)
        super().__init__(layers=[])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(PackedLayer(self.capacity, self.full_view, self.dtype))
        if self.write_index is not None:
            return self.layers[layer_idx].write_at(key_states, value_states, self.write_index)
        return self.layers[layer_idx].update(key_states, value_states)

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            assert length <= layer.capacity
            layer.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if len(self.layers) > layer_idx else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached rows (an absolute length, not transformers' negative count)."""
        for layer in self.layers:
            layer.crop(length)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    @torch.inference_mode()
    def compact(self, keep_len: int, src_rows: list[int]) -> None:
        """Move cached rows ``src_rows`` (absolute, ascending, all >= keep_len) to ``keep_len..``
        and drop everything after them."""
        if src_rows:
            first = src_rows[0]
            contiguous = src_rows == list(range(first, first + len(src_rows)))
            dst = slice(keep_len, keep_len + len(src_rows))
            if contiguous and first == keep_len:
                pass  # already in place
            else:
                src = torch.tensor(src_rows, dtype=torch.long, device=self.layers[0].keys.device)
                for layer in self.layers:
                    # index_select copies first, so overlapping source/destination is safe
                    layer.keys[:, :, dst] = layer.keys.index_select(2, src)
                    layer.values[:, :, dst] = layer.values.index_select(2, src)
        self.crop(keep_len + len(src_rows))
