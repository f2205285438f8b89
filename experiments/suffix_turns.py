"""The suffix drafter's cross-request cache on a workload that repeats requests of one family: MT-bench's two
turns. Every question's first turn is answered (greedy, the batch engine, closed loop), then its second turn in the
same conversation (user, assistant's first answer, user); the drafters are then scored on these exact greedy
outputs in serving order -- all first turns, then all second turns -- with ``drafters.offline.greedy_tau`` (for
drafters that read only the committed tokens it is the engine's τ, tested so): n-gram, suffix with the cache off,
suffix with the cache on.

    python -m experiments.suffix_turns --workload Spec-Bench/data/spec_bench/question.jsonl --out runs/turns

Answers are cached in ``OUT/answers.json`` as they finish, with the settings they depend on (model, dtype, weight
format, device, new tokens) and a digest of each answer's prompt: a rerun after a kill generates only the missing
ones, a rerun with other settings is refused in one line, and an answer whose prompt changed is generated again.
The table goes to stdout and ``OUT/turns.json`` (with provenance).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any


def _turns(path: str) -> list[tuple[str, str, str]]:
    """(question id, turn 1, turn 2) of the MT-bench questions of a Spec-Bench file (checked as
    ``env.workloads.load_workload`` checks a question line: a category name, turns a list of non-empty strings, ids
    unique)."""
    from drafters.base import reason
    from env.file_checks import not_a_file
    from env.workloads import MT_BENCH, WorkloadError

    out, seen = [], {}
    if not Path(path).is_file():  # a FIFO was read for ever
        raise WorkloadError(f"workload file {path} {not_a_file(Path(path))}")
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as err:
        raise WorkloadError(f"cannot read workload {path}: {err}") from err
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"a JSON {type(row).__name__}, not an object")
            cat, turns, qid = row["category"], row["turns"], row.get("question_id", n)
            if not isinstance(cat, str) or not cat.strip():
                raise TypeError("its category is not a name")
            if (
                not isinstance(turns, list)
                or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)
            ):
                raise TypeError("its turns are not a list of non-empty strings")
            if isinstance(qid, bool) or not isinstance(qid, (int, str)):
                raise TypeError("its question_id is neither a number nor a string")
            for t in turns:
                t.encode("utf-8")  # a lone surrogate escape is no text to tokenize
        except (ValueError, RecursionError, KeyError, TypeError) as err:  # UnicodeEncodeError is a ValueError
            raise WorkloadError(f"{path}:{n}: not a Spec-Bench question line ({reason(err)})") from None
        qid = str(qid)
        if qid in seen:  # answers are kept by question id: a second question under it would be lost
            raise WorkloadError(f"{path}:{n}: question_id {qid} already used on line {seen[qid]}")
        seen[qid] = n
        if cat in MT_BENCH and len(turns) >= 2:
            out.append((qid, turns[0], turns[1]))
    if not out:
        raise WorkloadError(f"{path} has no two-turn MT-bench questions")
    return out


def prompt_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


class AnswerCache:
    """``OUT/answers.json``: ``{"settings": ..., "answers": {key: {"prompt": digest, "ids": [...]}}}``, written
    atomically each time an answer finishes (a kill keeps every finished answer). An answer holding an id outside
    the target's vocabulary of ``vocab`` tokens, or longer than the ``most`` new tokens answers are given (a
    hand-edited file), is no answer: it is generated again."""

    def __init__(self, path: Path, settings: dict[str, Any], vocab: int, most: int) -> None:
        from drafters.base import shown
        from experiments.errors import UserError

        self.path, self.settings = path, settings
        self.answers: dict[str, dict[str, Any]] = {}
        if not path.is_file():
            return
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:
            raise UserError(f"{path} is not readable JSON ({err}); delete it or use another --out") from err
        if not isinstance(doc, dict) or not isinstance(doc.get("settings"), dict):
            raise UserError(
                f"{path} holds answers without the settings they were made with (an earlier version): delete it "
                "or use another --out"
            )
        before, answers = doc["settings"], doc.get("answers")
        keys = sorted(k for k in {*before, *settings} if before.get(k) != settings.get(k))
        if keys and answers:
            diff = "; ".join(f"{k}: {shown(before.get(k))} there, {shown(settings.get(k))} now" for k in keys)
            raise UserError(f"{path} holds answers made with other settings ({diff}): use another --out, or the same "
                            "settings to resume")  # fmt: skip
        for key, a in (answers if isinstance(answers, dict) and not keys else {}).items():
            ok = isinstance(a, dict) and isinstance(a.get("prompt"), str) and isinstance(a.get("ids"), list)
            if (
                ok
                and len(a["ids"]) <= most
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in a["ids"])
            ):
                self.answers[key] = a  # anything else is answered again

    def get(self, key: str, prompt: list[int]) -> list[int] | None:
        """The cached answer to ``prompt`` under ``key`` (None when there is none, or it answered another prompt)."""
        a = self.answers.get(key)
        return a["ids"] if a is not None and a["prompt"] == prompt_digest(prompt) else None

    def put(self, key: str, prompt: list[int], ids: list[int]) -> None:
        from env.files import atomic_write_text

        self.answers[key] = {"prompt": prompt_digest(prompt), "ids": [int(t) for t in ids]}
        atomic_write_text(self.path, json.dumps({"settings": self.settings, "answers": self.answers}))


def _answer(
    loaded, prompts: dict[str, list[int]], max_new: int, batch: int, cache: AnswerCache, desc: str
) -> None:
    """Answer the ``prompts`` not in ``cache`` (greedy, the batch engine), each saved there as it finishes."""
    from tqdm import tqdm

    from env.batch import BatchEngine
    from env.engine import NO_DRAFT
    from env.serving import Request, serve

    todo = {k: v for k, v in prompts.items() if cache.get(k, v) is None}
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc=desc, unit="answer")
    if todo:

        def finished(s) -> None:
            cache.put(s.rid, todo[s.rid], list(s.token_ids))
            bar.update(1)

        reqs = [Request(rid, ids, NO_DRAFT, max_new) for rid, ids in todo.items()]
        serve(BatchEngine(loaded, max_rows=batch), reqs, concurrency=batch, on_finish=finished)
    bar.close()


PROG = "python -m experiments.suffix_turns"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser
    from experiments.args import new_tokens, positive_int

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, help="Spec-Bench question.jsonl (its MT-bench questions)")
    p.add_argument("--questions", type=positive_int, default=80, help="first N two-turn questions")
    p.add_argument("--max-new-tokens", type=new_tokens, default=128)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["auto", "bf16", "fp32"])
    p.add_argument("--weights", default="dense", help="weight format of the target (dense, int8, int4, auto)")
    p.add_argument("--arms", default="ngram-d8,suffix-d8,ngram-d12-k4-b24,suffix-d12-k4-b24")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    from drafters import make_drafter
    from drafters.offline import greedy_tau
    from env.decoder import chat_prompt
    from env.engine import parse_arm
    from env.files import atomic_write_text
    from env.machine import cpu_label
    from env.model import load_model
    from experiments.args import output_dir, run_folder_outputs
    from experiments.errors import UserError
    from experiments.provenance import library_versions, machine
    from experiments.records import run_identity

    arms = [parse_arm(a.strip()) for a in args.arms.split(",") if a.strip()]
    if not arms or any(a.drafter not in ("ngram", "suffix") for a in arms):
        raise UserError("--arms takes n-gram and suffix arms (drafters scored offline)")
    names = [a.name for a in arms]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # (each was scored and printed twice)
        raise UserError(f"--arms lists {', '.join(twice)} more than once")
    turns = _turns(args.workload)[: args.questions]
    out = output_dir(args.out, exclusive=True)
    run_folder_outputs(out, ("answers.json", "turns.json"))  # (turns.json a folder failed after every answer)
    loaded = load_model(None, dtype=args.dtype, device="cpu", weights=args.weights)
    tok = loaded.tokenizer
    ident = run_identity(loaded, args.max_new_tokens)  # model, dtype, device, weights, forward, new tokens
    settings = {k: v for k, v in ident.items() if k != "drafter_options"}
    cache = AnswerCache(out / "answers.json", settings, int(loaded.config.vocab_size), args.max_new_tokens)
    t0 = time.time()
    first = {f"{q}/1": chat_prompt(tok, t1) for q, t1, _ in turns}
    _answer(loaded, first, args.max_new_tokens, args.batch, cache, "turn 1")
    answers = {k: cache.get(k, v) for k, v in first.items()}
    second = {}
    for q, t1, t2 in turns:
        a1 = tok.decode(answers[f"{q}/1"], skip_special_tokens=True)
        msgs = [
            {"role": "user", "content": t1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": t2},
        ]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        second[f"{q}/2"] = [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    _answer(loaded, second, args.max_new_tokens, args.batch, cache, "turn 2")
    answers.update({k: cache.get(k, v) for k, v in second.items()})
    gen_s = time.time() - t0
    order = [(first[k] + answers[k], len(first[k])) for k in first] + [
        (second[k] + answers[k], len(second[k])) for k in second
    ]
    n1 = len(first)
    rows = []
    for arm in arms:
        for cache_on in (False, True) if arm.drafter == "suffix" else (None,):
            opts = {} if cache_on is None else {"cache_requests": 256 if cache_on else 0}
            res = greedy_tau(make_drafter(arm.drafter, **opts), arm.shape, order)

            def tau(rs):
                return round(sum(r.committed for r in rs) / max(1, sum(r.steps for r in rs)), 3)

            rows.append(
                {
                    "arm": arm.name,
                    "cache": {None: "-", False: "off", True: "on"}[cache_on],
                    "tau_turn1": tau(res[:n1]),
                    "tau_turn2": tau(res[n1:]),
                    "tau_all": tau(res),
                }
            )
    print(f"MT-bench, {n1} questions, two turns, {args.max_new_tokens} new tokens; target {loaded.model_id} "
          f"{args.dtype}/{args.weights}; CPU {cpu_label()}")  # fmt: skip
    print("| arm | cross-request cache | τ turn 1 | τ turn 2 | τ all |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| `{r['arm']}` | {r['cache']} | {r['tau_turn1']:.2f} | {r['tau_turn2']:.2f} | {r['tau_all']:.2f} |"
        )
    doc = {
        "rows": rows,
        "questions": n1,
        "max_new_tokens": args.max_new_tokens,
        "generation_s": round(gen_s, 1),
        "provenance": {
            "command": "python -m experiments.suffix_turns " + " ".join(sys.argv[1:]),
            "machine": machine(),
            "libraries": library_versions(),
            "target": {"model_id": loaded.model_id, "dtype": args.dtype, "weights": args.weights},
        },
    }
    atomic_write_text(out / "turns.json", json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
