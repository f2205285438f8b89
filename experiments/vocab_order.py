"""Put a draft head's vocabulary in frequency order, so that a drafter can keep only its most frequent tokens
(option ``vocab`` of ``eagle``/``eagle3``: a projection of fewer rows per drafted node):

    python -m experiments.vocab_order drafters/data/eagle3-smollm2-135m-instruct.safetensors \\
        --workload Spec-Bench/data/spec_bench/question.jsonl

The counts come from the head's own kind of training data, none of it a benchmark prompt: the target's greedy
answers (weighted 4x, as ``drafters.train_data.draft_vocab`` weighs answers) to every ``--every``-th
self-distillation prompt (``experiments.corpus.instruction_prompts``: no MT-bench prompt, not the first
``--exclude-per-category`` of any other category), those prompts' own tokens, and ``--text-tokens`` tokens of the
standard library's sources. The set of draft tokens does not change, only the order of ``d2t`` (the end-of-sequence
ids first, then by count, ties by lower id); the file is rewritten atomically and its description records the
order's provenance under ``d2t_order``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch


def answer_counts(loaded: Any, prompt_ids: list[list[int]], max_new_tokens: int, rows: int) -> Counter[int]:
    """Token counts of the target's greedy answers to ``prompt_ids`` (batch engine, closed loop at ``rows``)."""
    from env.batch import BatchEngine
    from env.engine import NO_DRAFT
    from env.serving import Request, serve

    reqs = [Request(str(i), ids, NO_DRAFT, max_new_tokens) for i, ids in enumerate(prompt_ids)]
    counts: Counter[int] = Counter()
    for out in serve(BatchEngine(loaded, max_rows=rows), reqs, concurrency=rows):
        counts.update(out.token_ids)
    return counts


def frequency_order(d2t: torch.Tensor, counts: Counter[int], first: tuple[int, ...] = ()) -> torch.Tensor:
    """``d2t``'s ids: those of ``first`` it holds, then the rest by count (descending), ties by lower id."""
    ids = d2t.tolist()
    head = [t for t in dict.fromkeys(first) if t in set(ids)]
    rest = sorted((t for t in ids if t not in set(head)), key=lambda t: (-counts.get(t, 0), t))
    return torch.tensor(head + rest, dtype=d2t.dtype)


def rewrite_head(path: Path, d2t: torch.Tensor, provenance: dict[str, Any]) -> None:
    """Write the head at ``path`` again with ``d2t`` in the new order (the same set of ids), atomically."""
    from safetensors.torch import load_file, save_file

    from env.files import file_digest

    tensors = load_file(str(path))
    if sorted(tensors["d2t"].tolist()) != sorted(d2t.tolist()):
        raise ValueError(f"{path}: the new order is not a permutation of the head's draft vocabulary")
    tensors["d2t"] = d2t.contiguous()
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["d2t_order"] = provenance
    tmp_w, tmp_j = path.with_suffix(".safetensors.tmp"), path.with_suffix(".json.tmp")
    save_file(tensors, str(tmp_w))
    meta["weights_sha256"] = file_digest(
        tmp_w
    )  # the description names the weights it goes with (drafters.heads)
    tmp_j.write_text(json.dumps(meta, indent=2))
    os.replace(tmp_w, path)
    os.replace(tmp_j, meta_path)


PROG = "python -m experiments.vocab_order"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    from drafters import DrafterError
    from drafters.heads import load_head
    from env.cli import Parser, positive_int
    from env.decoder import chat_prompt
    from env.model import load_model
    from env.target import eos_ids
    from experiments import corpus
    from experiments.args import int_at_least

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("head", help="a head's .safetensors (its .json beside it)")
    p.add_argument("--kind", default="eagle3", choices=("eagle", "eagle3"))
    p.add_argument("--workload", default=None, help="Spec-Bench JSONL prompts (default: the built-in set)")
    p.add_argument("--exclude-per-category", type=int_at_least(0), default=5)
    p.add_argument("--code-prompts", type=int_at_least(0), default=400)
    p.add_argument("--every", type=positive_int, default=8, help="answer every N-th instruction prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--text-tokens", type=positive_int, default=200_000)
    p.add_argument("--rows", type=positive_int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = p.parse_args(argv)
    if not Path(args.head).name:  # ("" and "/": no file name to give a suffix)
        raise DrafterError(f"{args.head!r} names no head file (a head is a .safetensors with its .json)")
    path = Path(args.head).with_suffix(".safetensors")
    for part in (path, path.with_suffix(".json")):  # checked before the model loads
        if not part.is_file():
            raise DrafterError(f"{args.head}: no head file {part} (a head is a .safetensors with its .json)")
    texts = corpus.instruction_prompts(args.workload, args.exclude_per_category, args.code_prompts)[
        :: args.every
    ]
    t0 = time.perf_counter()
    loaded = load_model(None, dtype=args.dtype, device="cpu")
    _, tensors, _ = load_head(path, args.kind, loaded.model, loaded.model_id)
    prompt_ids = [chat_prompt(loaded.tokenizer, t) for _, t in texts]
    counts: Counter[int] = Counter()
    answers = answer_counts(loaded, prompt_ids, args.max_new_tokens, args.rows)
    for _ in range(4):
        counts.update(answers)
    for ids in prompt_ids:
        counts.update(ids)
    text = 0
    for _, ids in corpus.text_windows(loaded.tokenizer, args.text_tokens):
        counts.update(ids)
        text += len(ids)
    d2t = frequency_order(tensors["d2t"], counts, tuple(sorted(eos_ids(loaded))))
    provenance = {
        "by": "frequency",
        "answers": {"prompts": len(prompt_ids), "tokens": sum(answers.values()), "weight": 4},
        "prompt_tokens": sum(len(i) for i in prompt_ids),
        "text_tokens": text,
        "excluded": "mt_bench (all), the first --exclude-per-category of every other category",
        "exclude_per_category": args.exclude_per_category,
        "target_dtype": args.dtype,
    }
    rewrite_head(path, d2t, provenance)
    covered = [
        sum(counts.get(t, 0) for t in d2t[:n].tolist()) / max(1, sum(counts.values())) for n in (2048, 4096)
    ]
    print(
        f"{path.name}: d2t in frequency order ({len(prompt_ids)} answers, {sum(answers.values())} answer tokens, "
        f"{text} text tokens; {time.perf_counter() - t0:.0f} s); the first 2048 / 4096 cover "
        f"{covered[0]:.1%} / {covered[1]:.1%} of the counted tokens"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
