"""τ of n-gram and suffix arms on a bench run's own ``ar`` answers, in workload order, without the target
(``drafters.offline.greedy_tau``; for these drafters it equals the engine's τ):

    python -m experiments.offline_tau RUN_DIR Spec-Bench/data/spec_bench/question.jsonl [PER_CATEGORY]

``RUN_DIR/records.jsonl`` is read as it is, without changing it (a bench may still be appending to it): a torn last
line of a killed or running bench, or a line that is not a record, is skipped. The workload must be the one the
bench ran (its ``settings.json``, else ``bench.json``, names it), and its prompts are cut as the bench cut them
(``--per-category``, ``--limit``).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from experiments.errors import UserError

ARMS = ["ngram-d4", "suffix-d4", "ngram-d8", "suffix-d8", "ngram-d12-k4-b24", "suffix-d12-k4-b24"]


def ar_answers(path: Path) -> dict[str, list[int]]:
    """The ``ar`` records' token ids by prompt id, from the complete lines of a bench's ``records.jsonl``."""
    from env.file_checks import not_a_file
    from experiments.records import Record

    if path.exists() and not path.is_file():  # a FIFO was read for ever
        raise UserError(f"{path} {not_a_file(path)}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err} (is it a bench run folder?)") from err
    out = {}
    for line in data.decode("utf-8", errors="replace").split("\n")[:-1]:  # the last piece has no newline yet
        try:
            rec = Record(**json.loads(line))
        except (ValueError, RecursionError, TypeError):
            continue
        if rec.method == "ar":
            out[rec.prompt_id] = rec.token_ids
    return out


PROG = "python -m experiments.offline_tau"


def _bench_settings(path: Path, key: str | None = "settings") -> dict:
    """The ``settings`` of a bench run's ``bench.json`` (``key`` None: the whole object, as of its
    ``settings.json``; {} when there is none or it is not readable)."""
    from env.safe_zip import ArchiveProblem, parse_json

    try:
        if path.is_file() and path.stat().st_size < 1 << 26:
            doc = parse_json(path.read_bytes())
            settings = doc if key is None else doc.get(key)
            return settings if isinstance(settings, dict) else {}
    except (ArchiveProblem, OSError, AttributeError):
        pass
    return {}


def _int_setting(ran: dict, key: str) -> int | None:
    value = ran.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _run_workload(run_dir: Path, ran: dict) -> str | None:
    """The workload a bench run ran, as ``experiments.records.workload_identity`` gives it: its ``settings.json``'s
    (resolved when the bench ran), else its ``bench.json``'s; None when neither says."""
    from experiments.records import workload_identity

    recorded = _bench_settings(run_dir / "settings.json", key=None).get("workload")
    if isinstance(recorded, str):
        return recorded
    recorded = ran.get("workload")
    return workload_identity(recorded) if isinstance(recorded, str) else None


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser
    from experiments.args import positive_int

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a bench run folder (its records.jsonl)")
    p.add_argument("workload", help="the workload the bench ran")
    p.add_argument("per_category", nargs="?", type=positive_int, default=None,
                   help="as bench --per-category (default: what the run's bench.json says the bench ran with)")  # fmt: skip
    args = p.parse_args(argv)

    from drafters import make_drafter
    from drafters.offline import greedy_tau
    from env.decoder import chat_prompt
    from env.engine import parse_arm
    from env.model import load_model, model_spec
    from env.workloads import load_workload
    from experiments.records import workload_identity

    run_dir = Path(args.run_dir)
    ar = ar_answers(run_dir / "records.jsonl")
    ran = _bench_settings(run_dir / "bench.json")  # the prompts and the model the bench ran
    recorded, given = _run_workload(run_dir, ran), workload_identity(args.workload)
    if recorded is not None and recorded != given:  # ids 1, 2, 3... of another workload name other prompts
        raise UserError(
            f"{args.run_dir} is a bench run on workload {recorded}, not {given}: name the one it ran"
        )
    ran_per_category, limit = _int_setting(ran, "per_category"), _int_setting(ran, "prompts")
    per_category = args.per_category if args.per_category is not None else ran_per_category
    prompts = load_workload(args.workload, per_category=per_category)
    if limit is not None and limit >= 1 and per_category == ran_per_category:
        prompts = prompts[:limit]  # a bench run with --limit N ran the first N of them
    missing = [p.prompt_id for p in prompts if p.prompt_id not in ar]
    if missing:
        raise UserError(
            f"{args.run_dir} has no ar answer to {len(missing)} of {len(prompts)} prompts (first: {missing[0]!r}); "
            "run the bench with the ar method on this workload and --per-category"
        )
    model = ran.get("model")  # its tokenizer writes the prompts as the bench did
    loaded = load_model(model_spec(model) if isinstance(model, str) else None, dtype="bf16", device="cpu")
    vocab = int(loaded.config.vocab_size)
    order, cats = [], []
    for p in prompts:
        if any(t >= vocab for t in ar[p.prompt_id]):  # a hand-edited record: no token of the model
            raise UserError(f"{args.run_dir}: the ar answer to prompt {p.prompt_id!r} holds a token id outside "
                            f"the model's vocabulary of {vocab}")  # fmt: skip
        ids = chat_prompt(loaded.tokenizer, p.text)
        order.append((ids + ar[p.prompt_id], len(ids)))
        cats.append(p.category)
    import sys

    from tqdm import tqdm

    rows = []
    configs = [(arm, opts) for arm in ARMS
               for opts in ([{}] if parse_arm(arm).drafter == "ngram" else [{}, {"cache_requests": 0}])]  # fmt: skip
    for arm, opts in tqdm(configs, desc="offline tau", unit="arm", disable=not sys.stderr.isatty()):
        a = parse_arm(arm)
        res = greedy_tau(make_drafter(a.drafter, **opts), a.shape, order)
        by = collections.defaultdict(lambda: [0, 0])
        for c, r in zip(cats, res):
            by[c][0] += r.committed
            by[c][1] += r.steps
        tot = sum(r.committed for r in res) / sum(r.steps for r in res)
        label = arm + (" cache off" if opts else (" cache on" if a.drafter == "suffix" else ""))
        rows.append((label, {c: v[0] / v[1] for c, v in by.items()}, tot))
    cs = list(dict.fromkeys(cats))
    print("| arm | " + " | ".join(cs) + " | overall |")
    print("|---|" + "---:|" * (len(cs) + 1))
    for label, by, tot in rows:
        print(f"| `{label}` | " + " | ".join(f"{by[c]:.2f}" for c in cs) + f" | {tot:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
