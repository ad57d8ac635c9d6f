"""One layer of the compressed cache: per-(batch, KV head) segments of their own length that really free memory.

Storage is one buffer per layer, ``keys``/``values`` of shape (b, h_kv, capacity, d). Segment (b, h) holds
``lengths[b, h]`` entries kept from the compressed context, then ``tail`` entries appended after compression
(question and generated tokens), which every segment shares. Before compression the layer is *dense*: all
``lengths`` are 0 and the tail is the whole prompt, exactly as transformers' ``DynamicLayer`` stores it.
Logical bookkeeping (``seen``) keeps counting every token ever written, so positions and masks built by
transformers stay those of the uncompressed sequence.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from criticalkv.errors import CacheStateError

_MIN_GROWTH = 64  # entries added per growth at least; growth is geometric (1/8) so appends are amortised O(1)


class CompressedLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True

    def __init__(self) -> None:
        super().__init__()
        self.lengths: torch.Tensor | None = None  # (b, h_kv) long: kept context entries per segment
        self.tail = 0  # entries appended after the compressed context, shared by every segment
        self.seen = 0  # logical length: every token written so far
        self.context_seen = 0  # logical length at compression time (0 while dense)
        self.fresh = False  # True right after the first (prefill) update, until compression or the next update

    # --- state -----------------------------------------------------------------------------------------------
    @property
    def is_compressed(self) -> bool:
        return self.context_seen > 0

    @property
    def used(self) -> int:
        """Physical slots in use along the sequence axis (the longest segment)."""
        return 0 if self.lengths is None else int(self.lengths.max()) + self.tail

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, _ = key_states.shape
        self.lengths = torch.zeros(b, h, dtype=torch.long, device=self.device)
        self.is_initialized = True

    # --- transformers' Cache contract ------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (b, h_kv, q, d) new states; return the physical keys and values (b, h_kv, used, d)."""
        q = key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states  # the prompt, stored as is (no copy)
            self.tail = self.seen = q
            self.fresh = True
            return self.keys, self.values
        self.fresh = False
        self._reserve(self.used + q)
        lengths = self.lengths
        if bool((lengths == lengths.view(-1)[0]).all()):  # every segment equally long: one slice write
            start = int(lengths.view(-1)[0]) + self.tail
            self.keys[:, :, start : start + q] = key_states
            self.values[:, :, start : start + q] = value_states
        else:
            slots = (lengths + self.tail)[:, :, None] + torch.arange(q, device=self.device)  # (b, h, q)
            slots = slots[..., None].expand(-1, -1, -1, key_states.shape[-1])
            self.keys.scatter_(2, slots, key_states)
            self.values.scatter_(2, slots, value_states)
        self.tail += q
        self.seen += q
        used = self.used
        return self.keys[:, :, :used], self.values[:, :, :used]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` appended tokens (transformers' negative-count convention)."""
        if tokens_to_remove > 0:
            raise CacheStateError("crop takes a negative count of tokens to remove")
        n = -tokens_to_remove
        if n > self.tail:
            raise CacheStateError(
                f"cannot remove {n} tokens: only {self.tail} were appended after the compressed context"
            )
        self.tail -= n
        self.seen -= n

    def reset(self) -> None:
        self.keys = self.values = self.lengths = None
        self.tail = self.seen = self.context_seen = 0
        self.fresh = self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            indices = indices.to(self.device)
            self.keys, self.values = self.keys[indices], self.values[indices]
            self.lengths = self.lengths[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)
            self.lengths = self.lengths.repeat_interleave(repeats, dim=0)

    # --- compression -----------------------------------------------------------------------------------------
    def compress(self, keep: torch.Tensor) -> None:
        """Keep the entries of a keep mask (b, h_kv, t) of the prompt; the rest is freed.

        Kept entries stay in their original order. Allowed once, right after the prefill.
        """
        if self.is_compressed or self.tail != self.seen:
            raise CacheStateError("a layer is compressed once, right after its prefill")
        if keep.shape != (*self.keys.shape[:2], self.seen):
            raise CacheStateError(f"keep mask {tuple(keep.shape)} does not match the cache {tuple(self.keys.shape)}")
        counts = keep.sum(-1)  # (b, h)
        width = int(counts.max())
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :width]  # kept positions first
        index = order[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, index)  # a new (b, h, width, d) buffer; the prompt's is released
        self.values = self.values.gather(2, index)
        self.lengths = counts
        self.tail = 0
        self.context_seen = self.seen
        self.fresh = False

    def physical_mask(self, logical_mask: torch.Tensor | None, query_length: int) -> torch.Tensor:
        """Which physical slots each query may read: (b, h_kv, q, used) bool.

        Kept context entries are visible to every later query; appended entries follow the logical mask
        transformers built for the uncompressed sequence (causality, padding of appended tokens).
        """
        b, h = self.lengths.shape
        used = self.used
        slot = torch.arange(used, device=self.device)  # (used,)
        in_context = slot[None, None, :] < self.lengths[:, :, None]  # (b, h, used)
        k = slot[None, None, :] - self.lengths[:, :, None]  # index into the tail
        in_tail = (k >= 0) & (k < self.tail)
        if logical_mask is None:
            query_pos = self.seen - query_length + torch.arange(query_length, device=self.device)  # (q,)
            tail_pos = self.context_seen + k  # (b, h, used)
            visible = tail_pos[:, :, None, :] <= query_pos[None, None, :, None]  # (b, h, q, used)
        else:
            tail_mask = as_bool_mask(logical_mask)[:, 0, :, self.context_seen : self.seen]  # (b, q, tail)
            index = k.clamp(0, max(self.tail - 1, 0))[:, :, None, :].expand(b, h, query_length, used)
            visible = tail_mask[:, None].expand(b, h, query_length, -1).gather(-1, index)
        return in_context[:, :, None, :] | (in_tail[:, :, None, :] & visible)

    # --- accounting ------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of key and value storage this layer holds (allocated capacity, not only used slots)."""
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def entries(self) -> int:
        """Cached (batch, head, token) entries, summed over segments."""
        if not self.is_initialized:
            return 0
        return int(self.lengths.sum()) + self.tail * self.lengths.numel()

    def _reserve(self, needed: int) -> None:
        capacity = self.keys.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(needed, capacity + max(_MIN_GROWTH, capacity // 8))
        grow = (*self.keys.shape[:2], new_capacity - capacity, self.keys.shape[-1])
        self.keys = torch.cat([self.keys, self.keys.new_zeros(grow)], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(grow)], dim=2)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """transformers' masks are bool (sdpa) or additive float (eager); True = may attend."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2
