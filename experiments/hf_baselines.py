"""Hugging Face ``generate`` as baselines of ``draftgym bench`` and ``run``: ``hf_greedy`` (greedy), ``hf_pld`` (its
prompt lookup, ``prompt_lookup_num_tokens``), ``hf_static`` (greedy over a ``StaticCache`` whose length is rounded up
to a multiple of ``HF_CACHE_BUCKET`` positions) and ``hf_compile`` (the same, with ``generate`` compiling its forward,
which Hugging Face does on CUDA only).

Each call decodes greedily with only the options its method names: ``generate`` is handed a ``GenerationConfig`` of
those alone and, for the call, a model generation config that holds only the end-of-sequence and padding ids. From
transformers 5 on, ``generate`` fills every option a passed config leaves unset from ``model.generation_config`` (the
folder's ``generation_config.json``: ``repetition_penalty`` 1.1 in Qwen2.5-Instruct's, sampling settings, suppressed
tokens, ...), which would make these baselines other than greedy and their tokens other than our ``ar``'s."""

from __future__ import annotations

import time
from typing import Any

import torch

from drafters.hf_greedy import greedy_config, only_special_ids

HF_METHODS = ("hf_greedy", "hf_pld", "hf_static", "hf_compile")
HF_CACHE_BUCKET = 256  # the static cache's length is rounded up to this: one compiled shape per size
_CACHE = {"hf_static": "static", "hf_compile": "compile"}
STATIC_CACHE_METHODS = tuple(
    _CACHE
)  # their cache is sized per call: warmed once per bucket (bucket_warmup_lengths)


def device_problem(method: str, device: str) -> str | None:
    """Why ``method`` cannot run on a device of type ``device``, or None."""
    if method == "hf_compile" and device != "cuda":
        return f"Hugging Face compiles generate's forward on CUDA only, not on {device}; use hf_static there"
    return None


def _cache_kwarg() -> str:
    """``generate``'s keyword for a cache object: ``cache`` from transformers 5.24 on (``past_key_values`` warns)."""
    import transformers

    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    return "cache" if major_minor >= (5, 24) else "past_key_values"


class HFRunner:
    """One of ``HF_METHODS`` on a loaded model (``loaded``: an ``env.model.LoadedModel``)."""

    def __init__(self, loaded: Any, method: str) -> None:
        from experiments.methods import MethodError

        problem = device_problem(method, loaded.device.type)
        if problem:
            raise MethodError(f"{method}: {problem}")
        self.loaded = loaded
        self.pld = 10 if method == "hf_pld" else 0
        self.cache = _CACHE.get(method, "dynamic")

    @torch.no_grad()
    def run(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        from env.target import check_prompt

        # transformers only warns past the context: refused here, as our decoders refuse it
        check_prompt(prompt_ids, self.loaded.max_context)
        model = self.loaded.model
        ids = torch.tensor([prompt_ids], device=self.loaded.device)
        options: dict[str, Any] = {}
        kwargs: dict[str, Any] = {"attention_mask": torch.ones_like(ids)}
        if self.pld:
            options["prompt_lookup_num_tokens"] = self.pld
        if self.cache != "dynamic":
            from transformers import StaticCache

            size = -(-(ids.shape[1] + max_new_tokens) // HF_CACHE_BUCKET) * HF_CACHE_BUCKET
            kwargs[_cache_kwarg()] = StaticCache(config=model.config, max_cache_len=size)
            options["disable_compile"] = self.cache == "static"
        config = greedy_config(model, max_new_tokens, **options)
        with only_special_ids(model):
            t0 = time.perf_counter()
            out = model.generate(ids, generation_config=config, **kwargs)
            wall = time.perf_counter() - t0
        return [int(t) for t in out[0, ids.shape[1] :].tolist()], wall


def bucket_warmup_lengths(lengths: set[int], max_new_tokens: int, warmed: int) -> list[int]:
    """Prompt lengths that, with 4 new tokens, make ``hf_static``/``hf_compile`` build each static-cache size the
    timed prompts will (``HF_CACHE_BUCKET`` steps; the warm-up prompt of ``warmed`` tokens built the first)."""
    b = HF_CACHE_BUCKET
    have = -(-(warmed + 4) // b)
    need = sorted({-(-(n + max_new_tokens) // b) for n in lengths} - {have})
    return [(k - 1) * b + 1 for k in need]  # (k - 1) * b + 1 + 4 positions: the k-th bucket
