"""``draftgym agreement RUN_DIR``: how often each method's tokens equal Hugging Face greedy's in a bench run, and,
for every divergence, the gap between the target's top-2 logits at the first differing position.

In fp32 greedy speculative decoding must agree token for token. In bf16 a batched (tree) forward and a
single-token forward round differently, so a near-tie can flip: a divergence is explained when the two tokens are
the target's top two there and their logit gap is below ``--eps``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from experiments.errors import UserError
from experiments.records import load_done


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(model, prompt_ids: list[int], prefix: list[int]) -> tuple[float, list[int]]:
    """Logit gap top1 - top2 (and the two token ids) for the token after prompt + prefix, one full forward."""
    ids = torch.tensor([prompt_ids + prefix], device=model.device)
    with torch.no_grad():
        logits = model(ids, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), [int(t) for t in top.indices]


def agreement(run_dir: Path, eps: float) -> dict:
    from env.decoder import chat_prompt
    from env.model import load_model, model_spec
    from env.workloads import load_workload

    try:
        s = json.loads((run_dir / "bench.json").read_text(encoding="utf-8"))["settings"]
        for key in ("model", "dtype", "workload"):
            if not isinstance(s[key], str):
                raise TypeError(f"settings.{key} is not a string")
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as err:
        raise UserError(f"{run_dir / 'bench.json'} is not a bench result ({err})") from None
    rec_file = run_dir / "records.jsonl"
    if not rec_file.is_file():  # (a missing one read as no records, a FIFO blocked)
        from env.file_checks import not_a_file

        raise UserError(f"{rec_file} {not_a_file(rec_file)}: the bench run's records are read from it")
    records = load_done(rec_file, repair=False, strict=True)  # not one silently left out
    ref = {r.prompt_id: r for r in records if r.method == "hf_greedy"}
    if not ref:
        raise UserError(f"{run_dir} has no hf_greedy records to compare with")
    # the prompts the bench ran: a code: workload's depend on --per-category (every k-th function of the source)
    per_category = s.get("per_category")
    if isinstance(per_category, bool) or not isinstance(per_category, int):
        per_category = None
    texts = {  # the workload before the model: a record of a prompt it does not hold fails in one line, early
        p.prompt_id: p.text
        for p in load_workload(
            None if s["workload"] == "builtin" else s["workload"], per_category=per_category
        )
    }
    strangers = sorted({r.prompt_id for r in records} - set(texts))
    if strangers:
        raise UserError(
            f"{run_dir}: its records name prompts its workload {s['workload']} does not hold ({strangers[:3]})"
        )
    loaded = load_model(
        model_spec(s["model"]),
        dtype=s["dtype"].replace("bfloat16", "bf16").replace("float32", "fp32"),
    )
    vocab = int(loaded.model.config.vocab_size)
    if any(t >= vocab for r in records for t in r.token_ids):
        raise UserError(f"{run_dir}: its records hold token ids outside the model's vocabulary of {vocab}")
    rows: dict[str, dict] = {}
    gaps: dict[tuple[str, int], tuple[float, list[int]]] = {}  # methods often diverge at the same near-tie
    import sys

    from tqdm import tqdm

    for r in tqdm(records, desc="agreement", unit="record", disable=not sys.stderr.isatty()):
        if r.method in ("hf_greedy",) or r.prompt_id not in ref:
            continue
        row = rows.setdefault(r.method, {"method": r.method, "prompts": 0, "identical": 0, "divergences": []})
        row["prompts"] += 1
        base = ref[r.prompt_id].token_ids
        i = first_divergence(r.token_ids, base)
        if i is None:
            row["identical"] += 1
            continue
        if i >= min(len(r.token_ids), len(base)):
            row["divergences"].append(
                {"prompt_id": r.prompt_id, "position": i, "gap": None, "near_tie": False}
            )
            continue
        if (r.prompt_id, i) not in gaps:
            prompt_ids = chat_prompt(loaded.tokenizer, texts[r.prompt_id])
            gaps[r.prompt_id, i] = top2_gap(loaded.model, prompt_ids, base[:i])
        gap, top = gaps[r.prompt_id, i]
        pair = sorted([r.token_ids[i], base[i]]) == sorted(top)
        row["divergences"].append(
            {
                "prompt_id": r.prompt_id,
                "position": i,
                "gap": gap,
                "top2_pair": pair,
                "near_tie": pair and gap < eps,
            }
        )
    return {"run": str(run_dir), "dtype": s["dtype"], "eps": eps, "rows": list(rows.values())}


def cmd_agreement(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "bench.json").is_file():
        raise UserError(f"{run_dir} is not a finished bench run (no bench.json)")
    out = agreement(run_dir, args.eps)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"agreement with hf_greedy, {out['dtype']}, near-tie: top-2 logit gap < {out['eps']}")
    print(f"{'method':<22}{'identical':>12}{'divergent':>11}{'near-tie':>10}{'max gap':>9}")
    for row in out["rows"]:
        divs = row["divergences"]
        ties = sum(d["near_tie"] for d in divs)
        gaps = [d["gap"] for d in divs if d["gap"] is not None]
        mx = f"{max(gaps):.3f}" if gaps else "-"
        print(f"{row['method']:<22}{row['identical']:>6}/{row['prompts']:<5}{len(divs):>11}{ties:>10}{mx:>9}")
    return 0


def register(sub) -> None:
    from experiments.args import float_in, path_arg

    p = sub.add_parser("agreement", help="token agreement of a bench run with HF greedy; near-tie analysis")
    p.add_argument("run_dir", type=path_arg, help="a directory written by draftgym bench")
    p.add_argument(
        "--eps",
        type=float_in(0.0, 1e9),
        default=0.25,
        help="a divergence with top-2 logit gap below this is a near-tie",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_agreement)
