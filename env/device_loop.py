"""Greedy speculative decoding whose steps stay on the device: ``DeviceLoop``.

The batch engine (``env.batch``) drives every step from the host: drafters are Python objects, trees are built
from lists, the verdict is read back to commit it. On a GPU that host work, not the arithmetic, sets the speed of
a small model. Here one step is a fixed sequence of tensor operations over persistent buffers on the device:

  draft   prompt lookup (Saxena 2023; the n-gram idea of ``drafters.ngram``): the most recent earlier occurrence
          of the row's last ``ngram`` tokens (falling back to shorter n-grams) proposes the ``depth`` tokens that
          followed it, as a chain; depth 0 is a plain autoregressive step;
  forward ``LeanLlama.device_forward`` over the rows' static KV cache (the chain's nodes written at each row's
          next positions, a per-row mask over a fixed span of positions);
  verify  ``kernels.verify(..., out=VerifyBuffers)``: the Triton kernel on CUDA, the torch reference elsewhere,
          preallocated outputs, the path written by the kernel;
  commit  the accepted prefix of a chain already lies in place in the cache; the committed tokens are scattered
          into the rows' token buffer, lengths advance, end of sequence and the token limit set ``done``.

No step reads a value back to the host and every shape is fixed by the bucket (rows, nodes = depth + 1, span),
so on CUDA a step is captured once per span as a CUDA graph and replayed (``graph=True``). The host looks at the
``done`` flags once every ``check_every`` steps, and picks the span (the positions attention reads, a multiple
of 256) that the next ``check_every`` steps cannot outgrow. Rows that finish keep their slot and stop advancing.

Greedy only; the output equals greedy autoregressive decoding of the same target token for token (fp32; tested
against the batch engine). Llama-family targets with the lean forward (``env.lean``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

import kernels
from drafters.base import DrafterError
from env.lean import LeanLlama
from env.ragged_cache import CHUNK, RaggedCache, Write
from env.step import truncate
from env.target import PromptError, check_prompt

SPAN_STEP = CHUNK  # the span buckets: multiples of this many positions


def parse_device_arm(name: str) -> int:
    """The chain depth of a device-loop arm: ``none`` (0) or ``lookup-dD`` (1 <= D <= 31)."""
    if name == "none":
        return 0
    if name.startswith("lookup-d") and name[len("lookup-d") :].isdigit():
        d = int(name[len("lookup-d") :])
        if 1 <= d <= 31:
            return d
    raise DrafterError(f"unknown device-loop arm {name!r}; valid: none, lookup-dD (D = 1..31)")


@dataclass
class DeviceRun:
    """What ``DeviceLoop.generate`` returns: each prompt's new tokens (cut at end of sequence and the limit),
    the steps taken, and the host checks made."""

    tokens: list[list[int]]
    steps: int
    checks: int
    row_steps: list[int]  # forwards per row until it finished, its prefill included (as the engine counts)

    @property
    def tau(self) -> float:
        """Tokens per row step over all rows (the prefill counts as one step that commits one token)."""
        return sum(len(t) for t in self.tokens) / max(1, sum(self.row_steps))


class DeviceLoop:
    """``rows`` sequences decoded together by a device-resident greedy step (module docstring). ``depth``: the
    lookup chain's draft tokens (0: autoregressive). ``max_context``: the longest prompt plus new tokens any
    generation will ask for (the static cache's size). ``graph``: capture the step as CUDA graphs (CUDA only)."""

    def __init__(
        self,
        net: LeanLlama,
        rows: int,
        depth: int,
        max_context: int,
        eos_ids: Iterable[int],
        *,
        ngram: int = 3,
        check_every: int = 8,
        graph: bool = False,
    ) -> None:
        if rows < 1 or depth < 0 or ngram < 1 or check_every < 1:
            raise ValueError("rows and check_every must be >= 1, depth >= 0, ngram >= 1")
        self.net, self.B, self.depth, self.ngram, self.check_every = net, rows, depth, ngram, check_every
        dev = net.embed.device
        self.device = dev
        q = self.q = depth + 1
        if graph and dev.type != "cuda":
            raise ValueError("graph=True needs the model on CUDA")
        self.graph = graph
        model_ctx = int(net.cfg.get("max_position_embeddings") or max_context)
        if not 0 < max_context <= model_ctx:
            raise ValueError(f"max_context {max_context} is not within the model's context (1..{model_ctx})")
        self.max_context = max_context
        # the largest span: every committed position plus a step's nodes, rounded up to a span bucket
        self.max_span = _round_up(max_context + q * (check_every + 1), SPAN_STEP)
        self.cache = RaggedCache(
            len(net.layers), rows, net.kv_heads, net.head_dim, net.dtype, dev
        )  # fmt: skip
        self.cache.grow(self.max_span)
        self.V = int(net.lm_head.n)  # the logits' width (the embedding may have more or fewer rows)
        hist_len = self.max_span + q
        i64 = dict(dtype=torch.int64, device=dev)
        # state, updated in place by every step
        self.hist = torch.zeros(rows, hist_len, **i64)  # prompt and committed tokens of each row
        self.cur_len = torch.ones(rows, **i64)  # tokens in hist (the last is the root of the next tree)
        self.lens = torch.zeros(rows, **i64)  # positions in the KV cache (every token of hist but the last)
        self.n_out = torch.zeros(rows, **i64)  # new tokens committed (may pass the limit within a step)
        self.max_new = torch.zeros(rows, **i64)
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)
        self.row_steps = torch.zeros(rows, **i64)
        # constants of the bucket
        self.ar_q = torch.arange(q, **i64)
        self.key_pos = torch.arange(self.max_span, **i64)
        self.rows_idx = torch.arange(rows, **i64)[:, None].expand(rows, q).contiguous()
        self.parents = (self.ar_q - 1)[None].expand(rows, q).contiguous()  # a chain: -1, 0, 1, ...
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], **i64)
        self.buf = kernels.VerifyBuffers(rows, q, self.V, dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._warm: dict[int, int] = {}
        self._pool = None

    # ---- host side, between steps ----
    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Start one sequence per row (at most ``rows`` prompts; the other rows stay done): each prompt is
        prefilled into its row's cache, its first new token is the argmax after it."""
        if not 0 < len(prompts) <= self.B:
            raise ValueError(f"{len(prompts)} prompts for a loop of {self.B} rows")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        net, dev = self.net, self.device
        limit = self.max_context
        rows = [list(prompt) for prompt in prompts]
        for r, ids in enumerate(rows):  # every prompt is checked before any row's state changes
            if len(ids) + max_new_tokens > limit:
                raise PromptError(
                    f"prompt {r}: {len(ids)} tokens + {max_new_tokens} new exceed this loop's context ({limit})"
                )
            # empty, not integers, outside the embedding (on CUDA a device assert, not an error)
            check_prompt(ids, limit, f"prompt {r}", vocab_size=int(net.embed.shape[0]))
        self.done.fill_(True)
        self.lens.zero_()
        self.cur_len.fill_(1)
        self.n_out.zero_()
        self.row_steps.zero_()
        self.max_new.fill_(max_new_tokens)
        for r, ids in enumerate(rows):
            p = len(ids)
            t = torch.tensor([ids], dtype=torch.int64, device=dev)
            pos = torch.arange(p, device=dev)[None]
            write = Write(torch.full((1, p), r, device=dev), pos, r, r + 1, p, 0)
            hidden, _ = net.forward(t, pos, self.cache, write, None)
            first = int(net.head(hidden[0, -1]).argmax())
            self.hist[r, :p] = t[0]
            self.hist[r, p] = first
            self.cur_len[r] = p + 1
            self.lens[r] = p
            self.n_out[r] = 1
            self.row_steps[r] = 1
            self.done[r] = first in set(self.eos.tolist()) or max_new_tokens <= 1
        self.cache.lens = [0] * self.B  # unused by the device step (lens live on the device)

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, strict_sync: bool = False
    ) -> DeviceRun:
        """Greedy continuations of ``prompts`` (token ids), ``max_new_tokens`` each at most. ``strict_sync`` (CUDA):
        the steps between two checks run under ``torch.cuda.set_sync_debug_mode("error")``, so a host
        synchronization inside a step raises."""
        self.prefill(prompts, max_new_tokens)
        steps = checks = 0
        strict = strict_sync and self.device.type == "cuda"
        while True:
            checks += 1
            # one read per check: the longest row (the span the next steps cannot outgrow), the most tokens a live
            # row still needs (every step commits at least one: no more steps than that), whether all are done
            left = torch.where(self.done, 0, self.max_new - self.n_out)
            top, need, finished = torch.stack([self.lens.max(), left.max(), self.done.all().long()]).tolist()
            if finished:
                break
            rounds = max(1, min(self.check_every, need))
            span = min(self.max_span, _round_up(top + self.q * rounds + 1, SPAN_STEP))
            prev = torch.cuda.get_sync_debug_mode() if strict else 0
            if strict:
                torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(rounds):
                    self._run_step(span)
                    steps += 1
            finally:
                if strict:
                    torch.cuda.set_sync_debug_mode(prev)
        hist, cur, n_out = self.hist.cpu(), self.cur_len.cpu(), self.n_out.cpu()
        eos = frozenset(self.eos.tolist())
        out = []
        for r, prompt in enumerate(prompts):
            new = hist[r, len(prompt) : int(cur[r])].tolist()
            out.append(truncate(new[: int(n_out[r])], eos, max_new_tokens))
        return DeviceRun(out, steps, checks, self.row_steps[: len(prompts)].tolist())

    @torch.no_grad()
    def capture(self) -> None:
        """Capture the step's CUDA graph of every span a generation can ask for now (a dummy sequence runs the
        warm-up steps), so that no generation pays for it."""
        if not self.graph:
            return
        self.prefill([[0]], 2)
        for span in range(SPAN_STEP, self.max_span + 1, SPAN_STEP):
            while span not in self._graphs:
                self._run_step(span)
        torch.cuda.synchronize()

    def _run_step(self, span: int) -> None:
        if not self.graph:
            self.step(span)
            return
        g = self._graphs.get(span)
        if g is None:
            if self._warm.get(span, 0) < 2:  # warm-up on a side stream (Triton compiles, cuBLAS plans)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.step(span)
                torch.cuda.current_stream().wait_stream(side)
                self._warm[span] = self._warm.get(span, 0) + 1
                return
            g = torch.cuda.CUDAGraph()
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)  # capturing synchronizes the device once (setup, not a step)
            try:
                with torch.cuda.graph(g, pool=self._pool):
                    self.step(span)
            finally:
                torch.cuda.set_sync_debug_mode(prev)
            self._pool = g.pool()  # every span's graph shares one memory pool
            self._graphs[span] = g
        g.replay()

    # ---- the step: tensor operations only ----
    @torch.no_grad()
    def step(self, span: int) -> None:
        """One decoding step of every row over ``span`` key positions (must exceed every row's ``lens`` plus the
        step's nodes). Reads nothing back to the host. Its stages (``draft``, ``forward``, ``verify``, ``commit``)
        are methods of their own, so that ``env.bench_device_step`` can time each."""
        ids = self.draft()
        logits = self.forward(ids, span)
        self.commit(ids, self.verify(ids, logits))

    def draft(self) -> torch.Tensor:
        """[B, q] the step's chain per row: the root (the last committed token), then the lookup's drafts."""
        root = self.hist.gather(1, (self.cur_len - 1)[:, None])  # [B, 1]
        return torch.cat([root, self.lookup()], 1) if self.depth else root

    def forward(self, ids: torch.Tensor, span: int) -> torch.Tensor:
        """[B, q, V] logits of the chain ``ids``, its keys and values written at each row's next positions."""
        lens = self.lens
        pos = lens[:, None] + self.ar_q  # [B, q]: the nodes' positions and cache slots
        rel = self.key_pos[:span][None, :] - lens[:, None]  # [B, span]: node index of each key position
        see = (rel[:, None, :] < 0) | (rel[:, None, :] <= self.ar_q[None, :, None])  # committed, or ancestors
        hidden = self.net.device_forward(ids, pos, self.cache, self.rows_idx, pos, see[:, None])
        return self.net.head(hidden)

    def verify(self, ids: torch.Tensor, logits: torch.Tensor) -> kernels.Verdict:
        """The chain's verdict, written into the loop's preallocated buffers."""
        return kernels.verify(ids, self.parents, logits, out=self.buf)

    def commit(self, ids: torch.Tensor, v: kernels.Verdict) -> None:
        """Commit the accepted drafts (ids[:, 1 .. a]) and the bonus token at index a; advance the live rows."""
        hist, cur, lens = self.hist, self.cur_len, self.lens
        a, nxt = v.accept_len, v.next_token
        shifted = torch.cat([ids[:, 1:], nxt[:, None]], 1)
        committed = torch.where(self.ar_q[None] < a[:, None], shifted, nxt[:, None])  # [B, q], valid up to a
        live = ~self.done
        hist.scatter_(1, cur[:, None] + self.ar_q, committed)  # past a: overwritten by the next step
        eos = ((committed[..., None] == self.eos).any(-1) & (self.ar_q[None] <= a[:, None])).any(-1)
        adv = torch.where(live, a + 1, 0)
        cur.add_(adv)
        lens.add_(adv)
        self.n_out.add_(adv)
        self.row_steps.add_(live.long())
        self.done.logical_or_(live & (eos | (self.n_out >= self.max_new)))

    def lookup(self) -> torch.Tensor:
        """[B, depth] draft tokens per row: what followed the most recent earlier occurrence of the row's last n
        tokens (n = ``ngram`` down to 1, the longest that occurs); the root repeated where none occurs
        (``kernels.prompt_lookup``: one Triton program per row on CUDA)."""
        return kernels.prompt_lookup(self.hist, self.cur_len, self.depth, self.ngram)


def _round_up(x: int, step: int) -> int:
    return -(-x // step) * step
