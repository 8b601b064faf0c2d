"""A KV cache for the decode loop that writes in place instead of concatenating.

transformers' DynamicCache appends each step's keys with ``torch.cat``, copying the
whole cache of every layer at every step: at batch 16 and ~330 positions that is ~8 MB
per layer and step, a large share of a small model's decode step on CPU. Here each layer
keeps a buffer with room ahead; a step writes its columns into the room and the layer
exposes views of the filled part, so a step copies only its own columns. The buffer
grows by half when the room runs out, so no length has to be known up front
(speculative decoding leaves rejected columns as holes; Engine moves the kept
columns together before a buffer would grow for them). The values attention reads are the same as with DynamicCache.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer


class InPlaceLayer(DynamicLayer):
    """A DynamicLayer whose ``keys``/``values`` are views into a larger buffer."""

    def __init__(self, room: int = 256):
        super().__init__()
        self.room = room  # columns allocated beyond the first write
        self.length = 0
        self._keys = self._values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._keys = self._values = None

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        # The first write allocates its own columns plus the room; a later overflow grows
        # by half (copies stay a small multiple of the final size, memory within 1.5x).
        current = self._keys.shape[-2] if self._keys is not None else 0
        capacity = needed + self.room if not current else max(needed, current + current // 2)
        old = (self._keys, self._values)
        self._keys = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
        self._values = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
        if old[0] is not None and self.length:
            self._keys[..., : self.length, :] = old[0][..., : self.length, :]
            self._values[..., : self.length, :] = old[1][..., : self.length, :]

    def _expose(self) -> None:
        self.keys = self._keys[..., : self.length, :]
        self.values = self._values[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            self._reserve(key_states, value_states, end)
        self._keys[..., self.length: end, :] = key_states
        self._values[..., self.length: end, :] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of columns to remove from the end")
        if tokens_to_remove == 0 or not self.is_initialized or self._keys is None:
            return
        self.length = max(self.length + tokens_to_remove, 0)
        self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._keys is None:
            return
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._keys is None:
            return
        self._keys = self._keys.repeat_interleave(repeats, dim=0)
        self._values = self._values.repeat_interleave(repeats, dim=0)
        self._expose()

    def reset(self) -> None:
        super().reset()
        self.length = 0
        self._keys = self._values = None

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values) if t is not None)

    def free_columns(self) -> int:
        return self._keys.shape[-2] - self.length if self._keys is not None else 0

    def gather_columns(self, index: torch.Tensor) -> None:
        """Make row b's first ``index.shape[1]`` columns its columns ``index[b]``, in that
        order (a compaction: the rest of the buffer becomes room again)."""
        if self._keys is None:
            return
        n = index.shape[1]
        for buf in (self._keys, self._values):
            idx = index[:, None, :, None].expand(buf.shape[0], buf.shape[1], n, buf.shape[-1])
            buf[..., :n, :] = buf.gather(-2, idx)  # gather copies first, so overlap is safe
        self.length = n
        self._expose()


class InPlaceCache(Cache):
    """A Cache of InPlaceLayer, one added per layer index as the model first writes it
    (so the model's depth need not be known); ``room`` is how many columns each layer
    allocates beyond its first write (the expected number of decode columns)."""

    def __init__(self, room: int = 256):
        super().__init__(layer_class_to_replicate=functools.partial(InPlaceLayer, room))

    def allocated_bytes(self) -> int:
        """What the buffers hold in memory (filled or not): the KV cache's real footprint."""
        return sum(layer.allocated_bytes() for layer in self.layers if isinstance(layer, InPlaceLayer))

    def free_columns(self) -> int:
        """Columns every layer can still write without growing its buffer."""
        return min((layer.free_columns() for layer in self.layers if isinstance(layer, InPlaceLayer)), default=0)

    def gather_columns(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            layer.gather_columns(index)
