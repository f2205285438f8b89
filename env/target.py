"""The target wrapper: prefill, one forward pass over a draft tree on top of the KV cache, and the commit of the
accepted path into the cache.

Invariant: the KV cache holds every committed token except the last one (the *root* of the next tree). A tree
forward appends the N tree nodes (root included) at positions ``past + depth``, each attending to the whole cache
and to its ancestors (tree attention: a float mask ``[1, 1, N, past + N]``, 0 where allowed, the dtype minimum
elsewhere). The commit keeps the accepted path's entries, moved into place, and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

import kernels
from drafters.base import DraftTree
from env.model import LoadedModel


class PromptError(ValueError):
    """A prompt that cannot be decoded (empty, or longer than the context); the message is meant for the user."""


def check_prompt(prompt_ids: list[int], max_context: int, what: str = "the prompt") -> None:
    """A ``PromptError`` for a prompt that cannot be decoded: empty, or no room after it in the context."""
    if not prompt_ids:
        raise PromptError(f"{what} is empty")
    if len(prompt_ids) >= max_context:
        raise PromptError(f"{what} has {len(prompt_ids)} tokens; the model's context is {max_context} tokens")


def eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """The ids that end a generation (the generation config's, else the tokenizer's)."""
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


@dataclass
class TargetState:
    """One sequence being decoded by the target. ``tokens`` holds every committed token (prompt included);
    the cache holds all of them but the last."""

    tokens: list[int]
    prompt_len: int
    cache: DynamicCache
    last_hidden: torch.Tensor | None = None  # [H] final-norm hidden state that predicted the root
    last_logits: torch.Tensor | None = (
        None  # [V] target logits that predicted the root (observation features)
    )
    prompt_hidden: torch.Tensor | None = None  # [P, H] final-norm hidden states of the prompt (EAGLE)

    @property
    def past_len(self) -> int:
        return len(self.tokens) - 1


@dataclass(frozen=True)
class TreeOutput:
    logits: torch.Tensor  # [N, V] row i: target logits for the token after node i
    hidden: torch.Tensor  # [N, H] final-norm hidden states of the nodes


class Target:
    """A Hugging Face causal LM seen as a tree verifier. Works for any tree shape, on CPU and CUDA."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.max_context = loaded.max_context
        self.eos_ids: frozenset[int] = eos_ids(loaded)

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, cache: DynamicCache, positions: torch.Tensor, mask) -> torch.Tensor:
        # ids, positions: [1, q]; returns hidden [q, H]
        out = self.model.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        return out.last_hidden_state[0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

    def check_prompt(self, prompt_ids: list[int], what: str = "the prompt") -> None:
        check_prompt(prompt_ids, self.max_context, what)

    def prefill(self, prompt_ids: list[int]) -> tuple[TargetState, torch.Tensor]:
        """Run the prompt; returns the state (root = last prompt token is *in* the cache here, see below) and the
        logits [V] that predict the first new token. The caller picks that token and calls ``append_root``."""
        self.check_prompt(prompt_ids)
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(len(prompt_ids), device=self.device)[None]
        hidden_all = self._forward(ids, cache, pos, None)  # [P, H]
        hidden = hidden_all[-1]
        state = TargetState(
            tokens=list(prompt_ids), prompt_len=len(prompt_ids), cache=cache, last_hidden=hidden
        )
        state.prompt_hidden = hidden_all
        state.last_logits = self.logits(hidden)
        return state, state.last_logits

    @staticmethod
    def append_root(state: TargetState, token: int) -> None:
        """After prefill: the first new token becomes the root (the cache now holds every token but it)."""
        state.tokens.append(int(token))

    def room(self, state: TargetState) -> int:
        """How many tree nodes still fit in the context."""
        return self.max_context - state.past_len

    def forward_tree(self, state: TargetState, tree: DraftTree) -> TreeOutput:
        """One pass over the tree's N nodes; the cache grows by N (``commit`` trims it back)."""
        n, past = tree.num_nodes, state.past_len
        ids = tree.tokens.to(self.device)[None]  # [1, N]
        parents = tree.parents
        is_chain = bool(torch.equal(parents, torch.arange(-1, n - 1)))
        if is_chain:
            pos = torch.arange(past, past + n, device=self.device)[None]
            mask = None  # causal attention over a chain is the tree mask
        else:
            buf = kernels.tree_buffers(parents[None])
            pos = (buf.depth[0] + past).to(self.device)[None]
            allowed = torch.ones(n, past + n, dtype=torch.bool)
            allowed[:, past:] = buf.ancestor_mask[0]
            mask = torch.zeros(1, 1, n, past + n, dtype=self.dtype, device=self.device)
            mask.masked_fill_(~allowed.to(self.device)[None, None], torch.finfo(self.dtype).min)
        hidden = self._forward(ids, state.cache, pos, mask)  # [N, H]
        return TreeOutput(logits=self.logits(hidden), hidden=hidden)

    def commit(self, state: TargetState, tree: DraftTree, path: torch.Tensor, next_token: int) -> list[int]:
        """Keep the accepted path (node indices from the root, root first) in the cache, drop the other tree
        nodes, and make ``next_token`` the new root. Returns the committed tokens (accepted drafts + bonus)."""
        past = state.past_len
        s = int(path.shape[0])
        path_cpu = path.cpu()
        if not torch.equal(path_cpu, torch.arange(s)):
            idx = path_cpu.to(self.device)
            for layer in state.cache.layers:
                kernels.compact_kv_(layer.keys, past, idx)
                kernels.compact_kv_(layer.values, past, idx)
        drop = tree.num_nodes - s
        if drop:
            state.cache.crop(-drop)
        committed = [int(t) for t in tree.tokens[path_cpu[1:]].tolist()] + [int(next_token)]
        state.tokens.extend(committed)
        return committed
