"""The decoder loop: prefill, then speculation steps chosen by a policy over an arm menu, until end of sequence
or ``max_new_tokens``. ``SpeculativeDecoder.generate`` is what people call to generate text faster; the
autoregressive mode (the single arm "none") is our own baseline loop.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any, Protocol, runtime_checkable

from drafters import Drafter, TreeShape, make_drafter
from env.batch import BatchEngine
from env.cost import CostModel, CostModelError, load_cost_model
from env.engine import NO_DRAFT, Arm, Sampling, as_arm
from env.features import FeatureSpec
from env.features import position_horizon as position_horizon_of
from env.model import LoadedModel, ModelError
from env.step import StepCosts, Stepper, truncate
from env.target import PromptError, check_prompt, eos_ids


class ArmChooser(Protocol):
    """What the decoder needs of a policy (policies.Policy satisfies it)."""

    def act(self, obs: Any) -> int: ...


@runtime_checkable
class EpisodicChooser(Protocol):
    """A policy with per-generation state: ``reset`` before each generation."""

    def act(self, obs: Any) -> int: ...

    def reset(self) -> None: ...


@runtime_checkable
class OnlineChooser(Protocol):
    """A policy that learns while it decodes (policies' online bandits): ``update`` after every step with the
    step's reward and ``info`` (as ``SpecDecodeEnv`` gives them, plus ``wall_s``)."""

    def act(self, obs: Any) -> int: ...

    def update(self, obs: Any, action: int, reward: float, info: dict[str, Any]) -> None: ...


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
    stop: str = ""  # why it ended: "eos", "max_new_tokens", or "context" (the model's context is full)


# The longest text prompt tokenized: a context of 128k tokens holds about half as many characters (4 a token), and
# tokenizing a text costs seconds and GBs per 10 MB (a 20 MB prompt file took 46 s and 6.5 GB before its length was
# refused, on a 2-core AMD EPYC family 25 model 17).
MAX_PROMPT_CHARS = 1 << 20


def check_text(text: str) -> None:
    """A ``PromptError`` for a text prompt that cannot be tokenized: empty, not valid text, or past
    ``MAX_PROMPT_CHARS`` (refused before the tokenizer reads it)."""
    if not text or not text.strip():
        raise PromptError("the prompt is empty")
    if len(text) > MAX_PROMPT_CHARS:
        raise PromptError(
            f"the prompt is {len(text):,} characters or more, past the {MAX_PROMPT_CHARS:,} tokenized (no context "
            "this decodes holds it)"
        )
    try:
        text.encode("utf-8")
    except (
        UnicodeEncodeError
    ) as err:  # a lone surrogate: a JSON escape, or bytes a command line could not decode
        raise PromptError(
            f"the prompt is not valid text (character {err.start} is a lone surrogate)"
        ) from None


def raw_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as it is, without the chat template."""
    check_text(text)
    return [int(i) for i in tokenizer(text)["input_ids"]]


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn, through the model's chat template when it has one (a template that
    does not render — a Jinja syntax error, a sandbox refusal, its own ``raise_exception`` — is a ``ModelError``
    naming the tokenizer's folder)."""
    check_text(text)
    if not getattr(tokenizer, "chat_template", None):
        return raw_prompt(tokenizer, text)
    try:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
    except Exception as err:  # noqa: BLE001  (jinja2 fails in many ways: one line)
        from drafters.base import reason

        where = getattr(tokenizer, "name_or_path", None) or "the model"
        raise ModelError(f"the chat template of {where} does not render ({reason(err, kind=True)})") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


class PolicyMismatch(ValueError):
    """A policy trained for another arm menu or observation than the decoder's (one line for the user)."""


def _check_chooser(policy: Any, arms: list[str], features: list[str]) -> None:
    """A policy that says which arms and observation it was trained for (``policies.BasePolicy``'s ``arm_names``
    and ``obs_size``) checked against the decoder's before any work: a mismatch failed at the first step, with a
    message from inside the policy."""
    source = getattr(policy, "source", None) or getattr(policy, "name", None)
    who = f"policy {source}" if source else "the policy"
    names = getattr(policy, "arm_names", None)
    if names is not None:
        try:
            canonical = [as_arm(n).name for n in names]  # ("ar" is "none", "ngram-d4-k1" is "ngram-d4")
        except (ValueError, TypeError):
            canonical = list(names)
        if canonical != arms:
            raise PolicyMismatch(
                f"{who} was trained for arms {list(names)}, but the decoder has {arms}: pass its arms"
            )
    size = getattr(policy, "obs_size", None)
    if isinstance(size, int) and size > 0 and size != len(features):
        raise PolicyMismatch(
            f"{who} expects observations of size {size}, but this decoder gives {len(features)}: "
            "pass features= the FeatureSpec it was trained with (its meta['feature_spec'])"
        )


class SpeculativeDecoder:
    """Greedy or sampled speculative decoding of one target with a menu of arms: a batch of one on the
    batch-native engine (``env.step.Stepper`` over ``env.batch.BatchEngine``, the step the live env, the trace
    recorder and ``serve-bench`` run too).

    With one arm the decoder is static; with a policy it asks ``policy.act(obs)`` for an arm index every step,
    where ``obs`` is the observation ``SpecDecodeEnv`` gives for the same arm menu (``env.features``), so a policy
    trained in the env (with ``arms=list(env.unwrapped.arms)``) plugs in unchanged. ``position_horizon``: the
    ``max_new_tokens`` the observation's ``position`` is a fraction of (``env.features.ObservationBuilder``), the
    env's that the policy was trained in, so that a run of another length shows it the positions it learned
    (``experiments.policy_commands.policy_decoder`` passes the policy's ``meta.max_new_tokens``); None: each
    run's ``max_new_tokens``. ``arms=[NO_DRAFT]`` is the plain autoregressive loop.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        arms: list[Arm] | None = None,
        *,
        policy: ArmChooser | None = None,
        drafter_options: dict[str, dict[str, Any]] | None = None,
        features: FeatureSpec | None = None,
        cost_model: CostModel | None = None,
        position_horizon: int | None = None,
    ) -> None:
        self.position_horizon = position_horizon_of(position_horizon)  # checked before any work
        self.loaded = loaded
        meta = getattr(policy, "meta", None)  # a policy file names the observation it was trained on
        if features is None and isinstance(meta, dict) and isinstance(meta.get("feature_spec"), dict):
            features = FeatureSpec.from_dict(meta["feature_spec"], source="the policy's feature_spec")
        self.feature_spec = features or FeatureSpec()
        self.arms = [as_arm(a) for a in (arms or [default_arm()])]
        self.policy = policy
        self.drafter_options = drafter_options or {}
        if policy is None and len(self.arms) != 1:
            raise ValueError("several arms need a policy to choose between them")
        self.engine = BatchEngine(loaded, max_rows=1)
        _check_chooser(policy, [a.name for a in self.arms], self.feature_names)
        self.eos_ids = eos_ids(loaded)
        # Drafters are built once and kept across calls: trained heads load once, and stateful drafters (Token
        # Recycling's adjacency table) carry what they learned from one prompt to the next, as in their papers.
        names = sorted({a.drafter for a in self.arms if a.drafter is not None})
        self.drafters: dict[str, Drafter] = {
            n: make_drafter(n, **self.drafter_options.get(n, {})) for n in names
        }
        self.costs = _step_costs(self, cost_model) if isinstance(policy, OnlineChooser) else None

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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        tok = self.loaded.tokenizer
        if isinstance(prompt, str):
            prompt_ids = chat_prompt(tok, prompt) if chat else raw_prompt(tok, prompt)
        else:  # checked as given: a float or a bool is refused, not truncated to an id
            try:
                given = list(prompt)
            except TypeError:
                raise PromptError(f"the prompt is a {type(prompt).__name__}, not text or token ids") from None
            check_prompt(given, self.loaded.max_context, vocab_size=self.engine.target.vocab_size)
            prompt_ids = [int(i) for i in given]
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        self.engine.configure(sampling, seed)
        online = self.policy if isinstance(self.policy, OnlineChooser) else None
        features = self.feature_spec if self.policy is not None else None
        stepper = Stepper(
            self.engine, self.arms, features=features, costs=self.costs, horizon=self.position_horizon
        )
        if isinstance(self.policy, EpisodicChooser):
            self.policy.reset()
        arms: list[str] = []
        from env.machine import one_blas_thread

        # a policy's NumPy on one BLAS thread (env.machine.one_blas_thread), set before the clock starts
        with one_blas_thread() if self.policy is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            seq = stepper.start(prompt_ids, max_new_tokens, self.drafters)
            prefill_s = time.perf_counter() - t0
            try:
                while not seq.done:
                    obs = stepper.observe(seq) if self.policy is not None else None
                    idx = self._choose(obs)
                    (res,) = stepper.step([idx])
                    arms.append(self.arms[idx].name)
                    if (
                        online is not None
                    ):  # reward and info as the env gives them, plus the measured wall time
                        online.update(obs, idx, res.reward, {**res.info, "wall_s": res.wall_s})
            finally:
                stepper.retire(seq)
            wall = time.perf_counter() - t0
        out = seq.tokens
        stats = GenerationStats(
            new_tokens=len(out),
            steps=seq.steps,
            tau=len(out) / seq.steps,
            accepted=seq.accepted,
            drafted=seq.drafted,
            tokens_per_s=len(out) / wall if wall > 0 else 0.0,
            wall_s=wall,
            prefill_s=prefill_s,
        )
        text = tok.decode(out, skip_special_tokens=True)
        stop = "eos" if seq.terminated else "max_new_tokens" if len(out) >= max_new_tokens else "context"
        return Generation(text=text, token_ids=out, prompt_ids=prompt_ids, stats=stats, arms=arms, stop=stop)

    @property
    def feature_names(self) -> list[str]:
        return list(Stepper(self.engine, self.arms, features=self.feature_spec).builder.names)

    def _choose(self, obs) -> int:
        if self.policy is None:
            return 0
        from env.arms import arm_index

        try:
            return arm_index(self.policy.act(obs), [a.name for a in self.arms])
        except ValueError as err:
            raise ValueError(f"the policy's choice: {err}") from None


def _step_costs(dec: SpeculativeDecoder, cost_model: CostModel | None) -> StepCosts:
    """Rewards for an online policy as ``SpecDecodeEnv`` defines them: from the decoder's cost model (given, else
    the shipped one when it was calibrated for this model, dtype and weight format), in both cases only when it calibrated every
    drafter of the arm menu; without one, measured wall times (``StepCosts``)."""
    cm = cost_model
    if cm is None:
        try:
            cm = load_cost_model()
            cm.check_model(dec.loaded.model_id, str(dec.loaded.dtype).removeprefix("torch."),
                           str(getattr(dec.loaded, "weights", "dense")))  # fmt: skip
        except CostModelError:
            cm = None
    if cm is not None and not cm.covers(dec.arms):
        cm = None  # a drafter it never calibrated: measured wall time for every step, never a mix
    return StepCosts(cm)


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
    "check_text",
    "raw_prompt",
    "truncate",
]
