#!/usr/bin/env python
"""Run one NVIDIA kvpress 0.5.5 press on one prompt and dump what it kept, as a reference for criticalkv.

Runs INSIDE the separate kvpress virtual environment (see setup_kvpress_env.sh), as its own process.
kvpress pins transformers<5.3 and patches transformers' attention functions process-wide on import; this script
does not import criticalkv. (Its helpers import kvpress only when called: ``same_process.py`` reuses them.)

    $VENV/bin/python benchmarks/kvpress/run_kvpress.py --model FOLDER --input IDS.json \
        --press critical-snapkv --compression-ratio 0.7 --out OUT.pt [--generate 16]

Input JSON: {"input_ids": [[...]]} (one prompt, batch 1). Optional "question_ids": [[...]]: then
input_ids is the context that gets compressed and the question is fed afterwards on the compressed
cache, exactly as kvpress' pipeline does (positions continue at len(context)): question-agnostic.

Output (torch.save dict):
  kept          list[layer] of list[kv head] of sorted kept positions (ints, into the prompt).
                Evicting presses: the indices kvpress really gathered (captured from its top-k call and
                checked against the gathered keys). AdaKV-style presses (which only mask): the positions
                that are NOT masked. press "none": every position.
  scores        list[layer] of float32 (1, h_kv, T): the base scorer's scores (SnapKV attention scores
                with the window padded at max+1, StreamingLLM 0/1, Knorm -||k||, TOVA), or None.
  selection_scores  critical-snapkv only: the final scores kvpress ran top-k on (stage 2 scores, stage-1
                picks set to finfo(dtype).max), float32 (1, h_kv, T); else None per layer.
  value_norms   critical presses: CriticalKVPress.vwl1norm(values, module) per layer, float32 (1, h_kv, T).
  prefill_last_logits  float32 (vocab,): logits at the last prompt position from the prefill forward. kvpress
                compresses in a hook AFTER each attention layer ran on the full cache, so these are the
                full-cache logits whatever the press (they only differ through numerics: none).
  last_logits   float32 (vocab,): logits at the last position of question_ids (compressed cache) when a
                question is given; otherwise equal to prefill_last_logits.
  generated     list[int] of greedy tokens (--generate N; no EOS stop), first one = argmax(last_logits).
  cache_lengths list[layer] of the cache length after prefill (evicting presses shrink it).
  meta          versions, settings, model shape, timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from importlib.metadata import version as dist_version

PRESSES = ("none", "snapkv", "critical-snapkv", "critical-adakv", "adakv", "streaming", "knorm", "tova")
MASKING_PRESSES = ("adakv", "critical-adakv")


def add_model_and_press_options(p: argparse.ArgumentParser) -> None:
    """Options every kvpress-side script shares: the model folder, its dtype and threads, and the press settings."""
    p.add_argument("--model", required=True, help="local transformers model folder")
    p.add_argument("--compression-ratio", type=float, default=0.5, help="fraction evicted, in [0, 1)")
    p.add_argument("--window-size", type=int, default=32, help="SnapKV window (kvpress' own default is 64)")
    p.add_argument("--kernel-size", type=int, default=5, help="SnapKV pooling kernel (odd)")
    p.add_argument("--epsilon", type=float, default=1e-4, help="CriticalKV epsilon (kvpress default)")
    p.add_argument("--first-stage-ratio", type=float, default=0.5, help="CriticalKV alpha (kvpress default)")
    p.add_argument("--alpha-safeguard", type=float, default=0.20, help="AdaKV safeguard (kvpress default)")
    p.add_argument("--n-sink", type=int, default=4, help="StreamingLLM sink tokens (kvpress default)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--attn-implementation", default="sdpa", help="sdpa (default); AdaKV presses refuse eager")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_press_options(p)
    p.add_argument("--input", required=True, help='JSON file {"input_ids": [[...]]}, batch 1')
    p.add_argument("--press", required=True, choices=PRESSES)
    p.add_argument("--generate", type=int, default=0, metavar="N", help="greedy-decode N tokens")
    p.add_argument("--out", required=True, help="output .pt file")
    return p.parse_args(argv)


def load_model(args, device: str = "cpu"):
    """The model of ``args.model`` in ``args.dtype`` on ``device``, in eval mode, with the Qwen2 workaround.

    CriticalKVPress.vwl1norm reads module.config.head_dim (criticalkv_press.py:63); configs without that field
    (Qwen2) raise AttributeError. It is filled with the head_dim the attention module really uses.
    Returns (model, language-model body, whether the config was patched).
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=dtype, attn_implementation=args.attn_implementation, trust_remote_code=False
    )
    model = model.to(device).eval()
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return model, lm, fill_config_head_dim(lm)


def fill_config_head_dim(lm) -> bool:
    """Give the config the head_dim its attention modules use when it has none (Qwen2); whether it had to."""
    attn0 = lm.layers[0].self_attn
    patched = getattr(attn0.config, "head_dim", None) is None
    if patched:
        attn0.config.head_dim = attn0.head_dim
    return patched


def build_press(args, kvpress):
    r = args.compression_ratio
    if args.press == "none":
        return None

    def snap():
        return kvpress.SnapKVPress(compression_ratio=r, window_size=args.window_size, kernel_size=args.kernel_size)

    if args.press == "snapkv":
        return snap()
    if args.press == "critical-snapkv":
        return kvpress.CriticalKVPress(snap(), epsilon=args.epsilon, first_stage_ratio=args.first_stage_ratio)
    if args.press == "adakv":
        return kvpress.AdaKVPress(press=snap(), alpha_safeguard=args.alpha_safeguard)
    if args.press == "critical-adakv":
        return kvpress.CriticalAdaKVPress(
            press=snap(),
            alpha_safeguard=args.alpha_safeguard,
            epsilon=args.epsilon,
            first_stage_ratio=args.first_stage_ratio,
        )
    if args.press == "streaming":
        return kvpress.StreamingLLMPress(compression_ratio=r, n_sink=args.n_sink)
    if args.press == "knorm":
        return kvpress.KnormPress(compression_ratio=r)
    if args.press == "tova":
        return kvpress.TOVAPress(compression_ratio=r)
    raise ValueError(args.press)


class Recorder:
    """Captures, per layer, the scores and the exact top-k indices that kvpress uses.

    Instance attributes shadow the press methods, so kvpress' own code runs unchanged:
    - the base scorer's `score` (inner press for Critical*/AdaKV wrappers) -> base scores;
    - for evicting presses, the top-level `score` returns a tensor subclass whose `.topk` (the call in
      ScorerPress.compress, scorer_press.py:96) records the indices that feed the gather;
    - for Critical* presses, CriticalKVPress.vwl1norm is evaluated on the same values -> value norms.
    """

    def __init__(self, torch, kvpress, press, press_name):
        self.torch = torch
        self.kvpress = kvpress
        self.press = press
        self.name = press_name
        self.base_scores: dict[int, object] = {}
        self.selection_scores: dict[int, object] = {}
        self.value_norms: dict[int, object] = {}
        self.topk_indices: dict[int, object] = {}
        self.gather_ok: dict[int, bool] = {}
        self._layer = None

    def install(self):
        torch = self.torch
        press = self.press
        rec = self

        class TopkRecorder(torch.Tensor):
            __torch_function__ = torch._C._disabled_torch_function_impl

            def topk(self, *a, **k):
                res = torch.Tensor.topk(self.as_subclass(torch.Tensor), *a, **k)
                rec.topk_indices[rec._layer] = res.indices.detach().clone()
                return res

        base = press.press if hasattr(press, "press") else press
        base_score = base.score  # bound method of the class

        def base_score_wrapper(module, hidden_states, keys, values, attentions, kwargs):
            s = base_score(module, hidden_states, keys, values, attentions, kwargs)
            rec.base_scores[module.layer_idx] = s.detach().float().clone()
            if rec.name.startswith("critical"):
                vn = rec.kvpress.CriticalKVPress.vwl1norm(values, module)
                rec.value_norms[module.layer_idx] = vn.detach().float().clone()
            return s

        base.score = base_score_wrapper

        if self.name not in MASKING_PRESSES:
            # Evicting press: ScorerPress.compress calls self.score(...) then scores.topk(n_kept, dim=-1)
            top_score = press.score  # for critical-snapkv, CriticalKVPress.score (which calls base.score)

            def top_score_wrapper(module, hidden_states, keys, values, attentions, kwargs):
                rec._layer = module.layer_idx
                s = top_score(module, hidden_states, keys, values, attentions, kwargs)
                if press is not base:
                    rec.selection_scores[module.layer_idx] = s.detach().float().clone()
                return s.as_subclass(TopkRecorder)

            if press is not base:
                press.score = top_score_wrapper
            else:
                # same object: chain the base wrapper inside
                def single(module, hidden_states, keys, values, attentions, kwargs):
                    rec._layer = module.layer_idx
                    return base_score_wrapper(module, hidden_states, keys, values, attentions, kwargs).as_subclass(
                        TopkRecorder
                    )

                press.score = single

            compress = press.compress

            def compress_wrapper(module, hidden_states, keys, values, attentions, kwargs):
                k_out, v_out = compress(module, hidden_states, keys, values, attentions, kwargs)
                li = module.layer_idx
                idx = rec.topk_indices.get(li)
                if idx is not None:
                    g = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
                    rec.gather_ok[li] = bool(
                        torch.equal(keys.gather(2, g), k_out) and torch.equal(values.gather(2, g), v_out)
                    )
                return k_out, v_out

            press.compress = compress_wrapper


def main(argv=None):
    args = parse_args(argv)
    if "criticalkv" in sys.modules:
        raise SystemExit("run_kvpress.py must not run in criticalkv's environment")
    t_start = time.perf_counter()

    import kvpress
    import torch
    import transformers
    from transformers import AutoConfig, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not 0 <= args.compression_ratio < 1:
        raise SystemExit("--compression-ratio must be in [0, 1)")

    with open(args.input) as f:
        data = json.load(f)
    input_ids = torch.tensor(data["input_ids"], dtype=torch.long)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise SystemExit(f"input_ids must be [[...]] with batch 1, got shape {tuple(input_ids.shape)}")
    question_ids = None
    if data.get("question_ids"):
        question_ids = torch.tensor(data["question_ids"], dtype=torch.long)
        if question_ids.dim() != 2 or question_ids.shape[0] != 1:
            raise SystemExit("question_ids must be [[...]] with batch 1")
    T = input_ids.shape[1]

    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=False)
    model, lm, patched_head_dim = load_model(args)
    t_load = time.perf_counter() - t0

    n_layers = len(lm.layers)
    n_kv = config.num_key_value_heads
    head_dim = lm.layers[0].self_attn.head_dim

    press = build_press(args, kvpress)
    recorder = None
    if press is not None:
        recorder = Recorder(torch, kvpress, press, args.press)
        recorder.install()

    cache = DynamicCache()
    timings = {"load_s": round(t_load, 3)}
    with torch.no_grad():
        t0 = time.perf_counter()
        ctx = press(model) if press is not None else contextlib.nullcontext()
        with ctx:
            out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        timings["prefill_s"] = round(time.perf_counter() - t0, 3)
        prefill_last_logits = out.logits[0, -1].float().clone()
        cache_lengths = [int(cache.get_seq_length(i)) for i in range(n_layers)]

        # Kept positions, read before any decoding touches the cache.
        kept, scores, sel_scores, vnorms, gather_ok = [], [], [], [], []
        for li in range(n_layers):
            attn = lm.layers[li].self_attn
            if press is None or args.compression_ratio == 0:
                kept.append([list(range(T)) for _ in range(n_kv)])
            elif args.press in MASKING_PRESSES:
                masked = getattr(attn, "masked_key_indices", None)
                keep = torch.ones(n_kv, T, dtype=torch.bool)
                if masked is not None:
                    b, h, s = masked
                    assert bool((b == 0).all())
                    keep[h.cpu(), s.cpu()] = False
                kept.append([torch.nonzero(keep[h]).flatten().tolist() for h in range(n_kv)])
            else:
                idx = recorder.topk_indices.get(li)
                if idx is None:
                    raise RuntimeError(f"layer {li}: kvpress' top-k call was not captured")
                kept.append([sorted(idx[0, h].tolist()) for h in range(n_kv)])
                gather_ok.append(recorder.gather_ok.get(li, False))
            scores.append(recorder.base_scores.get(li) if recorder else None)
            sel_scores.append(recorder.selection_scores.get(li) if recorder else None)
            vnorms.append(recorder.value_norms.get(li) if recorder else None)

        last_logits = prefill_last_logits
        next_pos = T  # kvpress' pipeline: positions continue at the ORIGINAL context length
        if question_ids is not None:
            t0 = time.perf_counter()
            q = question_ids.shape[1]
            pos = torch.arange(next_pos, next_pos + q).unsqueeze(0)
            out = model(input_ids=question_ids, past_key_values=cache, position_ids=pos, logits_to_keep=1)
            last_logits = out.logits[0, -1].float().clone()
            next_pos += q
            timings["question_s"] = round(time.perf_counter() - t0, 3)

        generated = []
        if args.generate > 0:
            t0 = time.perf_counter()
            tok = int(last_logits.argmax())
            generated.append(tok)
            for i in range(args.generate - 1):
                pos = torch.tensor([[next_pos + i]])
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=pos)
                tok = int(out.logits[0, -1].argmax())
                generated.append(tok)
            timings["generate_s"] = round(time.perf_counter() - t0, 3)

    timings["total_s"] = round(time.perf_counter() - t_start, 3)
    if gather_ok and not all(gather_ok):
        print(
            f"WARNING: captured indices do not reproduce kvpress' gather on layers "
            f"{[i for i, ok in enumerate(gather_ok) if not ok]}",
            file=sys.stderr,
        )

    meta = {
        "versions": {
            "python": platform.python_version(),
            "torch": str(torch.__version__),
            "transformers": str(transformers.__version__),
            "kvpress": dist_version("kvpress"),
        },
        "press": args.press,
        "press_repr": repr(press),
        "settings": {
            "compression_ratio": args.compression_ratio,
            "window_size": args.window_size,
            "kernel_size": args.kernel_size,
            "epsilon": args.epsilon,
            "first_stage_ratio": args.first_stage_ratio,
            "alpha_safeguard": args.alpha_safeguard,
            "n_sink": args.n_sink,
            "dtype": args.dtype,
            "attn_implementation": model.config._attn_implementation,
            "generate": args.generate,
            "threads": torch.get_num_threads(),
        },
        "model": {
            "folder": str(args.model),
            "model_type": config.model_type,
            "class": type(model).__name__,
            "num_layers": n_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": n_kv,
            "head_dim": head_dim,
            "vocab_size": config.vocab_size,
        },
        "patched_config_head_dim": patched_head_dim,
        "prompt_len": T,
        "question_len": 0 if question_ids is None else int(question_ids.shape[1]),
        "masking": args.press in MASKING_PRESSES,
        "n_kept": [[len(h) for h in layer] for layer in kept],
        "gather_verified": gather_ok if gather_ok else None,
        "timings": timings,
        "cmdline": sys.argv,
    }
    result = {
        "kept": kept,
        "scores": scores,
        "selection_scores": sel_scores,
        "value_norms": vnorms,
        "prefill_last_logits": prefill_last_logits,
        "last_logits": last_logits,
        "generated": generated,
        "cache_lengths": cache_lengths,
        "meta": meta,
    }
    torch.save(result, args.out)
    summary = {
        "press": args.press,
        "T": T,
        "n_kept_layer0": meta["n_kept"][0],
        "cache_lengths": cache_lengths[:3] + (["..."] if n_layers > 3 else []),
        "gather_verified": None if not gather_ok else all(gather_ok),
        "generated": generated[:16],
        "timings": timings,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
