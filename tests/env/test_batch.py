"""The batch-native engine and continuous batching: rows of different lengths and arms verified in one forward give
each row exactly what decoding it alone gives (greedy), requests join and leave while others run, and bad load
settings are one-line errors."""

from __future__ import annotations

import pytest
import torch

from drafters import DraftTree
from env.batch import BatchEngine, BatchTarget
from env.engine import parse_arm
from env.model import ModelError
from env.serving import Request, ServeError, check_load, poisson_arrivals, serve
from tests.drafters.tiny import decode, tiny_loaded


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 90, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_one_forward_over_ragged_rows_equals_each_row_alone():
    """Logits of a batched tree forward over rows of different lengths equal a plain Hugging Face forward (no
    cache) over each node's own sequence: the row's prompt, the root and the node's ancestors."""
    loaded = tiny_loaded()
    bt = BatchTarget(loaded, max_rows=3)
    prompts = _prompts(3, seed=1)
    trees = []
    shapes = [[-1], [-1, 0, 1, 2], [-1, 0, 0, 1, 2]]
    for p, par in zip(prompts, shapes):
        pf = bt.begin_prefill(p)
        bt.prefill_chunk(pf)
        row, _ = bt.admit(pf)
        row.tokens.append(7)
        toks = torch.tensor([7] + [11 + i for i in range(len(par) - 1)])
        trees.append(DraftTree(tokens=toks, parents=torch.tensor(par)))
    logits, _, _, _ = bt.forward_trees(trees)
    for i, (p, tree) in enumerate(zip(prompts, trees)):
        for node in range(tree.num_nodes):
            path, u = [], node
            while u >= 0:
                path.append(int(tree.tokens[u]))
                u = int(tree.parents[u])
            with torch.no_grad():
                want = loaded.model(torch.tensor([p + path[::-1]])).logits[0, -1]
            torch.testing.assert_close(logits[i, node], want, atol=2e-5, rtol=0)


def test_a_step_reports_what_each_row_kept_and_where_its_path_stopped():
    """Five rows of one prompt, one tree each, verified in one forward: each row's accepted draft, committed tokens,
    ``rejected`` (the path ends at a node with children: what the serving observation and simulator count) and the
    target's state it keeps for the next step (``last_hidden``, what the model drafters read, and ``last_logits``)
    are those of decoding the row alone, token by token."""
    loaded = tiny_loaded()
    prompt = _prompts(1, seed=3)[0]
    ar = BatchEngine(loaded, max_rows=1)
    row, _ = ar.admit(prompt, {})
    hidden, logits = [row.last_hidden.clone()], [row.last_logits.clone()]
    for _ in range(4):
        ar.step([parse_arm("none")])
        hidden.append(row.last_hidden.clone())
        logits.append(row.last_logits.clone())
    g = row.tokens[len(prompt) :]  # g[0]: the first token, the root of every tree below
    V = row.last_logits.shape[-1]
    y = (g[1] + 1) % V  # a token the target does not pick after the root
    cases = [  # parents, tokens after the root, accepted, rejected
        ([-1], [], 0, False),
        ([-1, 0, 1, 2], [g[1], g[2], g[3]], 3, False),  # a chain accepted to its end
        ([-1, 0, 1], [g[1], (g[2] + 1) % V], 1, True),  # a chain cut short
        # the accepted child is a leaf: its rejected sibling is no rejection
        ([-1, 0, 0], [g[1], y], 1, False),
        ([-1, 0], [y], 0, True),
    ]
    engine = BatchEngine(loaded, max_rows=len(cases))
    rows = [engine.admit(prompt, {})[0] for _ in cases]
    trees = [DraftTree(tokens=torch.tensor([g[0], *t]), parents=torch.tensor(p)) for p, t, _, _ in cases]
    arms = [parse_arm("ngram-d3-k2-b3")] * len(cases)
    results = engine.verify(arms, trees, [0.0] * len(cases))
    for i, ((_, _, accepted, rejected), res, r) in enumerate(zip(cases, results, rows)):
        assert (res.accepted, res.rejected, res.committed) == (accepted, rejected, g[1 : accepted + 2]), i
        torch.testing.assert_close(r.last_hidden, hidden[accepted + 1], atol=2e-5, rtol=0)
        torch.testing.assert_close(r.last_logits, logits[accepted + 1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_continuous_batching_gives_each_request_its_greedy_tokens(concurrency):
    """7 requests, rows joining and leaving, arms mixed per request: every output equals its AR decoding alone."""
    loaded = tiny_loaded()
    arms = ["none", "ngram-d4", "ngram-d4-k2-b6", "recycling-d3-k2-b5", "ngram-d2", "recycling-d2", "none"]
    prompts = _prompts(len(arms), seed=2)
    n = [12, 20, 7, 16, 25, 3, 18]
    reqs = [Request(str(i), p, parse_arm(a), k) for i, (p, a, k) in enumerate(zip(prompts, arms, n))]
    out = serve(BatchEngine(loaded, max_rows=3), reqs, concurrency=concurrency)
    assert [o.rid for o in out] == [r.rid for r in reqs]
    for r, o in zip(reqs, out):
        want, _ = decode(loaded, None, r.prompt_ids, r.max_new_tokens)
        assert o.token_ids == want, (r.arm.name, r.rid)
        assert o.first_token_s <= o.finish_s and o.steps <= len(o.token_ids)
    assert any(o.steps < len(o.token_ids) for o in out)  # drafts were accepted


def test_open_loop_respects_arrivals_and_the_kv_budget():
    loaded = tiny_loaded()
    prompts = _prompts(5, seed=3)
    arrivals = poisson_arrivals(5, rate=200.0, seed=1)
    reqs = [
        Request(str(i), p, parse_arm("ngram-d3"), 10, a) for i, (p, a) in enumerate(zip(prompts, arrivals))
    ]
    budget = max(r.reservation for r in reqs) + 1  # room for one request at a time
    out = serve(BatchEngine(loaded, max_rows=4), reqs, kv_budget=budget)
    for r, o in zip(reqs, out):
        assert o.first_token_s >= r.arrival_s
        assert o.token_ids == decode(loaded, None, r.prompt_ids, 10)[0]
    spans = sorted((o.first_token_s, o.finish_s) for o in out)
    assert all(
        b[0] >= a[1] for a, b in zip(spans, spans[1:])
    )  # one at a time: each waits for the last to leave


def test_bad_load_settings_are_one_line_errors():
    reqs = [Request("a", [1, 2, 3], parse_arm("ngram-d4"), 8)]
    for kwargs, needle in [
        ({"concurrency": 0, "max_batch": 4, "kv_budget": 100}, "concurrency must be >= 1"),
        ({"concurrency": None, "max_batch": 0, "kv_budget": 100}, "max batch must be >= 1"),
        ({"concurrency": 2, "max_batch": 4, "kv_budget": 5}, "too small for one request"),
    ]:
        with pytest.raises(ServeError, match=needle):
            check_load(reqs, **kwargs)
    with pytest.raises(ServeError, match="rate must be > 0"):
        poisson_arrivals(3, 0.0)


def test_other_architectures_are_refused_in_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    from env.model import LoadedModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).eval()
    loaded = LoadedModel(
        model=m, tokenizer=None, model_id="gpt2-tiny", dtype=torch.float32, device=torch.device("cpu")
    )
    with pytest.raises(ModelError, match="'gpt2' model"):
        BatchTarget(loaded, max_rows=2)


@pytest.mark.model
def test_embedded_model_mixed_arms_equal_hf_greedy(fp32_model):
    """The CI sample of the exactness acceptance: 7 built-in prompts at concurrency 4 (requests join as others
    finish), none / n-gram chain / n-gram tree / recycling / eagle / early exit mixed in one batch, fp32, each equal
    to Hugging Face greedy on that prompt alone."""
    from env.decoder import chat_prompt
    from env.workloads import load_workload
    from tests.hf_reference import hf_greedy

    arms = [
        "none",
        "ngram-d4",
        "ngram-d4-k2-b6",
        "recycling-d3-k2-b5",
        "eagle-d3-k2-b6",
        "early_exit-d3",
        "ngram-d2",
    ]
    prompts = load_workload()[: len(arms)]
    reqs = [Request(p.prompt_id, chat_prompt(fp32_model.tokenizer, p.text), parse_arm(a), 24)
            for p, a in zip(prompts, arms)]  # fmt: skip
    out = serve(BatchEngine(fp32_model, max_rows=4), reqs, concurrency=4)
    by_id = {o.rid: o for o in out}
    for r in reqs:
        assert by_id[r.rid].token_ids == hf_greedy(fp32_model, r.prompt_ids, 24), r.arm.name


@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_prefill_gives_each_request_its_greedy_tokens(chunk):
    """Prompts prefilled a few tokens at a time, between steps of the running rows, decode exactly as a whole
    prefill does; the running rows keep stepping while a prompt is prefilled."""
    from env.serving import ServeLog

    loaded = tiny_loaded()
    arms = ["none", "ngram-d4", "recycling-d3-k2-b5", "ngram-d3-k2-b5", "none"]
    prompts = _prompts(len(arms), seed=5)
    reqs = [Request(str(i), p, parse_arm(a), 14) for i, (p, a) in enumerate(zip(prompts, arms))]
    log = ServeLog()
    engine = BatchEngine(loaded, max_rows=2)
    events = []  # ("chunk", prompt, tokens it prefilled) and ("step",), in the order the server ran them
    real_chunk, real_verify = engine.prefill_chunk, engine.verify

    def prefill_chunk(pf, n=None):
        before = pf.done
        finished = real_chunk(pf, n)
        events.append(("chunk", tuple(pf.prompt_ids), pf.done - before))
        return finished

    def verify(*args, **kwargs):
        events.append(("step",))
        return real_verify(*args, **kwargs)

    engine.prefill_chunk, engine.verify = prefill_chunk, verify
    out = serve(engine, reqs, concurrency=2, prefill_chunk=chunk, log=log)
    for r, o in zip(reqs, out):
        assert o.token_ids == decode(loaded, None, r.prompt_ids, 14)[0], (r.arm.name, r.rid)
    chunks = sum(-(-len(p) // chunk) for p in prompts)
    assert log.prefills == len(reqs) and log.steps > 0
    # the steps' time split: drafting (arms that draft ran) and the forward, both within the steps' wall time
    assert log.draft_s > 0 and log.forward_s > 0 and log.draft_s + log.forward_s <= log.step_s
    assert chunks > len(reqs)  # the prompts do take several chunks each
    done = [e for e in events if e[0] == "chunk"]
    assert len(done) == chunks and all(0 < e[2] <= chunk for e in done)  # chunk by chunk, none larger
    for p in prompts:
        assert sum(e[2] for e in done if e[1] == tuple(p)) == len(p)
    # the running rows stepped between two chunks of a prompt
    spans = [[i for i, e in enumerate(events) if e[0] == "chunk" and e[1] == tuple(p)] for p in prompts]
    assert any(("step",) in events[at[0] : at[-1]] for at in spans)
    with pytest.raises(ServeError, match="prefill chunk must be >= 1"):
        serve(BatchEngine(loaded, max_rows=2), reqs, concurrency=2, prefill_chunk=0)


def test_a_drafter_that_cannot_start_leaves_no_row_behind(tmp_path):
    """A row whose drafter fails to start (here: a head file that does not exist) is freed again, so the next
    request, or the next ``generate`` of a batch of one, still finds its slot."""
    from drafters import DrafterError, make_drafter

    loaded = tiny_loaded()
    engine = BatchEngine(loaded, max_rows=1)
    with pytest.raises(DrafterError):
        engine.admit([5, 6, 7], {"eagle": make_drafter("eagle", weights=str(tmp_path / "missing"))})
    assert engine.target.rows == [] and engine.target.cache.lens == [0]
    row, _ = engine.admit([5, 6, 7], {})
    assert row.slot == 0
