"""The decoder loop: prefill, then speculation steps chosen by a policy over an arm menu, until end of sequence
or ``max_new_tokens``. ``SpeculativeDecoder.generate`` is what people call to generate text faster; the
autoregressive mode (the single arm "none") is our own baseline loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from drafters import TreeShape
from env.engine import NO_DRAFT, Arm, Engine, Sampling, StepResult
from env.features import FeatureSpec, ObservationBuilder
from env.model import LoadedModel
from env.target import PromptError, Target


class ArmChooser(Protocol):
    """What the decoder needs of a policy (policies.Policy satisfies it)."""

    def act(self, obs: Any) -> int: ...


@dataclass(frozen=True)
class GenerationStats:
    new_tokens: int
    steps: int
    tau: float  # committed tokens / verification steps, bonus included (plain decoding = 1.00)
    accepted: int
    drafted: int
    tokens_per_s: float
    wall_s: float  # start of prefill to last token, model loading excluded
    prefill_s: float

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["acceptance_rate"] = self.acceptance_rate
        return out


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]  # the generated ids only
    prompt_ids: list[int]
    stats: GenerationStats
    arms: list[str] = field(default_factory=list)  # the arm of each step after prefill


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn, through the model's chat template when it has one."""
    if not text or not text.strip():
        raise PromptError("the prompt is empty")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text)["input_ids"]]


class SpeculativeDecoder:
    """Greedy or sampled speculative decoding of one target with a menu of arms.

    With one arm the decoder is static; with a policy it asks ``policy.act(obs)`` for an arm index every step,
    where ``obs`` is the observation ``SpecDecodeEnv`` gives for the same arm menu (``env.features``), so a policy
    trained in the env (with ``arms=list(env.unwrapped.arms)``) plugs in unchanged.
    ``arms=[NO_DRAFT]`` is the plain autoregressive loop.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        arms: list[Arm] | None = None,
        *,
        policy: ArmChooser | None = None,
        drafter_options: dict[str, dict[str, Any]] | None = None,
        features: FeatureSpec | None = None,
        cost_model: Any = None,
    ) -> None:
        self.loaded = loaded
        self.feature_spec = features or FeatureSpec()
        self.cost_model = cost_model  # step rewards for policy.update (None: the shipped one when it fits)
        self.target = Target(loaded)
        self.arms = list(arms or [default_arm()])
        self.policy = policy
        self.drafter_options = drafter_options or {}
        if policy is None and len(self.arms) != 1:
            raise ValueError("several arms need a policy to choose between them")

    def _engine(self, sampling: Sampling, seed: int) -> Engine:
        from drafters import make_drafter

        # Drafters are built once and kept across calls: trained heads load once, and stateful drafters (Token
        # Recycling's adjacency table) carry what they learned from one prompt to the next, as in their papers.
        names = sorted({a.drafter for a in self.arms if a.drafter is not None})
        cache = self.__dict__.setdefault("_drafters", {})
        for n in names:
            if n not in cache:
                cache[n] = make_drafter(n, **self.drafter_options.get(n, {}))
        drafters = {n: cache[n] for n in names}
        return Engine(self.target, drafters, sampling, torch.Generator().manual_seed(seed))

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = 128,
        sampling: Sampling = Sampling(),
        seed: int = 0,
        chat: bool = True,
    ) -> Generation:
        """Generate up to ``max_new_tokens`` after ``prompt`` (text through the chat template, or token ids)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        tok = self.loaded.tokenizer
        if isinstance(prompt, str):
            prompt_ids = chat_prompt(tok, prompt) if chat else [int(i) for i in tok(prompt)["input_ids"]]
        else:
            prompt_ids = [int(i) for i in prompt]
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        engine = self._engine(sampling, seed)
        obs_builder = None
        if self.policy is not None:
            obs_builder = self.observation_builder()  # the env's observation, for policy.act(obs)
            if hasattr(self.policy, "reset"):
                self.policy.reset()
        rewards = StepRewards(self) if hasattr(self.policy, "update") else None
        t0 = time.perf_counter()
        seq, first = engine.start(prompt_ids)
        prefill_s = time.perf_counter() - t0
        out = list(first.committed)
        steps, accepted, drafted, arms = 1, 0, 0, []
        eos = self.target.eos_ids
        while not (out[-1] in eos or len(out) >= max_new_tokens):
            if self.target.room(seq.state) < 1:
                break  # the context is full
            obs = None
            if obs_builder is not None:
                st = seq.state
                proposals = obs_builder.proposals(engine.drafters, seq.ctx)  # for draft features, if any
                obs = obs_builder.observe(
                    st.last_logits, st.last_hidden, st.tokens, len(out), max_new_tokens, proposals
                )
            idx = self._choose(obs)
            arm = self.arms[idx]
            context = seq.state.past_len
            res: StepResult = engine.step(seq, arm)
            steps += 1
            accepted += res.accepted
            drafted += res.drafted
            arms.append(arm.name)
            if obs_builder is not None:  # history features count tokens as the env does (cut at eos / max)
                counted = len(truncate(res.committed, eos, max_new_tokens - len(out)))
                obs_builder.record(idx, min(res.accepted, counted), res.drafted, counted)
            if rewards is not None:  # reward = the step's instantaneous speedup, info as the env gives it
                counted = len(truncate(res.committed, eos, max_new_tokens - len(out)))
                self.policy.update(obs, idx, *rewards(res, context, counted))
            out.extend(res.committed)
            if not eos.isdisjoint(res.committed):
                break  # an end of sequence accepted inside the path ends the generation (truncated below)
        wall = time.perf_counter() - t0
        out = truncate(out, eos, max_new_tokens)
        stats = GenerationStats(
            new_tokens=len(out),
            steps=steps,
            tau=len(out) / steps,
            accepted=accepted,
            drafted=drafted,
            tokens_per_s=len(out) / wall if wall > 0 else 0.0,
            wall_s=wall,
            prefill_s=prefill_s,
        )
        text = tok.decode(out, skip_special_tokens=True)
        return Generation(text=text, token_ids=out, prompt_ids=prompt_ids, stats=stats, arms=arms)

    def observation_builder(self) -> ObservationBuilder:
        """Observations as ``SpecDecodeEnv`` computes them for this arm menu (``env.features``)."""
        depths = [0 if a.drafter is None else a.shape.depth for a in self.arms]
        hidden = int(self.loaded.model.config.hidden_size)
        return ObservationBuilder(self.feature_spec, [a.name for a in self.arms], depths, hidden)

    @property
    def feature_names(self) -> list[str]:
        return list(self.observation_builder().names)

    def _choose(self, obs) -> int:
        if self.policy is None:
            return 0
        idx = int(self.policy.act(obs))
        if not 0 <= idx < len(self.arms):
            raise ValueError(f"policy chose arm {idx}; valid arms are 0..{len(self.arms) - 1}")
        return idx


class StepRewards:
    """Rewards for ``policy.update`` as ``SpecDecodeEnv`` defines them: ``tokens * ar_cost_s / cost_s``, with costs
    from the decoder's cost model (given, else the shipped one when it was calibrated for this model and dtype,
    and in both cases only when it calibrated every drafter of the arm menu). Without a fitting cost model the
    step's measured wall time is the cost and the last measured root-only step (a plain autoregressive step) the
    unit."""

    def __init__(self, dec: SpeculativeDecoder) -> None:
        from env.cost import CostModelError, load_cost_model

        self.cm = dec.cost_model
        if self.cm is None:
            try:
                self.cm = load_cost_model()
                self.cm.check_model(dec.loaded.model_id, str(dec.loaded.dtype).removeprefix("torch."))
            except CostModelError:
                self.cm = None
        if self.cm is not None and not self.cm.covers(dec.arms):
            self.cm = None  # a drafter it never calibrated: measured wall time for every step, never a mix
        self.ar_wall: float | None = None

    def __call__(self, res: StepResult, context: int, tokens: int) -> tuple[float, dict[str, Any]]:
        if self.cm is not None:
            chain = res.parents is None or res.parents.tolist() == list(range(-1, res.parents.shape[0] - 1))
            ar = float(self.cm.ar_cost(context))
            cost = float(self.cm.step_cost(res.arm, res.drafted + 1, context, chain))
        else:
            cost = res.wall_s
            if res.drafted == 0 or self.ar_wall is None:
                self.ar_wall = res.wall_s
            ar = self.ar_wall
        info = {"tokens": tokens, "accepted": min(res.accepted, tokens), "drafted": res.drafted, "cost_s": cost,
                "ar_cost_s": ar, "arm": res.arm.name, "wall_s": res.wall_s}  # fmt: skip
        return (tokens * ar / cost if cost > 0 else 0.0), info


def truncate(tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """Cut at the first end-of-sequence token (kept) and at ``max_new_tokens``."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def default_arm() -> Arm:
    """The best static arm the project knows for the embedded model on 2-core AVX2 CPUs: a short n-gram chain.
    Verifying 8+ nodes costs 2-3x a token there (README, "Results"), so depth 2-3 beats deeper drafts."""
    return Arm("ngram", TreeShape(depth=3, topk=1))


__all__ = [
    "NO_DRAFT",
    "Arm",
    "Generation",
    "GenerationStats",
    "Sampling",
    "SpeculativeDecoder",
    "chat_prompt",
]
