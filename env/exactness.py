"""The batch engine's exactness check, as a program: serve a workload with continuous batching, arms given to the
requests in turn (so every batch mixes them), and compare every request's token ids with Hugging Face greedy
``generate`` on that prompt alone. fp32 greedy is the contract (identical ids); other dtypes report agreement.

    python -m env.exactness --workload Spec-Bench/data/spec_bench/question.jsonl --per-category 5 \\
        --concurrency 8 --arms none,ngram-d4,ngram-d6-k2-b10,recycling-d3-k2-b6,eagle-d3-k2-b6,early_exit-d3
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m env.exactness", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)  # fmt: skip
    ap.add_argument("--workload", default="builtin")
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--arms", default="none,ngram-d4,ngram-d6-k2-b10,recycling-d3-k2-b6,eagle-d3-k2-b6")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32", choices=["auto", "bf16", "fp32"])
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm

    from env.batch import BatchEngine
    from env.decoder import chat_prompt
    from env.engine import parse_arm
    from env.model import load_model
    from env.serving import Request, serve
    from env.workloads import load_workload

    loaded = load_model(dtype=args.dtype, device="cpu")
    prompts = load_workload(args.workload, per_category=args.per_category)
    arms = [parse_arm(a) for a in args.arms.split(",")]
    reqs = [Request(p.prompt_id, chat_prompt(loaded.tokenizer, p.text), arms[i % len(arms)], args.max_new_tokens)
            for i, p in enumerate(prompts)]  # fmt: skip
    t0 = time.perf_counter()
    bar = tqdm(total=len(reqs), desc="serve", unit="req")
    out = serve(BatchEngine(loaded, max_rows=args.concurrency), reqs, concurrency=args.concurrency,
                on_finish=lambda s: bar.update())  # fmt: skip
    bar.close()
    served_s = time.perf_counter() - t0
    got = {o.rid: o.token_ids for o in out}
    same, first_diff = 0, []
    for r in tqdm(reqs, desc="hf greedy", unit="req"):
        ids = torch.tensor([r.prompt_ids])
        with torch.no_grad():
            ref = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens,
                                        do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()  # fmt: skip
        if got[r.rid] == ref:
            same += 1
        else:
            k = next(
                (i for i, (a, b) in enumerate(zip(got[r.rid], ref)) if a != b), min(len(ref), len(got[r.rid]))
            )
            first_diff.append(f"{r.rid} ({r.arm.name}) at token {k}")
    print(f"{same} of {len(reqs)} requests identical to Hugging Face greedy ({loaded.dtype}, concurrency "
          f"{args.concurrency}, arms {args.arms}; served in {served_s:.0f} s)")  # fmt: skip
    for d in first_diff:
        print("  differs:", d)
    return 0 if same == len(reqs) or args.dtype != "fp32" else 1


if __name__ == "__main__":
    sys.exit(main())
