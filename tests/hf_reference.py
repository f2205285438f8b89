"""The reference every exactness test compares with: Hugging Face greedy ``generate`` on the loaded target."""

from __future__ import annotations

import torch


def hf_greedy(loaded, prompt_ids: list[int], n: int) -> list[int]:
    """The ``n`` (or fewer, at end of sequence) greedy tokens after ``prompt_ids``, on the model's own device."""
    ids = torch.tensor([prompt_ids], device=loaded.device)
    with torch.no_grad():
        out = loaded.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=2
        )
    return out[0, ids.shape[1] :].tolist()
