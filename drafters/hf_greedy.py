"""Greedy ``generate`` on a transformers model with nothing of its ``generation_config`` but the special ids.

From transformers 5 on, ``generate`` fills every option a passed config leaves unset from ``model.generation_config``
(the folder's ``generation_config.json``: ``repetition_penalty`` 1.1 in Qwen2.5-Instruct's, sampling settings,
suppressed tokens, ...). Every greedy reference of the project goes through here, so none of them decodes other than
greedily: the training answers of self-distillation (``drafters.train_data``), the exactness check
(``env.exactness``), the Hugging Face baselines (``experiments.hf_baselines``) and the tests' reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def special_ids(gen: Any) -> tuple[int | list[int] | None, int | None]:
    """``(eos, pad)`` of a model's generation config: eos as it is there (an id or a list of ids), pad its own, else
    the first eos id (``generate`` pads with it; a list is no pad id)."""
    eos = gen.eos_token_id
    pad = gen.pad_token_id
    if pad is None:
        first = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        pad = first if isinstance(first, int) else None
    return (list(eos) if isinstance(eos, tuple) else eos), pad


def greedy_config(model: Any, max_new_tokens: int, **method_options: Any) -> Any:
    """The ``GenerationConfig`` of one greedy call: the new-token limit, no sampling, the model's eos and pad ids and
    ``method_options`` (a baseline's own: ``prompt_lookup_num_tokens``, ``disable_compile``, ...), nothing else."""
    from transformers import GenerationConfig

    eos, pad = special_ids(model.generation_config)
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos,
                            pad_token_id=pad, **method_options)  # fmt: skip


@contextlib.contextmanager
def only_special_ids(model: Any) -> Iterator[None]:
    """For one ``generate`` call, ``model.generation_config`` holds only its eos, pad and bos ids (what ``generate``
    merges into a passed config's unset fields: nothing else of the folder's file); put back as it was after."""
    from transformers import GenerationConfig

    saved = model.generation_config
    eos, pad = special_ids(saved)
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=saved.bos_token_id
    )
    try:
        yield
    finally:
        model.generation_config = saved


def greedy_generate(model: Any, ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
    """``model.generate`` of ``max_new_tokens`` greedy tokens after ``ids`` (with ``kwargs``: attention mask, cache),
    the model's options other than its special ids left out; ``pad_token_id`` in ``kwargs`` overrides the model's."""
    pad = kwargs.pop("pad_token_id", None)
    config = greedy_config(model, max_new_tokens)
    if pad is not None:
        config.pad_token_id = pad
    with only_special_ids(model):
        return model.generate(ids, generation_config=config, **kwargs)


__all__ = ["greedy_config", "greedy_generate", "only_special_ids", "special_ids"]
