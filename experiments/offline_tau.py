"""τ of n-gram and suffix arms on a bench run's own ``ar`` answers, in workload order, without the target
(``drafters.offline.greedy_tau``; for these drafters it equals the engine's τ):

    python -m experiments.offline_tau RUN_DIR Spec-Bench/data/spec_bench/question.jsonl [PER_CATEGORY]
"""

import collections
import json
import sys

from drafters import make_drafter
from drafters.offline import greedy_tau
from env.decoder import chat_prompt
from env.engine import parse_arm
from env.model import load_model
from env.workloads import load_workload


def main() -> None:
    with open(sys.argv[1] + "/records.jsonl", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh]
    ar = {r["prompt_id"]: r for r in recs if r["method"] == "ar"}
    loaded = load_model(None, dtype="bf16", device="cpu")
    prompts = load_workload(sys.argv[2], per_category=int(sys.argv[3]) if len(sys.argv) > 3 else 5)
    order, cats = [], []
    for p in prompts:
        ids = chat_prompt(loaded.tokenizer, p.text)
        order.append((ids + ar[p.prompt_id]["token_ids"], len(ids)))
        cats.append(p.category)
    rows = []
    for arm in ["ngram-d4", "suffix-d4", "ngram-d8", "suffix-d8", "ngram-d12-k4-b24", "suffix-d12-k4-b24"]:
        a = parse_arm(arm)
        for opts in [{}] if a.drafter == "ngram" else [{}, {"cache_requests": 0}]:
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


if __name__ == "__main__":
    main()
