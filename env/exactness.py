"""The batch engine's exactness check, as a program: serve a workload with continuous batching, arms given to the
requests in turn (so every batch mixes them), and compare every request's token ids with Hugging Face greedy
``generate`` on that prompt alone. fp32 greedy is the contract (identical ids); other dtypes report agreement.

With ``--weights int8|int4`` the target is its own model: every request must equal that model's own
autoregressive output (our AR loop, one request at a time), and its agreement with the fp32 model (Hugging Face
greedy in fp32) is reported.

    python -m env.exactness --workload Spec-Bench/data/spec_bench/question.jsonl --per-category 5 \\
        --concurrency 8 --arms none,ngram-d4,ngram-d6-k2-b10,recycling-d3-k2-b6,eagle-d3-k2-b6,early_exit-d3
"""

from __future__ import annotations

import time

PROG = "python -m env.exactness"


def main(argv: list[str] | None = None) -> int:
    """0: every request identical to the reference; 1: some differ; 2: bad input (one line)."""
    from env.cli import run_program

    return run_program(PROG, _main, argv)


def _main(argv: list[str] | None) -> int:
    from env.cli import Parser, positive_int

    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="builtin")
    ap.add_argument("--per-category", type=positive_int, default=None)
    ap.add_argument("--concurrency", type=positive_int, default=8)
    ap.add_argument("--arms", default="none,ngram-d4,ngram-d6-k2-b10,recycling-d3-k2-b6,eagle-d3-k2-b6")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--dtype", default="fp32", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--weights", default="dense", choices=["dense", "int8", "int4"])
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from env.batch import BatchEngine
    from env.decoder import chat_prompt
    from env.engine import parse_arm
    from env.model import load_model
    from env.serving import Request, serve
    from env.workloads import load_workload

    prompts = load_workload(args.workload, per_category=args.per_category)
    arms = [parse_arm(a.strip()) for a in args.arms.split(",") if a.strip()]
    if not arms:
        from env.cli import ProgramError

        raise ProgramError("--arms names no arm")
    loaded = load_model(dtype=args.dtype, device="cpu", weights=args.weights)
    reqs = [Request(p.prompt_id, chat_prompt(loaded.tokenizer, p.text), arms[i % len(arms)], args.max_new_tokens)
            for i, p in enumerate(prompts)]  # fmt: skip
    t0 = time.perf_counter()
    bar = tqdm(total=len(reqs), desc="serve", unit="req")
    out = serve(BatchEngine(loaded, max_rows=args.concurrency), reqs, concurrency=args.concurrency,
                on_finish=lambda s: bar.update())  # fmt: skip
    bar.close()
    served_s = time.perf_counter() - t0
    got = {o.rid: o.token_ids for o in out}
    if args.weights != "dense":
        own = {}
        for r in tqdm(reqs, desc=f"{args.weights} AR", unit="req"):
            (o,) = serve(BatchEngine(loaded, max_rows=1), [Request(r.rid, r.prompt_ids, parse_arm("none"),
                                                                   r.max_new_tokens)], concurrency=1)  # fmt: skip
            own[r.rid] = o.token_ids
        same, diffs = _compare(reqs, got, own)
        print(f"{same} of {len(reqs)} requests identical to the {args.weights} model's own AR loop ({loaded.dtype}, "
              f"concurrency {args.concurrency}, arms {args.arms}; served in {served_s:.0f} s)")  # fmt: skip
        for d in diffs:
            print("  differs:", d)
        fp32 = load_model(dtype="fp32", device="cpu")
        ref = {r.rid: _hf_greedy(fp32, r) for r in tqdm(reqs, desc="fp32 hf greedy", unit="req")}
        agree, _ = _compare(reqs, own, ref)
        firsts = sorted(_first_diff(own[r.rid], ref[r.rid]) for r in reqs)
        tokens = sum(min(len(own[r.rid]), len(ref[r.rid])) for r in reqs)
        equal = sum(sum(a == b for a, b in zip(own[r.rid], ref[r.rid])) for r in reqs)
        print(f"agreement with the fp32 model: {agree} of {len(reqs)} answers identical; first divergence at token "
              f"{firsts[len(firsts) // 2]} (median); {equal / max(tokens, 1):.1%} of positions equal")  # fmt: skip
        return 0 if same == len(reqs) else 1
    ref = {r.rid: _hf_greedy(loaded, r) for r in tqdm(reqs, desc="hf greedy", unit="req")}
    same, diffs = _compare(reqs, got, ref)
    print(f"{same} of {len(reqs)} requests identical to Hugging Face greedy ({loaded.dtype}, concurrency "
          f"{args.concurrency}, arms {args.arms}; served in {served_s:.0f} s)")  # fmt: skip
    for d in diffs:
        print("  differs:", d)
    fp32 = str(loaded.dtype) == "torch.float32"  # the contract's dtype, which --dtype auto may have loaded
    return 0 if same == len(reqs) or not fp32 else 1


def _hf_greedy(loaded, r) -> list[int]:
    import torch

    from drafters.hf_greedy import greedy_generate

    ids = torch.tensor([r.prompt_ids])
    with torch.no_grad():
        out = greedy_generate(loaded.model, ids, r.max_new_tokens, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1] :].tolist()


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _compare(reqs, got: dict, ref: dict) -> tuple[int, list[str]]:
    same, diffs = 0, []
    for r in reqs:
        if got[r.rid] == ref[r.rid]:
            same += 1
        else:
            diffs.append(f"{r.rid} ({r.arm.name}) at token {_first_diff(got[r.rid], ref[r.rid])}")
    return same, diffs


if __name__ == "__main__":
    raise SystemExit(main())
