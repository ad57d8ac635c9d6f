"""Save a compressed context to disk and load it back: safetensors tensors under a JSON header that says what they
are (layout version, library version, model fingerprint, dtype, method, budget, a digest of the context's tokens).

Loading refuses a file made for another model (its config or its weights), another dtype or another layout version
with a ``StoredContextError``. Files are written atomically: a temporary file in the target's folder, flushed to
disk, then renamed over the target, so a crash leaves either the old file or the new one, never half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import weakref

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from criticalkv.budget import Budget
from criticalkv.cache import CompressedCache, CompressedLayer
from criticalkv.errors import BoundedMemoryError, CacheStateError, CriticalKVError, StoredContextError
from criticalkv.files import write_atomic
from criticalkv.methods import PRESETS, build_method, method_spec, parse_method_spec
from criticalkv.runtime.api import make_compressor
from criticalkv.runtime.chunked import schedule_decoding
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.method import Method
from criticalkv.runtime.session import ContextSession

#: the version of the file layout this module writes; a file of another version is refused, never guessed at
LAYOUT_VERSION = 1
HEADER_KEY = "criticalkv"  # the safetensors metadata entry that holds the JSON header
#: config entries that say how the model runs, not what it computes: left out of its fingerprint
_VOLATILE_CONFIG = ("transformers_version", "name_or_path", "dtype", "torch_dtype", "architectures")

_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (parameter versions, fingerprint)


def model_fingerprint(model: PreTrainedModel) -> dict[str, str]:
    """The model's identity: sha256 of its config (what it computes) and of its weights (each parameter's name,
    dtype, shape and bytes, in order). Memoised per model object and recomputed when a parameter changed in place
    (its version counter moved)."""
    parameters = list(model.named_parameters())
    versions = tuple(p._version for _, p in parameters)
    memo = _fingerprints.get(model)
    if memo is not None and memo[0] == versions:
        return memo[1]
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE_CONFIG}
    weights = hashlib.sha256()
    for name, parameter in parameters:
        weights.update(f"{name}:{parameter.dtype!s}:{tuple(parameter.shape)};".encode())
        flat = parameter.detach().contiguous().view(-1).view(torch.uint8)  # the raw bytes, any dtype
        weights.update(flat.cpu().numpy().data)
    fingerprint = {
        "model_type": str(model.config.model_type),
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "weights_sha256": weights.hexdigest(),
    }
    _fingerprints[model] = (versions, fingerprint)
    return fingerprint


def model_dtype(model: PreTrainedModel) -> torch.dtype:
    return next(model.parameters()).dtype


# --- writing ---------------------------------------------------------------------------------------------------------
def _cache_tensors(cache: Cache) -> tuple[dict[str, torch.Tensor], list[dict[str, int]]]:
    """Every layer's tensors under ``layer.<i>.<name>``, and each layer's counts."""
    if not isinstance(cache, CompressedCache):
        raise CacheStateError(
            f"only a CompressedCache is saved, got {type(cache).__name__} (a full-cache session compresses nothing)"
        )
    tensors, counts = {}, []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, CompressedLayer):
            raise CacheStateError(
                f"layer {index} is a {type(layer).__name__}: caches with sliding-window layers or pipeline stages "
                "cannot be saved"
            )
        state, layer_counts = layer.state()
        tensors.update({f"layer.{index}.{name}": tensor for name, tensor in state.items()})
        counts.append(layer_counts)
    return tensors, counts


def _method_header(method: Method) -> dict[str, object]:
    """The method's spec (the options given as keywords included) and description, named by that spec when it
    builds the method again: then the description is ``repr(build_method(spec))`` (``_spec_rebuilds``)."""
    spec = method_spec(method)
    described = method if spec is None else dataclasses.replace(method, name=spec)
    return {"spec": spec or method.name, "description": repr(described)}


def _spec_rebuilds(header: dict[str, object]) -> bool:
    """Whether the file's spec builds the method its description names (a file made with a method of the user's
    own, or before keyword options were written into the spec, may say otherwise)."""
    try:
        return repr(build_method(header["method"]["spec"])) == header["method"]["description"]
    except CriticalKVError:
        return False


def _header(compressor: Compressor | None, model: PreTrainedModel, kind: str, **extra: object) -> dict[str, object]:
    if compressor is None:
        raise CacheStateError("a cache without its compressor cannot say which method and budget made it")
    from criticalkv import __version__

    return {
        "layout_version": LAYOUT_VERSION,
        "library_version": __version__,
        "kind": kind,
        "model": model_fingerprint(model),
        "dtype": str(model_dtype(model)).removeprefix("torch."),
        "method": _method_header(compressor.method),
        "budget": compressor.budget.value,
        **extra,
    }


def _write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: dict[str, object]) -> int:
    """Serialise and write atomically; the bytes written."""
    # safetensors wants each tensor contiguous with a storage of its own (a view of a larger buffer is copied)
    owned = {
        name: t.detach().contiguous().clone() if t.untyped_storage().nbytes() > t.nbytes else t.contiguous()
        for name, t in tensors.items()
    }
    data = safetensors_bytes(owned, metadata={HEADER_KEY: json.dumps(header, sort_keys=True)})
    write_atomic(path, data)
    return len(data)


def save_cache(cache: CompressedCache, path: str | os.PathLike, context_digest: str | None = None) -> int:
    """Write a compressed cache (``CompressedCache.save``); returns the file's size in bytes."""
    compressor = cache.compressor
    tensors, counts = _cache_tensors(cache)
    model = None if compressor is None else compressor.model
    header = _header(compressor, model, "cache", layers=counts, context={"sha256": context_digest})
    return _write(path, tensors, header)


# --- reading ---------------------------------------------------------------------------------------------------------
def read_header(path: str | os.PathLike) -> dict[str, object]:
    """The JSON header of a saved context, without reading its tensors."""
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise StoredContextError(f"{path} is not a saved criticalkv context: {error}") from None
    if HEADER_KEY not in metadata:
        raise StoredContextError(f"{path} is a safetensors file without a criticalkv header")
    return json.loads(metadata[HEADER_KEY])


def check_header(header: dict[str, object], model: PreTrainedModel, path: str | os.PathLike) -> None:
    """Refuse a file of another layout version, model or dtype, saying which and why."""
    if header.get("layout_version") != LAYOUT_VERSION:
        raise StoredContextError(
            f"{path} has layout version {header.get('layout_version')}, this library reads version {LAYOUT_VERSION}: "
            "compress the context again"
        )
    saved, ours = header["model"], model_fingerprint(model)
    for key, what in (("model_type", "model family"), ("config_sha256", "config"), ("weights_sha256", "weights")):
        if saved.get(key) != ours[key]:
            raise StoredContextError(
                f"{path} was saved from another model: its {what} differs ({key} {saved.get(key)} here {ours[key]})"
            )
    dtype = str(model_dtype(model)).removeprefix("torch.")
    if header.get("dtype") != dtype:
        raise StoredContextError(f"{path} holds a {header.get('dtype')} cache; the model runs in {dtype}")


def _loaded_method(header: dict[str, object], method: str | Method | None) -> str | Method:
    """The method a loaded cache's compressor runs: the given one, else the file's spec (a preset's)."""
    if method is not None:
        return method
    spec = header["method"]["spec"]
    if parse_method_spec(spec)[0] not in PRESETS:
        raise StoredContextError(
            f"the saved method {spec!r} is not a preset: pass the Method it was compressed with (method=...)"
        )
    build_method(spec)  # an option this library no longer has is refused here, with its name
    return spec


def read_tensors(path: str | os.PathLike, model: PreTrainedModel) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """The checked header and every tensor, on the model's device."""
    header = read_header(path)
    check_header(header, model, path)
    device = next(model.parameters()).device
    with safe_open(str(path), framework="pt", device=str(device)) as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (safe_open is no dict)
    return header, tensors


def build_cache(
    header: dict[str, object], tensors: dict[str, torch.Tensor], model: PreTrainedModel, method: str | Method | None
) -> CompressedCache:
    """The cache the tensors describe, under a compressor of the file's method and budget (it installs criticalkv's
    attention over the cache; the context is already compressed and is never compressed again)."""
    compressor = make_compressor(model, _loaded_method(header, method), Budget.parse(header["budget"]))
    cache = compressor.new_cache()
    counts = header["layers"]
    if len(counts) != len(cache.layers):
        raise StoredContextError(f"the file holds {len(counts)} layers, the model has {len(cache.layers)}")
    for index, layer_counts in enumerate(counts):
        prefix = f"layer.{index}."
        state = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
        cache.layers[index] = CompressedLayer.from_state(state, layer_counts)
    return cache


def load_cache(path: str | os.PathLike, model: PreTrainedModel, method: str | Method | None = None) -> CompressedCache:
    """A cache ``save_cache`` wrote (``CompressedCache.load``)."""
    header, tensors = read_tensors(path, model)
    return build_cache(header, tensors, model, method)


# --- sessions --------------------------------------------------------------------------------------------------------
def save_session(session: ContextSession, path: str | os.PathLike, model_source: str | None = None) -> int:
    """Write a session's compressed context and what ``ask`` starts from (``ContextSession.save``); the file's size
    in bytes. ``model_source``: the name the model was loaded by (a preset, a folder), recorded for ``criticalkv
    ask`` to load it again; the fingerprint, not this name, decides whether a model may load the file."""
    if session.cache is None:
        raise CacheStateError("call prefill(context) before saving a session")
    if session.cache.get_seq_length() != session.context_length:
        raise CacheStateError("the session holds tokens after its context: rewind first")
    tensors, counts = _cache_tensors(session.cache)
    places = None if session.compressor is None else session.compressor.places
    if places is not None:  # where the kept entries stand, read by compression while decoding
        tensors.update(places.tensors(session.cache.layers))
    tensors["session.mask"] = session.mask  # (b, t)
    tensors["session.last_logits"] = session.last_logits  # (b, vocab) float32
    header = _header(
        session.compressor,
        session.model,
        "session",
        layers=counts,
        context={"tokens": session.context_length, "sha256": session.context_digest},
        model_source=model_source,
    )
    return _write(path, tensors, header)


def load_session(
    path: str | os.PathLike,
    model: PreTrainedModel,
    method: str | Method | None = None,
    *,
    cap: int | None = None,
    compress_every: int | None = None,
) -> ContextSession:
    """A session ``save_session`` wrote, ready to ``ask`` (``ContextSession.load``); with ``compress_every``, its
    answers are compressed back to ``cap`` while decoding (``schedule_decoding``)."""
    header, tensors = read_tensors(path, model)
    if header.get("kind") != "session":
        raise StoredContextError(f"{path} holds a bare cache, not a session: load it with CompressedCache.load")
    if cap is not None and compress_every is None:
        raise BoundedMemoryError(
            "a loaded session's cap applies with compress_every: its context is compressed already"
        )
    mask, last = tensors.pop("session.mask"), tensors.pop("session.last_logits")
    if compress_every is not None and method is None and not _spec_rebuilds(header):
        raise StoredContextError(
            f"{path}: its method {header['method']['description']} is not what its spec "
            f"{header['method']['spec']!r} builds, and compressing while decoding would run the spec's: pass "
            "method= (the Method it was compressed with)"
        )
    cache = build_cache(header, tensors, model, method)
    if compress_every is not None:
        schedule_decoding(cache.compressor, Budget.parse(header["budget"]), cap, compress_every)
    if cache.compressor.places is not None:  # a file saved without them (a rank-placing scorer's) leaves them unknown
        cache.compressor.places.load(tensors, cache.layers, mask.sum(-1))
    session = ContextSession.from_cache(model, cache.compressor, cache, mask, last)
    session.context_digest = header["context"]["sha256"]
    return session
