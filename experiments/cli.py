"""The ``draftgym`` command line. Every subcommand has ``--help``; ``--json`` gives machine-readable output.

Errors the user can fix (a bad prompt, path, drafter, depth, config) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_USAGE = 2

# Modules that add subcommands: each defines ``register(subparsers)`` and sets ``func`` on its parsers, which
# return an exit code and raise ``UserError`` (or another error named in ``USER_ERRORS``) for bad input.
COMMAND_MODULES: list[str] = [
    "experiments.agreement",
    "experiments.runner",
    "experiments.sweep",
    "experiments.report",
    "experiments.env_commands",
    "experiments.train_drafter",
    "experiments.policy_commands",
    "experiments.oracle_gap",
]


class UserError(Exception):
    """An error to report in one line, without a traceback."""


# Further exception types whose message is meant for the user (modules append theirs at import).
USER_ERRORS: list[type[Exception]] = []


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + error otherwise)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_USAGE)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="local Hugging Face model folder (default: embedded SmolLM2-135M)"
    )
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 where supported"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")


def _arm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter", default=None, help="ngram or none (autoregressive); default: the project's best"
    )
    p.add_argument("--depth", type=int, default=None, help="draft tree depth (>= 1)")
    p.add_argument("--topk", type=int, default=1, help="branches per node (1: a chain)")
    p.add_argument("--budget", type=int, default=0, help="draft nodes at most (0: depth * topk)")


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(f"prompt file {path} does not exist")
        return path.read_text(encoding="utf-8")
    if args.prompt is None or args.prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("no prompt given: pass it as an argument, with --prompt-file, or on stdin")
        return sys.stdin.read()
    return args.prompt


def _arm_from_args(args: argparse.Namespace):
    from drafters import DRAFTERS, DrafterError, TreeShape
    from env.decoder import default_arm
    from env.engine import NO_DRAFT, Arm

    if args.drafter is None and args.depth is None:
        return default_arm()
    name = args.drafter or default_arm().drafter
    if name == "none":
        return NO_DRAFT
    if name not in DRAFTERS:
        raise DrafterError(
            f"unknown drafter {name!r}; known drafters: {', '.join(sorted([*DRAFTERS, 'none']))}"
        )
    depth = default_arm().shape.depth if args.depth is None else args.depth
    if depth <= 0:
        raise DrafterError(f"--depth must be >= 1, got {depth} (use --drafter none for no draft)")
    return Arm(name, TreeShape(depth=depth, topk=args.topk, budget=args.budget))


def cmd_generate(args: argparse.Namespace) -> int:
    from env.decoder import SpeculativeDecoder
    from env.engine import Sampling
    from env.model import load_model

    text = _read_prompt(args)
    if not text.strip():
        raise UserError("the prompt is empty")
    arm = _arm_from_args(args)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.policy:  # a saved policy picks the arm each step (experiments.policy_commands)
        from experiments.policy_commands import policy_decoder

        dec = policy_decoder(loaded, args.policy)
        arm = None
    else:
        dec = SpeculativeDecoder(loaded, [arm])
    g = dec.generate(
        text, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, chat=not args.raw
    )
    if args.json:
        print(
            json.dumps(
                {
                    "text": g.text,
                    "token_ids": g.token_ids,
                    "arm": arm.name if arm else args.policy,
                    "arms": g.arms,
                    "stats": g.stats.as_dict(),
                }
            )
        )
    else:
        print(g.text)
        s = g.stats
        print(
            f"[{arm.name if arm else args.policy}] {s.new_tokens} tokens in {s.wall_s:.2f} s: {s.tokens_per_s:.2f} tok/s, "
            f"tau {s.tau:.2f}, {s.steps} steps",
            file=sys.stderr,
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import datetime as dt

    from env.model import load_model
    from env.workloads import load_workload
    from experiments.bench import DEFAULT_METHODS, format_table, run_bench

    methods = [m.strip() for m in (args.methods or ",".join(DEFAULT_METHODS)).split(",") if m.strip()]
    if len(set(methods)) != len(methods):
        raise UserError(f"--methods lists a method twice: {methods}")
    prompts = load_workload(args.workload, per_category=args.per_category)
    if args.limit:
        prompts = prompts[: args.limit]
    out = Path(args.out or f"runs/bench-{dt.datetime.now():%Y%m%d-%H%M%S}")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    decoders = {}
    for path in args.policy or []:  # each saved policy is one more method, "policy:<file stem>"
        from experiments.policy_commands import policy_decoder

        decoders[f"policy:{Path(path).stem}"] = policy_decoder(loaded, path)
    methods += [m for m in decoders if m not in methods]
    settings = {
        "model": loaded.model_id,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "workload": args.workload or "builtin",
        "per_category": args.per_category,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "methods": methods,
    }
    result = run_bench(
        loaded,
        prompts,
        methods,
        max_new_tokens=args.max_new_tokens,
        out_dir=out,
        settings=settings,
        progress=not args.json,
        decoders=decoders,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result["summary"]))
        print(f"\nspeedups are ratios of aggregate tokens/s in this run; results in {out}/")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="draftgym", description="Adaptive speculative decoding: decode, benchmark, train, sweep."
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text, or - for stdin")
    g.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _model_args(g)
    _arm_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("--policy", default=None, help="a saved policy file that picks the arm every step")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmark methods side by side against Hugging Face generate")
    b.add_argument("--workload", default=None, help="Spec-Bench JSONL file (default: the built-in set)")
    b.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    b.add_argument("--limit", type=int, default=None, help="first N prompts in all (smoke runs)")
    b.add_argument(
        "--methods", default=None, help="comma list: hf_greedy,hf_pld,ar,ngram-d8,ngram-d12-k4-b24,..."
    )
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--out", default=None, help="run directory (re-use it to resume a killed run)")
    _model_args(b)
    b.add_argument("--json", action="store_true")
    b.add_argument(
        "--policy", action="append", default=None, help="a saved policy file as a method (repeatable)"
    )
    b.set_defaults(func=cmd_bench)

    import importlib

    for name in COMMAND_MODULES:  # each adds its subcommands through register(sub)
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    global_errors = tuple(USER_ERRORS)
    from drafters import DrafterError
    from env.model import ModelError
    from env.target import PromptError
    from env.workloads import WorkloadError

    try:
        return int(args.func(args) or 0)
    except (UserError, DrafterError, ModelError, PromptError, WorkloadError, *global_errors) as err:
        sys.stderr.write(f"draftgym {args.command}: error: {err}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("draftgym: interrupted\n")
        return 130


def entry(argv: list[str] | None = None) -> Any:
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
