"""The reference every exactness test compares with: Hugging Face greedy ``generate`` on the loaded target."""

from __future__ import annotations

import torch

from drafters.hf_greedy import greedy_generate


def hf_greedy(loaded, prompt_ids: list[int], n: int) -> list[int]:
    """The ``n`` (or fewer, at end of sequence) greedy tokens after ``prompt_ids``, on the model's own device."""
    ids = torch.tensor([prompt_ids], device=loaded.device)
    with torch.no_grad():
        out = greedy_generate(loaded.model, ids, n, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1] :].tolist()
