"""One compressed context, many questions: prefill once, answer each question, trim back after each answer."""

from __future__ import annotations

import copy
import hashlib
import operator
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DummyLayer, DynamicSlidingWindowLayer

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache
from criticalkv.cache.compressed_cache import release_views, storage_bytes
from criticalkv.core.layout import StageLength, on_this_stage, stage_layers
from criticalkv.core.positions import forward_on_cache
from criticalkv.errors import BoundedMemoryError, CacheStateError, CriticalKVError, PaddingError
from criticalkv.runtime.api import bounded_compressor
from criticalkv.runtime.checks import refuse_nesting
from criticalkv.runtime.chunked import prefill_in_chunks
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.method import Method
from criticalkv.runtime.places import join as join_places
from criticalkv.runtime.prefill_view import require_left_padding

#: ``rewind`` copies a transformers layer cropped back to the context only when the storage it keeps holds more
#: than this fraction on top of the context: the copy then frees more than an eighth of the bytes it copies.
REWIND_SLACK = 0.125


@dataclass
class Generation:
    """Greedy tokens of one call, with its timings."""

    tokens: torch.Tensor  # (b, n) generated ids, eos included where it was produced
    prefill_seconds: float  # time of the forward over the new prompt tokens (context or question)
    decode_seconds: list[float] = field(default_factory=list)  # one per decoded token after the first

    @property
    def decode_seconds_per_token(self) -> float:
        return sum(self.decode_seconds) / len(self.decode_seconds) if self.decode_seconds else float("nan")


def _check_ids(ids: object, name: str, shape: str) -> None:
    """Refuse anything but a 2-D integer tensor of token ids (a list, or one row without its batch axis)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise CriticalKVError(f"{name} must be a tensor of token ids {shape}, got {got}")


def _stop_tokens(eos_token_id: object) -> list[int]:
    """The end-of-sequence ids as a list of ints, from None, one id or a list / tuple of ids (numpy or 0-d torch
    integers too); ``CriticalKVError`` for anything else."""
    many = eos_token_id if isinstance(eos_token_id, list | tuple) else [] if eos_token_id is None else [eos_token_id]
    try:
        return [operator.index(token) for token in many]
    except TypeError:
        raise CriticalKVError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}") from None


def _check_question(question_ids: torch.Tensor, question_mask: torch.Tensor, rows: int) -> None:
    """Refuse a question that does not continue the context's rows: ids (b, q) with the context's b, a mask of the
    same shape, left padding and a real last token in every row (the answer starts from its logits)."""
    if question_ids.dim() != 2 or question_ids.shape[0] != rows:
        raise CriticalKVError(
            f"question_ids must be (b, q) with the context's {rows} rows, got {tuple(question_ids.shape)}"
        )
    if question_mask.shape != question_ids.shape:
        raise CriticalKVError(
            f"question_mask {tuple(question_mask.shape)} does not match question_ids {tuple(question_ids.shape)}"
        )
    valid = question_mask.bool()
    require_left_padding(valid)
    if not bool(valid[:, -1].all()):
        row = int((~valid[:, -1]).nonzero()[0])
        raise PaddingError(f"row {row} of the question has no real token; every row needs one to answer from")


def token_digest(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    """sha256 of a context's token ids (b, t) and mask (b, t), shapes included: which context a saved file holds."""
    digest = hashlib.sha256(f"{tuple(input_ids.shape)}".encode())
    for tensor in (input_ids, attention_mask):
        digest.update(tensor.detach().to("cpu", torch.int64).contiguous().numpy().data)
    return digest.hexdigest()


def warn_unmasked_padding(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Warn when a batch's row starts with the pad token and no ``attention_mask`` tells the padding: it would be
    read as context. input_ids (b, t)."""
    pad = model.generation_config.pad_token_id
    if attention_mask is None and input_ids.shape[0] > 1 and pad is not None and bool((input_ids[:, 0] == pad).any()):
        warnings.warn(
            f"a row of the batch starts with the pad token ({pad}) and no attention_mask was given: padding is "
            "read as context; pass the tokenizer's attention_mask",
            stacklevel=4,  # the caller of prefill, past torch.no_grad's wrapper
        )


class StageDynamicCache(StageLength, DynamicCache):
    """transformers' ``DynamicCache``, its length read from a layer this pipeline stage holds (``StageLength``)."""


def full_cache(model: PreTrainedModel) -> DynamicCache:
    """transformers' own cache for the full context. On a pipeline stage the layers other stages run are
    ``DummyLayer``, as in ``CompressedCache``: transformers sizes masks, and ``StageLength`` reads the length, from
    the first cache layer that is not one, and that layer must be one this stage fills (an empty layer would size a
    question's mask to the question alone, and ``get_seq_length`` would read 0, so a rewind would drop nothing)."""
    cache = StageDynamicCache(config=model.config)
    cache.layers[:] = on_this_stage(cache.layers, stage_layers(model))
    return cache


class ContextSession:
    """A context prefilled once under a method and budget; each call continues it and trims back.

    Parameters
    ----------
    model
        A supported causal LM.
    method, budget, options
        As in ``criticalkv.compress``; ``"full"`` (or budget 1.0) keeps the full cache for comparison.
    chunk_size, cap, compress_every
        Bounded memory, as in ``criticalkv.compress``: ``prefill`` runs ``chunk_size`` tokens at a time and
        compresses back to ``cap`` after each chunk; ``ask`` compresses back to ``cap`` every ``compress_every``
        tokens, on a copy of the context (the next question starts from the same context).

    Attributes
    ----------
    prefill_seconds
        Wall-clock time of the latest prefill's forward, compression included (a ``SharedPrefill``'s session: the
        one shared forward, every target's compression included).
    compress_cpu_seconds
        Process CPU time spent scoring, selecting and compressing this session's cache inside that prefill (host
        time: GPU kernels still running are not in it; 0 for the full cache; a ``SharedPrefill`` target whose
        scorer equals an earlier target's reuses its scores, which count with the earlier target).

    Notes
    -----
    Question-agnostic use: ``prefill(context)``, then ``ask(question)`` as often as needed; the question's
    tokens continue the context's positions and are never compressed. Question-aware use: ``prefill`` the
    context and the question together, then ``ask`` with no new tokens.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        method: str | Method = "critical-snapkv",
        budget: Budget | float | int | str = 0.2,
        *,
        chunk_size: int | None = None,
        cap: int | None = None,
        compress_every: int | None = None,
        **options: object,
    ) -> None:
        self.model = model
        self.compressor: Compressor | None = bounded_compressor(
            model, method, budget, chunk_size, cap, compress_every, options
        )
        self.chunk_size = chunk_size
        self.cache: Cache | None = None
        self.mask: torch.Tensor | None = None  # (b, seen) logical attention mask of the cached tokens
        self.context_length = 0
        self.prefill_seconds = self.compress_cpu_seconds = float("nan")  # until a prefill
        self.context_digest: str | None = None  # sha256 of the context's ids and mask (``persist.token_digest``)
        # layer -> (places, seen) of a stacked session's rows (``places.join``), followed while it answers
        self._stacked_places: dict[int, tuple] = {}

    @classmethod
    def from_cache(
        cls,
        model: PreTrainedModel,
        compressor: Compressor,
        cache: Cache,
        mask: torch.Tensor,
        last_logits: torch.Tensor,
        prefill_seconds: float = float("nan"),
        compress_cpu_seconds: float = float("nan"),
    ) -> ContextSession:
        """A session over a cache another component prefilled (``SharedPrefill``), with that prefill's timings
        (NaN: not measured)."""
        session = cls.__new__(cls)
        session.model, session.compressor, session.cache = model, compressor, cache
        session.mask = session.mask_with_pending = mask
        session.context_length = mask.shape[1]
        session.last_logits = last_logits
        session.prefill_seconds = prefill_seconds
        session.compress_cpu_seconds = compress_cpu_seconds
        session.context_digest = None
        session.chunk_size = None
        session._stacked_places = {}
        return session

    def save(self, path: str | os.PathLike) -> int:
        """Write the compressed context and what ``ask`` starts from to ``path`` (safetensors, atomically); returns
        the file's size in bytes. ``ContextSession.load`` reads it back; see docs/serving.md for the file."""
        from criticalkv.runtime.persist import save_session

        return save_session(self, path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model: PreTrainedModel,
        method: str | Method | None = None,
        *,
        cap: int | None = None,
        compress_every: int | None = None,
    ) -> ContextSession:
        """A session ``save`` wrote, ready to ``ask``, on ``model`` (the one it was saved from: its config, weights
        and dtype are checked, else ``StoredContextError``). ``method``: only for a file whose method is not a
        preset (a custom ``Method``); it is not run again, the context stays as it was compressed.
        ``compress_every``, ``cap``: compress each answer back to ``cap`` entries per KV head every
        ``compress_every`` generated tokens, with the file's method (on a copy of the context, as for a session
        made with them); ``cap`` defaults to the file's budget when that is an entry count."""
        from criticalkv.runtime.persist import load_session

        return load_session(path, model, method, cap=cap, compress_every=compress_every)

    @classmethod
    def stacked(cls, sessions: list[ContextSession]) -> ContextSession:
        """One session whose batch rows are the rows of ``sessions``, in order: sessions of one prompt
        (``SharedPrefill``'s, one per method) answer one question in a single batched decode, and one session given
        n times answers n questions on its context at once (the server's batches).

        Every session must hold an unpadded prompt of the same length (checked; each row decodes from its own cache,
        so the prompts themselves may differ) in a stackable ``CompressedCache`` (``CompressedCache.stack``) with
        nothing asked yet; the sessions themselves are left as they are. Where every session knows where its kept
        entries stand (a scorer that reads places), the stacked rows' answers compressed while decoding know it too.
        """
        if not sessions:
            raise CacheStateError("nothing to stack")
        first = sessions[0]
        if any(s.cache is None or s.mask.shape != first.mask.shape or not bool(s.mask.all()) for s in sessions):
            raise CacheStateError("stacked sessions must hold unpadded prompts of one length")
        if any(s.model is not first.model for s in sessions):
            raise CacheStateError("stacked sessions must share one model")
        cache = CompressedCache.stack([s.cache for s in sessions])
        mask = torch.cat([s.mask for s in sessions])  # (rows, t)
        last = torch.cat([s.last_logits for s in sessions])  # (rows, vocab)
        seconds = sum(s.compress_cpu_seconds for s in sessions)
        session = cls.from_cache(first.model, first.compressor, cache, mask, last, first.prefill_seconds, seconds)
        if first.compressor is not None and first.compressor.places is not None:
            parts = [(None if s.compressor is None else s.compressor.places, s.cache.layers) for s in sessions]
            session._stacked_places = join_places(parts, cache.layers)
        return session

    # --- phases ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        guide_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill (and compress) the context: input_ids (b, t), left-padded if rows differ, with their
        ``attention_mask`` (b, t) (None: every token is real). Returns the last position's logits (b, vocab).

        ``guide_ids`` (b, g), with ``chunk_size``: the tokens whose queries score every chunk but the last, run after
        it and never kept (normally the question that ends the prompt; ``prefill_in_chunks``)."""
        _check_ids(input_ids, "input_ids", "(b, t)")
        if guide_ids is not None and self.chunk_size is None:
            raise BoundedMemoryError("guide_ids scores the chunks of a chunked prefill: give the session a chunk_size")
        if input_ids.shape[-1] == 0:
            raise CriticalKVError("the context is empty: prefill needs at least one token")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise CriticalKVError(
                f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
            )
        warn_unmasked_padding(self.model, input_ids, attention_mask)
        self.cache = self.compressor.new_cache() if self.compressor else full_cache(self.model)
        # Sliding-window layers (Gemma 3) drop what leaves their window unless told to keep it for a rewind.
        self.cache.activate_past_recording()
        self.mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        self.context_length = 0
        self.context_digest = token_digest(input_ids, self.mask)
        if self.compressor is not None:
            self.compressor.start_prefill()
        start = time.perf_counter()
        try:
            if self.chunk_size is not None:
                logits = self._forward_in_chunks(input_ids, self.mask, guide_ids)
            else:
                logits = self._forward(input_ids, self.mask)
        except BaseException:
            self.cache = None  # a half-filled context: the next ask refuses it rather than answering on it
            raise
        self.prefill_seconds = time.perf_counter() - start
        self.compress_cpu_seconds = self.compressor.compress_cpu_seconds if self.compressor is not None else 0.0
        self.context_length = input_ids.shape[1]
        self.cache.crop(0)  # sliding layers trim back to their window now that the context is in
        release_views(self.cache.layers)  # ... and their window stops holding the whole prompt's storage
        self.last_logits = logits
        return logits

    @torch.no_grad()
    def ask(
        self,
        question_ids: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        eos_token_id: int | list[int] | str | None = "model",
        question_mask: torch.Tensor | None = None,
        min_new_tokens: int = 0,
    ) -> Generation:
        """Greedy answer to question_ids (b, q) appended to the context (None: answer the prefilled prompt).

        A row ends at its first token of ``eos_token_id``: by default (``"model"``) the model's own end-of-sequence
        tokens (``generation_config.eos_token_id``, where ``generate`` stops too); None runs to ``max_new_tokens``.
        The first ``min_new_tokens`` tokens are never one of them (their logits are -inf there, as under transformers'
        ``min_new_tokens`` / ``min_length``). The cache is trimmed back to the context afterwards, so the next
        question sees the same context.
        """
        question_mask, stops = self._checked(question_ids, question_mask, max_new_tokens, min_new_tokens, eos_token_id)
        if question_mask is not None and self._padding_reaches_a_window(question_mask, max_new_tokens):
            return self._by_question_length(question_ids, question_mask, max_new_tokens, min_new_tokens, stops)
        start = time.perf_counter()
        steps = self._steps(question_ids, max_new_tokens, stops, question_mask, min_new_tokens)
        try:
            tokens, seconds = [], []
            for token, step_seconds in steps:
                tokens.append(token)
                seconds.append(step_seconds)
        finally:
            steps.close()  # rewinds now, even when the caller's frame (and this generator) outlives an exception
        if not tokens:  # max_new_tokens == 0: the question's forward alone
            empty = torch.empty(self.mask.shape[0], 0, dtype=torch.long, device=self.mask.device)
            return Generation(empty, time.perf_counter() - start)
        return Generation(torch.stack(tokens, dim=1), seconds[0], seconds[1:])

    def stream(
        self,
        question_ids: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        eos_token_id: int | list[int] | str | None = "model",
        question_mask: torch.Tensor | None = None,
        min_new_tokens: int = 0,
    ) -> Iterator[tuple[torch.Tensor, float]]:
        """``ask`` one token at a time: yields each step's greedy tokens (b,) and the seconds it took (the first:
        the question's forward). The cache is rewound to the context when the generator ends or is closed.

        Questions of different lengths on a sliding-window model are refused here (``ask`` answers them one length
        at a time; see ``_padding_reaches_a_window``)."""
        question_mask, stops = self._checked(question_ids, question_mask, max_new_tokens, min_new_tokens, eos_token_id)
        if question_mask is not None and self._padding_reaches_a_window(question_mask, max_new_tokens):
            raise PaddingError(
                "stream cannot answer questions of different lengths on a sliding-window model (the padding would "
                "push real tokens out of the window): stream them one length at a time, or use ask"
            )
        return self._steps(question_ids, max_new_tokens, stops, question_mask, min_new_tokens)

    def _checked(
        self,
        question_ids: torch.Tensor | None,
        question_mask: torch.Tensor | None,
        max_new_tokens: int,
        min_new_tokens: int,
        eos_token_id: int | list[int] | str | None,
    ) -> tuple[torch.Tensor | None, list[int]]:
        """``ask``'s and ``stream``'s arguments checked: the question's mask (b, q) (None: no question) and the stop
        tokens (``"model"``: the model's own end-of-sequence tokens)."""
        if self.cache is None:
            raise CacheStateError("call prefill(context) first")
        if question_ids is not None:
            _check_ids(question_ids, "question_ids", "(b, q)")
        if max_new_tokens < 0 or min_new_tokens < 0:
            raise CriticalKVError(
                f"max_new_tokens and min_new_tokens must be >= 0, got {max_new_tokens}, {min_new_tokens}"
            )
        if isinstance(eos_token_id, str) and eos_token_id == "model":
            eos_token_id = self.model.generation_config.eos_token_id
        stops = _stop_tokens(eos_token_id)
        if question_ids is None or question_ids.shape[1] == 0:
            return None, stops
        question_mask = torch.ones_like(question_ids) if question_mask is None else question_mask
        _check_question(question_ids, question_mask, self.mask.shape[0])
        return question_mask, stops

    def _steps(
        self,
        question_ids: torch.Tensor | None,
        max_new_tokens: int,
        stops: list[int],
        question_mask: torch.Tensor | None,
        min_new_tokens: int,
    ) -> Iterator[tuple[torch.Tensor, float]]:
        """The greedy decode loop of ``ask`` and ``stream``, its arguments checked (``_checked``; question_mask None:
        no question). It rewinds the cache when it ends or is closed, also after an exception inside a forward
        (Ctrl-C, out of memory): an interrupted answer must not leave its tokens in the cache. Compressing while
        decoding (``compress_every``) changes the context itself: the answer then runs on a copy of it."""
        rolling = None if self.compressor is None else self.compressor.rolling
        places = None if rolling is None else self.compressor.places
        saved = None
        if rolling is not None and rolling.every is not None:
            saved = (copy.deepcopy(self.cache), rolling.saved(), None if places is None else places.saved())
            for index, (context, seen) in self._stacked_places.items():  # this batch's rows, while they answer
                places.remember(index, self.cache.layers[index], context, seen)
        try:
            with torch.no_grad():
                start = time.perf_counter()
                if question_mask is None:
                    logits = self.last_logits
                else:
                    logits = self._forward(question_ids, torch.cat([self.mask, question_mask], dim=1))
                elapsed = time.perf_counter() - start
                eos = torch.tensor(stops, dtype=torch.long, device=logits.device)
                done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
                full_mask = self.mask_with_pending
                for step in range(max_new_tokens):
                    if step < min_new_tokens and eos.numel():
                        logits = logits.index_fill(-1, eos, float("-inf"))  # (b, vocab), a copy: no stop token yet
                    token = logits.argmax(-1)  # (b,)
                    if eos.numel():
                        token = torch.where(done, eos[0], token)  # finished rows repeat their end-of-sequence token
                    done |= torch.isin(token, eos)
                    yield token, elapsed
                    if bool(done.all()) or step == max_new_tokens - 1:
                        break
                    tick = time.perf_counter()
                    full_mask = torch.cat([full_mask, torch.ones_like(token[:, None])], dim=1)
                    logits = self._forward(token[:, None], full_mask)
                    elapsed = time.perf_counter() - tick
        finally:
            if saved is None:
                self.rewind()
            else:
                self.cache = saved[0]
                rolling.restore(saved[1])
                if places is not None:
                    places.restore(saved[2])
                self.mask_with_pending = self.mask

    def _padding_reaches_a_window(self, question_mask: torch.Tensor, max_new_tokens: int) -> bool:
        """Whether a padded question (rows of different lengths, mask (b, q)) would put padding inside the window of a
        sliding-window layer. Such a window spans cache slots, not tokens: the padding between the context and a
        short question takes slots of the window and pushes real tokens out of it, so the row would answer from
        another context than alone (a first-step logit 0.35 away from the solo run's, window 16). Within the window
        (context, question and answer no longer than it) the padding is masked and pushes nothing out."""
        if bool(question_mask.bool().all()):
            return False
        windows = [layer.sliding_window for layer in self.cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
        slots = self.mask.shape[1] + question_mask.shape[1] + max_new_tokens  # the cache's length at most
        return bool(windows) and slots > min(windows)

    def _by_question_length(
        self,
        question_ids: torch.Tensor,
        question_mask: torch.Tensor,
        max_new_tokens: int,
        min_new_tokens: int,
        stops: list[int],
    ) -> Generation:
        """Answer questions of different lengths (ids and mask (b, q), left-padded) in batches of one length each, so
        no padding falls between context and question (``_padding_reaches_a_window``). Each batch decodes on a copy
        of its rows' cache; the session's own cache is left as it is. A batch that ends early (every row at an
        end-of-sequence token) is filled with the first of them, as a finished row is; the timings are the
        batches' together."""
        lengths = question_mask.bool().sum(-1)  # (b,)
        parts = []
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero().flatten()  # (g,)
            part = self._rows(rows)
            question = question_ids[rows, -length:]  # (g, length): no padding left
            generation = part.ask(question, max_new_tokens, stops or None, None, min_new_tokens)
            parts.append((rows, generation))
        width = max(generation.tokens.shape[1] for _, generation in parts)
        tokens = question_ids.new_full((question_ids.shape[0], width), stops[0] if stops else 0)  # (b, n)
        result = Generation(tokens, 0.0)
        for rows, generation in parts:
            tokens[rows, : generation.tokens.shape[1]] = generation.tokens
            result.prefill_seconds += generation.prefill_seconds
            result.decode_seconds += generation.decode_seconds
        return result

    def _rows(self, rows: torch.Tensor) -> ContextSession:
        """A session over a copy of the context's ``rows`` (g,): its cache, mask and last logits."""
        part = ContextSession.__new__(ContextSession)
        part.model, part.compressor, part.context_length = self.model, self.compressor, self.context_length
        part.chunk_size = self.chunk_size
        part._stacked_places = {}  # rows of a context: their entries' places are not followed (placed by rank)
        part.cache = copy.deepcopy(self.cache)
        part.cache.batch_select_indices(rows)
        part.mask = part.mask_with_pending = self.mask[rows]
        part.last_logits = self.last_logits[rows]
        part.prefill_seconds, part.compress_cpu_seconds = self.prefill_seconds, self.compress_cpu_seconds
        return part

    def rewind(self) -> None:
        """Drop everything appended after the context (question and answer tokens) and give back the memory
        they took: a compressed cache then holds its compressed context alone, as right after the prefill.

        Each layer is cropped by what it holds beyond the context: a forward stopped part-way (an exception inside
        ``ask``) has appended the new tokens to the first layers only."""
        cropped = False
        for layer in self.cache.layers:
            if isinstance(layer, DummyLayer) or not layer.is_initialized:  # another stage's, or never filled
                continue
            extra = layer.get_seq_length() - self.context_length
            if extra > 0:
                layer.crop(-extra)
                cropped = True
        if cropped:
            release_views(self.cache.layers, slack=REWIND_SLACK)  # transformers' layers crop to views
        if isinstance(self.cache, CompressedCache):
            self.cache.compact()
        self.mask_with_pending = self.mask

    # --- accounting --------------------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of key/value storage the cache holds now."""
        if hasattr(self.cache, "nbytes"):
            return self.cache.nbytes()
        return sum(storage_bytes([layer.keys, layer.values]) for layer in self._filled_layers())

    def kv_entries(self) -> int:
        """(batch, layer, head, token) entries the cache holds now."""
        if hasattr(self.cache, "entries"):
            return self.cache.entries()
        return sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] for layer in self._filled_layers())

    def _filled_layers(self) -> list:
        """The layers of a transformers cache that hold keys (not another pipeline stage's ``DummyLayer``)."""
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys is not None]

    # --- internals ---------------------------------------------------------------------------------------------
    @contextmanager
    def _installed(self) -> Iterator[None]:
        """The compressor installed for the block (a full session: refused inside another block, whose hooks would
        replace or compress its cache)."""
        if self.compressor is None:
            refuse_nesting(self.model)
            yield
            return
        self.compressor.install()
        try:
            yield
        finally:
            self.compressor.uninstall()

    def _forward_in_chunks(
        self, input_ids: torch.Tensor, mask: torch.Tensor, guide_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Prefill input_ids (b, t) with their mask (b, t) ``chunk_size`` tokens at a time, each chunk but the last
        scored by ``guide_ids`` (b, g) if given; last logits."""
        self.mask_with_pending = mask
        rolling = None if self.compressor is None else self.compressor.rolling
        with self._installed():
            out = prefill_in_chunks(self.model, input_ids, mask, self.cache, self.chunk_size, rolling, guide_ids)
        return out.logits[:, -1, :].float()

    def _forward(self, input_ids: torch.Tensor, full_mask: torch.Tensor) -> torch.Tensor:
        """Run new tokens (b, q) given the logical mask of everything so far (b, seen + q); last logits."""
        self.mask_with_pending = full_mask
        with self._installed():
            out = forward_on_cache(self.model, input_ids, full_mask, self.cache)
        return out.logits[:, -1, :].float()
