"""``draftgym generate``: one prompt, decoded with one arm (or a saved policy choosing the arm every step)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from experiments.args import arm_args, model_args, new_tokens, sampling_args
from experiments.errors import UserError


def read_text_file(path: str | Path, what: str) -> str:
    """A UTF-8 text file's content; every problem (missing, a directory, unreadable, not UTF-8) a ``UserError``."""
    path = Path(path)
    try:
        if path.is_dir():
            raise UserError(f"{what} {path} is a directory, not a file")
        if not path.is_file():  # (a FIFO or a device said "does not exist")
            from env.file_checks import not_a_file

            raise UserError(f"{what} {path} {not_a_file(path)}")
        from env.decoder import MAX_PROMPT_CHARS

        with path.open(
            encoding="utf-8"
        ) as fh:  # (one character past the bound: refused by its length, unread)
            return fh.read(MAX_PROMPT_CHARS + 1)
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {err.start})") from err
    except OSError as err:  # e.g. a name too long, no permission
        raise UserError(f"cannot read {what} {str(path)[:120]}: {err.strerror or err}") from err


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        if args.prompt not in (None, "-"):
            raise UserError("give the prompt either as an argument or with --prompt-file, not both")
        return read_text_file(args.prompt_file, "prompt file")
    if args.prompt is None or args.prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("no prompt given: pass it as an argument, with --prompt-file, or on stdin")
        from env.decoder import MAX_PROMPT_CHARS

        try:
            return sys.stdin.read(MAX_PROMPT_CHARS + 1)  # (past the bound: refused by its length, unread)
        except UnicodeDecodeError as err:
            raise UserError(f"the prompt on stdin is not UTF-8 text (byte {err.start})") from err
    return args.prompt


def arm_from_args(args: argparse.Namespace) -> Any:
    from drafters import DRAFTERS, DrafterError, TreeShape
    from env.decoder import default_arm
    from env.engine import NO_DRAFT, Arm

    if args.drafter is None and args.depth is None and args.topk == 1 and args.budget == 0:
        return default_arm()  # (--topk or --budget alone shape the default drafter's tree)
    name = args.drafter or default_arm().drafter
    if name == "none":
        shaped = [f for f, v, d in (("--depth", args.depth, None), ("--topk", args.topk, 1),
                                    ("--budget", args.budget, 0)) if v != d]  # fmt: skip
        if shaped:
            raise DrafterError(
                f"--drafter none drafts nothing: {', '.join(shaped)} would be ignored; drop it"
            )
        return NO_DRAFT
    if name not in DRAFTERS:
        raise DrafterError(
            f"unknown drafter {name!r}; known drafters: {', '.join(sorted([*DRAFTERS, 'none']))}"
        )
    depth = default_arm().shape.depth if args.depth is None else args.depth
    return Arm(
        name, TreeShape(depth=depth, topk=args.topk, budget=args.budget).arm_shape("--depth/--topk/--budget")
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from env.decoder import SpeculativeDecoder
    from env.engine import Sampling
    from env.model import load_model

    text = read_prompt(args)
    if not text.strip():
        raise UserError("the prompt is empty")
    if args.policy:
        given = [f for f, v in (("--drafter", args.drafter), ("--depth", args.depth)) if v is not None]
        given += [f for f, v, d in (("--topk", args.topk, 1), ("--budget", args.budget, 0)) if v != d]
        if given:
            raise UserError(f"{', '.join(given)} and --policy: the policy picks the arm every step (its arms are "
                            "in its file); drop one")  # fmt: skip
    arm = None if args.policy else arm_from_args(args)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    policy = None
    if args.policy:  # a bad policy file fails before the model loads
        from policies import load_policy

        policy = load_policy(args.policy)
    loaded = load_model(
        args.model, dtype=args.dtype, device=args.device, weights=args.weights, forward=args.forward
    )
    if args.policy:  # a saved policy picks the arm each step (experiments.policy_commands)
        from experiments.policy_commands import policy_decoder

        dec = policy_decoder(loaded, policy)
    else:
        dec = SpeculativeDecoder(loaded, [arm])
    g = dec.generate(
        text, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, chat=not args.raw
    )
    label = arm.name if arm else args.policy
    if args.json:
        print(
            json.dumps(
                {
                    "text": g.text,
                    "token_ids": g.token_ids,
                    "arm": label,
                    "arms": g.arms,
                    "weights": loaded.weights,
                    "stats": g.stats.as_dict(),
                    "stop": g.stop,
                }
            )
        )
    else:
        print(g.text)
        s = g.stats
        print(
            f"[{label}] {s.new_tokens} tokens in {s.wall_s:.2f} s: {s.tokens_per_s:.2f} tok/s, "
            f"tau {s.tau:.2f}, {s.steps} steps"
            + (
                f"; stopped: the context is full ({loaded.max_context} tokens)" if g.stop == "context" else ""
            ),
            file=sys.stderr,
        )
    return 0


def register(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text, or - for stdin")
    g.add_argument("--prompt-file", default=None, help="read the prompt from a file (UTF-8)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    model_args(g)
    arm_args(g)
    g.add_argument("--max-new-tokens", type=new_tokens, default=128)
    sampling_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats, stop")
    g.add_argument("--policy", default=None, help="a saved policy file that picks the arm every step")
    g.set_defaults(func=cmd_generate)
