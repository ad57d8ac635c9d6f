"""One layer of the compressed cache: per-(batch, KV head) segments of their own length that really free memory.

Two parts:

* the compressed **context**, flat: ``context_keys``/``context_values`` (N, d) hold the kept entries of every
  segment back to back (segment s = b * h_kv + h, in order), ``lengths`` (b, h_kv) their counts. Exactly the
  kept entries are stored: head-wise budgets (AdaKV, HeadKV) waste nothing on padding.
* the **tail**, dense: ``keys``/``values`` (b, h_kv, capacity, d) hold what is appended after compression
  (question and generated tokens), the same count for every segment, grown geometrically (amortised O(1)).

When every segment keeps the same count L (any per-layer budget), the ``uniform`` attention path *joins* the two
at its first call: one buffer (b, h_kv, L + capacity, d) per tensor holds each segment's context, then its tail
(``keys``/``values`` are then None; ``tail_states()`` reads the tail in either layout). Appends are written in
place and a decode step reads a slice of the buffer, where the flat layout (like transformers' ``DynamicLayer``)
copies the whole cache into a new tensor at every step. Reading ``context_keys``/``context_values`` (the other
paths, ``shrink``, reordering) splits the layer back into the flat layout first.

Before compression the layer is *dense*: no context part, and the tail is the whole prompt, stored exactly as
transformers' ``DynamicLayer`` stores it. Logical bookkeeping (``seen``) counts every token ever written, so
positions and masks built by transformers stay those of the uncompressed sequence.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from criticalkv.errors import CacheStateError

_MIN_GROWTH = 64  # entries added per growth at least; growth is geometric (1/8) so appends are amortised O(1)


class CompressedLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self._context_keys: torch.Tensor | None = None  # (N, d) kept context entries, segment after segment
        self._context_values: torch.Tensor | None = None  # (N, d)
        self._joined: tuple[torch.Tensor, torch.Tensor] | None = None  # (b, h_kv, L + capacity, d) keys, values
        self.lengths: torch.Tensor | None = None  # (b, h_kv) long: kept context entries per segment
        self.tail = 0  # entries appended to the tail, shared by every segment
        self.seen = 0  # logical length: every token written so far
        self.context_seen = 0  # logical length at compression time (0 while dense)
        self.fresh = False  # True right after the first (prefill) update, until compression or the next update
        self.pending = False  # dense, awaiting a deferred method's decision at the end of the prefill
        self._width_memo: tuple | None = None  # (lengths tensor, its version, uniform_width()) of the last call

    # --- state -------------------------------------------------------------------------------------------
    @property
    def is_compressed(self) -> bool:
        return self._context_keys is not None or self._joined is not None

    @property
    def is_croppable(self) -> bool:
        """Whether transformers may crop the layer. Not once its context is compressed (or awaits compression):
        assisted decoding checks this after a first forward over the prompt and its drafts, which were then
        compressed with the prompt, so it is refused (``crop`` itself still drops tokens appended after the context).
        """
        return not (self.is_compressed or self.pending)

    @property
    def context_keys(self) -> torch.Tensor | None:
        """(N, d) kept context keys, segment after segment (a joined layer is split back first)."""
        self._split()
        return self._context_keys

    @context_keys.setter
    def context_keys(self, keys: torch.Tensor | None) -> None:
        self._split()
        self._context_keys = keys

    @property
    def context_values(self) -> torch.Tensor | None:
        """(N, d) kept context values, in the order of ``context_keys``."""
        self._split()
        return self._context_values

    @context_values.setter
    def context_values(self, values: torch.Tensor | None) -> None:
        self._split()
        self._context_values = values

    def joined_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (b, h_kv, L + tail, d): every segment's L context entries, then its tail.

        Views of one buffer per tensor, built at the first call (one copy of the context and tail) and kept: later
        appends write into it. Only for a layer whose segments all keep the same count.
        """
        width = self.uniform_width()
        if width is None:
            raise CacheStateError("only a layer whose segments keep the same number of entries can be joined")
        if self._joined is None:
            b, h, capacity, d = self.keys.shape
            joined = []
            for context, tail in ((self._context_keys, self.keys), (self._context_values, self.values)):
                buffer = tail.new_empty((b, h, width + capacity, d))
                buffer[:, :, :width] = context.view(b, h, width, d)
                buffer[:, :, width : width + self.tail] = tail[:, :, : self.tail]
                joined.append(buffer)
            self._joined = (joined[0], joined[1])
            # The joined buffers hold everything; no view of them is kept (a view made under no_grad could not be
            # written later with grad enabled), so the tail is addressed as columns L onwards.
            self._context_keys = self._context_values = self.keys = self.values = None
        end = width + self.tail
        return self._joined[0][:, :, :end], self._joined[1][:, :, :end]

    def tail_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (b, h_kv, tail, d) appended after the context (for a dense layer: the whole prompt)."""
        if self._joined is None:
            return self.keys[:, :, : self.tail], self.values[:, :, : self.tail]
        width = self.uniform_width()
        return self._joined[0][:, :, width : width + self.tail], self._joined[1][:, :, width : width + self.tail]

    def _split(self) -> None:
        """Back to the flat layout: the context as (N, d), the tail in a buffer of its own."""
        if self._joined is None:
            return
        keys, values = self._joined
        b, h, _, d = keys.shape
        width = self.uniform_width()
        # the reshape copies when the segments are not contiguous; with one segment (batch 1, one KV head) it is a
        # view, which would keep the whole buffer, the tail's room included, alive
        self._context_keys = owning(keys[:, :, :width].reshape(b * h * width, d))
        self._context_values = owning(values[:, :, :width].reshape(b * h * width, d))
        self.keys, self.values = keys[:, :, width:].clone(), values[:, :, width:].clone()  # capacity kept
        self._joined = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    # --- transformers' Cache contract --------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (b, h_kv, q, d) new states; return the tail (b, h_kv, tail, d): for a dense layer, everything."""
        q = key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            # the prompt, contiguous in (b, h_kv, t, d) as transformers' DynamicCache stores it: the projections
            # arrive as a (b, t, h_kv, d) layout seen through a transpose, over which SDPA's CPU kernel ran 10%
            # slower at 8k tokens (docs/benchmarks.md); a no-op when already contiguous
            self.keys, self.values = key_states.contiguous(), value_states.contiguous()
            self.tail = self.seen = q
            self.fresh = True
            return self.keys, self.values
        self.fresh = False
        self._reserve(self.tail + q)
        keys, values = (self.keys, self.values) if self._joined is None else self._joined
        start = self.tail if self._joined is None else self.uniform_width() + self.tail
        keys[:, :, start : start + q] = key_states
        values[:, :, start : start + q] = value_states
        self.tail += q
        self.seen += q
        return self.tail_states()

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
            raise CacheStateError(f"cannot remove {n} tokens: only {self.tail} were appended after the context")
        self.tail -= n
        self.seen -= n

    def compact(self) -> None:
        """Give back the tail's room beyond the tokens appended (after a rewind to the context: all of it), so the
        layer holds what ``entries`` counts. ``crop`` keeps the room, as ``DynamicLayer.crop`` does; the next append
        grows the tail again."""
        if not self.is_initialized or self.pending or self.fresh:
            return
        if self._joined is not None:
            end = self.uniform_width() + self.tail
            if self._joined[0].shape[2] > end:
                self._joined = (self._joined[0][:, :, :end].clone(), self._joined[1][:, :, :end].clone())
        elif self.keys.shape[2] > self.tail:
            self.keys, self.values = self.keys[:, :, : self.tail].clone(), self.values[:, :, : self.tail].clone()

    def reset(self) -> None:
        self.keys = self.values = self.lengths = self._context_keys = self._context_values = self._joined = None
        self.tail = self.seen = self.context_seen = 0
        self.fresh = self.pending = self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self._split()
        indices = indices.to(self.device)
        self.keys, self.values = self.keys[indices], self.values[indices]
        if self.is_compressed:
            h = self.lengths.shape[1]
            segments = (indices[:, None] * h + torch.arange(h, device=self.device)).flatten()
            starts = self.offsets()[segments]
            counts = self.lengths.flatten()[segments]
            rows = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
            rows = rows + torch.arange(int(counts.sum()), device=self.device)
            self.context_keys, self.context_values = self.context_keys[rows], self.context_values[rows]
            self.lengths = self.lengths[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._split()
            b = self.keys.shape[0]
            self.batch_select_indices(torch.arange(b, device=self.device).repeat_interleave(repeats))

    # --- compression -------------------------------------------------------------------------------------
    def compress(self, keep: torch.Tensor, width: int | None = None) -> None:
        """Keep the entries of a keep mask (b, h_kv, t) of the prompt; the rest is freed.

        Kept entries stay in their original order. Allowed once, right after the prefill (or, for a deferred
        method, at the end of it, once passes after the prefill have been trimmed away). ``width``: the number of
        entries every segment of ``keep`` holds, when the caller knows it (``Decision.width``: selectors keep
        exactly each head's budget); the positions are then found without a host read (on a GPU, a wait), where
        counting them otherwise sizes the new buffers.
        """
        if not (self.fresh or self.pending):
            raise CacheStateError("a layer is compressed once, right after its prefill")
        if self.tail != self.seen:
            raise CacheStateError("a pending layer must be trimmed back to its prompt before it is compressed")
        if keep.dtype != torch.bool:
            raise CacheStateError(f"a keep mask is bool, got {keep.dtype}")
        if keep.shape != (*self.keys.shape[:2], self.seen):
            raise CacheStateError(f"keep mask {tuple(keep.shape)} does not match the cache {tuple(self.keys.shape)}")
        b, h, capacity, d = self.keys.shape  # a pending layer's buffer may have room beyond the prompt
        flat = keep.reshape(b * h, -1)
        # rows of the (b * h * capacity, d) buffer, (N,): segment by segment, positions ascending
        if width is None:
            segment, position = flat.nonzero(as_tuple=True)  # (N,) each, row-major
            rows = segment * capacity + position
        else:  # each segment's kept positions first, ascending (a stable sort): the same entries, in the same order
            position = flat.view(torch.uint8).sort(dim=-1, descending=True, stable=True).indices[:, :width]
            first = torch.arange(0, b * h * capacity, capacity, device=keep.device)  # (b * h,): each segment's row 0
            rows = (first[:, None] + position).reshape(-1)
        self.context_keys = self.keys.reshape(-1, d).index_select(0, rows)  # (N, d), a new buffer
        self.context_values = self.values.reshape(-1, d).index_select(0, rows)
        # (b, h) counts of what is stored: with a width, `width` per segment whatever the mask holds (a mask that
        # breaks the selector contract then keeps other entries, never a count that misreads the storage)
        self.lengths = keep.sum(-1) if width is None else torch.full((b, h), width, device=keep.device)
        self.keys = self.keys.new_empty((b, h, 0, d))  # the prompt-sized buffer is released
        self.values = self.values.new_empty((b, h, 0, d))
        self.tail = 0
        self.context_seen = self.seen
        self.fresh = self.pending = False

    def shrink(self, keep: torch.Tensor) -> None:
        """Keep only the flagged entries of the compressed context; the others are freed.

        ``keep`` (N,) bool runs over the context entries in storage order (segment after segment, positions
        ascending), as a keep mask restricted to the kept entries reads in row-major order: ``keep_now[kept]``.
        Used by allocators that compress a layer on arrival and take entries back as later layers arrive. The
        tail (tokens appended after the context) is untouched.
        """
        if not self.is_compressed:
            raise CacheStateError("only a compressed layer can shrink; compress it first")
        n = self.context_keys.shape[0]
        if keep.dtype != torch.bool or keep.shape != (n,):
            raise CacheStateError(f"shrink takes a ({n},) bool mask over the kept entries, got {tuple(keep.shape)}")
        keep = keep.to(self.context_keys.device)
        segments = torch.repeat_interleave(
            torch.arange(self.lengths.numel(), device=keep.device), self.lengths.flatten()
        )
        counts = torch.zeros(self.lengths.numel(), dtype=torch.long, device=keep.device)
        counts.scatter_add_(0, segments, keep.long())
        self.context_keys = self.context_keys[keep]  # a new, smaller buffer; the old one is released
        self.context_values = self.context_values[keep]
        self.lengths = counts.view_as(self.lengths)

    @classmethod
    def stack(cls, layers: list[CompressedLayer]) -> CompressedLayer:
        """The rows of several layers as one batch, rows in order, each row's segments as they are.

        Every layer must hold the same prompt with nothing appended after it (right after a prefill or a
        ``rewind``): the same logical length, no tail. A dense layer (the full cache, or a layer a method kept
        whole) enters as a compressed one that keeps every entry, so a batch can mix both. The tensors are copied
        into new flat buffers; the layers themselves are left as they are.
        """
        if not layers:
            raise CacheStateError("nothing to stack")
        seen = {layer.seen for layer in layers}
        if len(seen) != 1 or any(not layer.is_initialized for layer in layers):
            raise CacheStateError(f"stacked layers must hold the same prompt; their lengths are {sorted(seen)}")
        if any(layer.is_compressed and layer.tail for layer in layers):
            raise CacheStateError("stacked layers must have nothing appended after their context: rewind first")
        keys, values, lengths = [], [], []
        for layer in layers:
            if layer.is_compressed:
                keys.append(layer.context_keys)
                values.append(layer.context_values)
                lengths.append(layer.lengths)
            else:  # dense: every entry of every segment, in the flat order (segment by segment)
                b, h, _, d = layer.keys.shape  # the buffer may have room beyond the prompt after an answer
                keys.append(layer.keys[:, :, : layer.tail].reshape(-1, d))
                values.append(layer.values[:, :, : layer.tail].reshape(-1, d))
                lengths.append(torch.full((b, h), layer.tail, dtype=torch.long, device=layer.keys.device))
        first = layers[0]
        out = cls()
        out.device, out.is_initialized = first.device, True
        out.context_keys, out.context_values = torch.cat(keys), torch.cat(values)  # (N, d)
        out.lengths = torch.cat(lengths)  # (rows, h_kv)
        rows, h, d = out.lengths.shape[0], out.lengths.shape[1], out.context_keys.shape[-1]
        out.keys = out.context_keys.new_empty((rows, h, 0, d))
        out.values = out.context_values.new_empty((rows, h, 0, d))
        out.seen = out.context_seen = first.seen
        return out

    def uniform_width(self) -> int | None:
        """The context entries every segment holds when they all hold the same count, else None.

        Remembered per ``lengths`` tensor and version (a decode step asks once per layer; the counts change only when
        the layer is compressed, shrunk or reordered, each of which makes a new tensor). A tensor made under
        ``torch.inference_mode`` has no version: remembered per tensor alone."""
        lengths = self.lengths
        version = None if lengths.is_inference() else lengths._version
        memo = self._width_memo
        if memo is not None and memo[0] is lengths and memo[1] == version:
            return memo[2]
        width = None
        if lengths.numel():
            top = int(lengths.max())
            width = top if int(lengths.min()) == top else None
        self._width_memo = (lengths, version, width)
        return width

    def offsets(self) -> torch.Tensor:
        """Start of each segment in the flat context: (b * h_kv + 1,) long."""
        counts = self.lengths.flatten()
        return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])

    def tail_mask(self, logical_mask: torch.Tensor | None, query_length: int) -> torch.Tensor:
        """Which tail entries each query may read: (b, 1, q, tail) bool. The context is visible to all."""
        if logical_mask is None and query_length == 1:  # a decode step reads the whole tail
            return torch.ones((1, 1, 1, self.tail), dtype=torch.bool, device=self.device)
        if logical_mask is None:  # no padding: causal over logical positions
            query_pos = self.seen - query_length + torch.arange(query_length, device=self.device)
            tail_pos = self.context_seen + torch.arange(self.tail, device=self.device)
            return (tail_pos[None, :] <= query_pos[:, None])[None, None]
        return as_bool_mask(self.tail_columns(logical_mask))

    def tail_columns(self, mask: torch.Tensor) -> torch.Tensor:
        """The tail's columns of a (b, 1, q, n) mask that ends at the last token seen: its last ``tail``, whether
        it starts at position 0 or where the contexts end (``CompressedCache.get_mask_sizes``)."""
        return mask[..., mask.shape[-1] - self.tail :]

    # --- persistence -------------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """What restores this layer (``from_state``), read without changing its layout: tensors and counts.

        A compressed layer gives its flat context ``keys``/``values`` (N, d) and ``lengths`` (b, h_kv); a dense one
        (a layer its method kept whole) its prompt ``keys``/``values`` (b, h_kv, t, d). A compressed layer must have
        nothing appended after its context (``ContextSession.rewind`` first): the tail is a question's, not the
        context's.
        """
        if not self.is_initialized or self.pending or self.fresh:
            raise CacheStateError("only a layer whose prefill is finished (and compressed if it is to be) is saved")
        if not self.is_compressed:
            keys, values = self.tail_states()  # (b, h_kv, t, d): the whole prompt, without the buffer's spare room
            return {"keys": keys, "values": values}, {"seen": self.seen}
        if self.tail:
            raise CacheStateError(f"{self.tail} tokens are appended after the compressed context: rewind first")
        if self._joined is None:
            keys, values = self._context_keys, self._context_values
        else:  # each segment's L context columns, flattened in segment order: the flat layout's (N, d)
            width, d = self.uniform_width(), self._joined[0].shape[-1]
            keys, values = (t[:, :, :width].reshape(-1, d) for t in self._joined)
        return {"keys": keys, "values": values, "lengths": self.lengths}, {"seen": self.seen}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], counts: dict[str, int]) -> CompressedLayer:
        """The layer ``state`` described: compressed when ``tensors`` hold ``lengths``, else dense."""
        layer = cls()
        keys, values = tensors["keys"], tensors["values"]
        layer.device, layer.is_initialized = keys.device, True
        layer.seen = counts["seen"]
        if "lengths" not in tensors:  # dense: (b, h_kv, t, d), the tail is the prompt
            if keys.dim() != 4 or keys.shape != values.shape or keys.shape[2] != layer.seen:
                raise CacheStateError(f"a dense layer's keys {tuple(keys.shape)} do not hold its {layer.seen} tokens")
            layer.keys, layer.values, layer.tail = keys, values, layer.seen
            return layer
        lengths = tensors["lengths"]
        if keys.dim() != 2 or keys.shape != values.shape or int(lengths.sum()) != keys.shape[0]:
            raise CacheStateError(
                f"a compressed layer's context {tuple(keys.shape)} does not hold the {int(lengths.sum())} entries its "
                "lengths count"
            )
        layer._context_keys, layer._context_values, layer.lengths = keys, values, lengths
        b, h = lengths.shape
        layer.keys = keys.new_empty((b, h, 0, keys.shape[-1]))
        layer.values = values.new_empty((b, h, 0, values.shape[-1]))
        layer.context_seen = layer.seen
        return layer

    # --- accounting --------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes this layer holds: key/value storage (tail capacity included) and its bookkeeping."""
        if not self.is_initialized:
            return 0
        if self._joined is not None:
            return self._joined[0].nbytes + self._joined[1].nbytes + self.lengths.nbytes
        total = self.keys.nbytes + self.values.nbytes
        if self.is_compressed:
            total += self._context_keys.nbytes + self._context_values.nbytes + self.lengths.nbytes
        return total

    def entries(self) -> int:
        """Cached (batch, head, token) entries, summed over segments."""
        if not self.is_initialized:
            return 0
        if not self.is_compressed:
            return self.tail * self.keys.shape[0] * self.keys.shape[1]
        return int(self.lengths.sum()) + self.tail * self.lengths.numel()

    def full_entries(self) -> int:
        """(batch, head, token) entries the layer would hold had nothing been evicted: every token it has seen."""
        if not self.is_initialized:
            return 0
        b, h = self.lengths.shape if self.is_compressed else self.keys.shape[:2]
        return b * h * self.seen

    def _reserve(self, needed: int) -> None:
        if self._joined is not None:
            width = self.uniform_width()
            capacity = self._joined[0].shape[2] - width
        else:
            capacity = self.keys.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(needed, capacity + max(_MIN_GROWTH, capacity // 8))
        if self._joined is not None:  # larger joined buffers, the context and the tail so far copied over
            grown = []
            for buffer in self._joined:
                b, h, _, d = buffer.shape
                larger = buffer.new_empty((b, h, width + new_capacity, d))
                larger[:, :, : width + self.tail] = buffer[:, :, : width + self.tail]
                grown.append(larger)
            self._joined = (grown[0], grown[1])
            return
        grow = (*self.keys.shape[:2], new_capacity - capacity, self.keys.shape[-1])
        self.keys = torch.cat([self.keys, self.keys.new_zeros(grow)], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(grow)], dim=2)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """transformers' masks are bool (sdpa) or additive float (eager); True = may attend."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of its own size: a copy when it is a view of a larger storage (which it would keep
    alive whole), else itself."""
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor
