"""What every path that runs the target shares: the prompt check and the end-of-sequence ids. The target itself
(prefill, tree forward over the KV cache, commit of the accepted path) is ``env.batch.BatchTarget``.
"""

from __future__ import annotations

import numpy as np

from env.model import LoadedModel


class PromptError(ValueError):
    """A prompt that cannot be decoded (empty, or longer than the context); the message is meant for the user."""


def check_prompt(
    prompt_ids: list[int], max_context: int, what: str = "the prompt", vocab_size: int | None = None
) -> None:
    """A ``PromptError`` for a prompt that cannot be decoded: empty, no room after it in the context, a token id
    that is not an integer (Python's or numpy's; a float or a bool is refused, not truncated), or (given
    ``vocab_size``) a token id outside the vocabulary (an embedding lookup out of range; on CUDA a device assert
    that ends every request in flight)."""
    if not prompt_ids:
        raise PromptError(f"{what} is empty")
    if len(prompt_ids) >= max_context:
        raise PromptError(f"{what} has {len(prompt_ids)} tokens; the model's context is {max_context} tokens")
    bad = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
    if bad is not None:  # a float id would be truncated by the embedding lookup, a bool read as 0 or 1
        raise PromptError(f"{what} holds token id {bad!r} ({type(bad).__name__}); token ids are integers")
    if vocab_size is not None:
        bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise PromptError(f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """The ids that end a generation (the generation config's, else the tokenizer's)."""
    return frozenset(loaded.eos_token_ids)
