"""Triton kernels against the torch reference on irregular shapes (N not a power of two, padded trees, V in
{1000, 4099}, duplicate sibling tokens), all three verification modes, same coins: integers equal, floats within
1e-6. Runs on CUDA when present; on CPU, `test_parity_under_interpreter` reruns this file in a subprocess with
TRITON_INTERPRET=1 (the variable must be set before triton is imported, and the interpreter is slow)."""

import pytest
import torch
from kernel_cases import (
    CUDA,
    DEVICE,
    TRITON_MODE,
    needs_triton,
    random_trees,
    rerun_here,
    rerun_under_interpreter,
)

from kernels import (
    VerifyBuffers,
    compact_kv_,
    compact_kv_reference,
    tree_buffers,
    tree_buffers_reference,
    triton_enabled,
    verify,
    verify_reference,
)


@rerun_here
def test_parity_under_interpreter() -> None:
    out = rerun_under_interpreter(__file__)
    assert f"{len(VERIFY_CASES) + 13} passed" in out, out[-2000:]


def make_case(seed: int, B: int, N: int, V: int, stochastic: bool):
    """Random padded trees whose tokens are often the parent row's top tokens (so paths get long), with
    duplicate sibling tokens; draft_probs close to the target when stochastic."""
    gen = torch.Generator().manual_seed(seed)
    parents, num_nodes = random_trees(gen, B, N, branch=0.5)
    logits = torch.randn(B, N, V, generator=gen) * 3
    valid = torch.arange(N)[None] < num_nodes[:, None]
    par = torch.where(valid, parents, 0).clamp(min=0)
    top2 = logits.topk(2, dim=-1).indices.gather(1, par[:, :, None].expand(B, N, 2))  # [B, N, 2]
    pick = torch.randint(0, 3, (B, N), generator=gen)
    tokens = torch.where(pick < 2, top2.gather(2, pick.clamp(max=1)[:, :, None])[:, :, 0], 0)
    tokens = torch.where(pick == 2, torch.randint(0, V, (B, N), generator=gen), tokens)
    q = None
    if stochastic:
        q = torch.softmax(
            logits.gather(1, par[:, :, None].expand(B, N, V)) + torch.randn(B, N, V, generator=gen), -1
        )
    coins, final_coins = torch.rand(B, N, generator=gen), torch.rand(B, generator=gen)
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return [move(t) for t in (tokens, parents, logits, num_nodes, q, coins, final_coins)]


VERIFY_CASES = [
    # seed, B, N, V, temperature, top_k, top_p, stochastic
    (0, 4, 13, 4099, 0.0, 0, 1.0, False),
    (1, 3, 37, 1000, 0.0, 0, 1.0, False),
    (2, 3, 10, 4099, 0.9, 0, 1.0, False),
    (20, 3, 6, 1000, 0.7, 50, 0.9, False),
    (4, 3, 9, 4099, 1.1, 0, 1.0, True),
    (5, 3, 6, 1000, 0.8, 0, 0.85, True),
    (6, 5, 7, 1000, 1.0, 0, 1.0, False),
    # greedy over several chunks of the statistics (kernels.common.GREEDY_CHUNK), the serial walk (> 64 nodes),
    # duplicate siblings, and a row maximum repeated in a later chunk (the earliest index wins)
    (8, 3, 70, 9000, 0.0, 0, 1.0, False),
    (9, 4, 40, 9000, 0.0, 0, 1.0, False),
    (10, 4, 50, 9000, 0.0, 0, 1.0, False),
    # blocks of -inf logits (masked tokens) at the start of a row and of a chunk: no NaN in the statistics
    (11, 3, 12, 9000, 0.0, 0, 1.0, False),
    (12, 3, 9, 4099, 0.9, 0, 1.0, False),
]


@needs_triton
@pytest.mark.parametrize("seed,B,N,V,temperature,top_k,top_p,stochastic", VERIFY_CASES)
def test_verify_parity(seed, B, N, V, temperature, top_k, top_p, stochastic) -> None:
    tokens, parents, logits, num_nodes, q, coins, final_coins = make_case(seed, B, N, V, stochastic)
    if seed == 6:  # many duplicate siblings
        tokens = tokens % 3
    if seed == 9:  # duplicate siblings that are the parent's argmax: the earliest one is taken
        tokens = torch.cat([tokens[:, :20], tokens[:, 10:30]], dim=1)
        parents = torch.cat([parents[:, :20], parents[:, 10:30]], dim=1)
    if seed == 10:  # ties: each row's maximum again at token 8500 (a later chunk)
        logits[..., 8500] = logits.max(dim=-1).values
    if seed in (11, 12):
        # masked tokens: all of 0..1023 and 4096..5119 -inf; the drafts' tokens kept out of them
        logits[..., :1024] = float("-inf")
        logits[..., 4096:5120] = float("-inf")
        tokens = torch.where((tokens < 1024) | ((tokens >= 4096) & (tokens < 5120)), 2000, tokens)
        if seed == 11:  # the drafts' tokens again the parent rows' argmax, so that paths get long
            par = parents.clamp(min=0)
            best = logits.argmax(dim=-1).gather(1, par)
            tokens = torch.where(torch.arange(tokens.shape[1], device=tokens.device) % 3 == 0, tokens, best)
    assert triton_enabled(logits)
    kw = dict(num_nodes=num_nodes, temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=q, coins=coins,
              final_coins=final_coins)  # fmt: skip
    got = verify(tokens, parents, logits, **kw)
    want = verify_reference(tokens, parents, logits, **kw)
    for name in ("path", "accept_len", "next_token", "accepted"):
        assert torch.equal(getattr(got, name), getattr(want, name)), (
            name,
            getattr(got, name),
            getattr(want, name),
        )
    torch.testing.assert_close(got.node_prob, want.node_prob, atol=1e-6, rtol=0)
    assert int(want.accept_len.sum()) > 0


def _check_into(cases) -> None:
    """verify(..., out=VerifyBuffers) gives the reference's results (path -1 padded to N), twice over the same
    buffers (nothing left from the call before), and returns the buffers themselves."""
    for seed, B, N, V, temperature, top_k, top_p, stochastic in cases:
        tokens, parents, logits, num_nodes, q, coins, final_coins = make_case(seed, B, N, V, stochastic)
        kw = dict(num_nodes=num_nodes, temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=q,
                  coins=coins, final_coins=final_coins)  # fmt: skip
        want = verify_reference(tokens, parents, logits, **kw)
        S = want.path.shape[1]
        buf = VerifyBuffers(B, N, V, logits.device, draft_probs=q is not None)
        for _ in range(2):
            got = verify(tokens, parents, logits, out=buf, **kw)
            assert got.path is buf.path and got.next_token is buf.next_token
            assert torch.equal(got.path[:, :S], want.path) and bool((got.path[:, S:] == -1).all())
            for name in ("accept_len", "next_token", "accepted"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            torch.testing.assert_close(got.node_prob, want.node_prob, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="verify buffers are for"):
        verify(tokens, parents, logits, num_nodes=num_nodes, out=VerifyBuffers(B + 1, N, V, logits.device))
    # buffers made under another chunk of the greedy statistics would be written past their end: refused
    stale = VerifyBuffers(B, N, V, logits.device)
    with pytest.MonkeyPatch.context() as mp:
        from kernels import common

        mp.setattr(common, "GREEDY_CHUNK", common.GREEDY_CHUNK // 8)
        with pytest.raises(ValueError, match="make them again"):
            verify(tokens, parents, logits, num_nodes=num_nodes, out=stale)


@needs_triton
def test_verify_into_buffers_parity() -> None:
    _check_into([VERIFY_CASES[i] for i in (0, 3, 4)])  # greedy, sampling with top-k/top-p, draft_probs


def test_verify_into_buffers_reference() -> None:
    """The same through the torch reference (what the CPU's device loop runs)."""
    if TRITON_MODE:
        pytest.skip("Triton mode: the dispatcher runs the kernel (test_verify_into_buffers_parity)")
    _check_into(VERIFY_CASES)


@needs_triton
@pytest.mark.parametrize("chunk,block,warps", [(4096, 4096, 8), (1024, 1024, 4), (2048, 512, 2)])
def test_greedy_statistics_settings_parity(chunk, block, warps, monkeypatch) -> None:
    """The greedy statistics give the reference's results for other chunks and loads than the default
    (``python -m kernels.bench --greedy-settings`` times them): several chunks, ties in a later chunk, -inf blocks.
    Under the interpreter (CPU) only the two cases of several chunks with ties and -inf blocks: each small block is
    a program the interpreter runs one by one (the full set took a minute there)."""
    from kernels import common, triton_verify

    monkeypatch.setattr(common, "GREEDY_CHUNK", chunk)
    monkeypatch.setattr(triton_verify, "GREEDY_BLOCK", block)
    monkeypatch.setattr(triton_verify, "GREEDY_WARPS", warps)
    # seeds 0, 8 (the serial walk), 10 (ties in a later chunk) and 11 (-inf blocks); under the interpreter 10 and 11
    for case in (VERIFY_CASES[i] for i in ((0, 7, 9, 10) if CUDA else (9, 10))):
        test_verify_parity(*case)
    if CUDA:
        _check_into([VERIFY_CASES[8]])
    _check_greedy_ties()


def _check_greedy_ties() -> None:
    """Every row's maximum twice: row 0 at tokens 8300 and 8800 (one chunk, but two loads of 512 under the
    (2048, 512) setting), row 1 at 8150 and 8800 (two chunks under every setting); the drafts a chain of the earlier
    token, so each row's path is all accepted only if the earliest index wins (the reference's argmax)."""
    B, N, V = 2, 8, 9000
    logits = torch.randn(B, N, V, generator=torch.Generator().manual_seed(14))
    logits[0, :, [8300, 8800]] = 10.0
    logits[1, :, [8150, 8800]] = 10.0
    parents = (torch.arange(N) - 1).expand(B, N).clone()
    tokens = torch.tensor([[8300], [8150]]).expand(B, N).clone()
    num_nodes = torch.tensor([N, 5])
    tokens, parents, logits, num_nodes = (t.to(DEVICE) for t in (tokens, parents, logits, num_nodes))
    want = verify_reference(tokens, parents, logits, num_nodes=num_nodes)
    assert want.accept_len.tolist() == [N - 1, 4] and want.next_token.tolist() == [8300, 8150]
    for got in (
        verify(tokens, parents, logits, num_nodes=num_nodes),
        verify(tokens, parents, logits, num_nodes=num_nodes, out=VerifyBuffers(B, N, V, logits.device)),
    ):
        for name in ("accept_len", "next_token", "accepted"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, getattr(got, name))


@needs_triton
def test_greedy_ties_take_the_earliest_token() -> None:
    _check_greedy_ties()


@needs_triton
def test_a_final_coin_of_zero_draws_the_first_token_of_positive_mass() -> None:
    """The last draw is min{t : cumsum_t > u * total}: with u = 0 the leading tokens of mass zero (here -inf
    logits across the first loads of the vocabulary) are passed over, in the kernel as in the reference."""
    B, N, V = 3, 1, 4099
    logits = torch.randn(B, N, V, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits[0, :, :2500] = float("-inf")
    logits[1, :, :1] = float("-inf")
    tokens, parents = (
        torch.zeros(B, N, dtype=torch.int64, device=DEVICE),
        torch.full((B, N), -1, device=DEVICE),
    )
    kw = dict(
        temperature=1.0, coins=torch.zeros(B, N, device=DEVICE), final_coins=torch.zeros(B, device=DEVICE)
    )
    assert triton_enabled(logits)
    got, want = verify(tokens, parents, logits, **kw), verify_reference(tokens, parents, logits, **kw)
    assert got.next_token.tolist() == want.next_token.tolist() == [2500, 1, 0]


@needs_triton
def test_verify_parity_deep_chains() -> None:
    """Chains of 64 nodes (the parallel walk's deepest case: six pointer-jumping steps) whose tokens are the parent
    row's argmax up to a first miss at 63 (all accepted), 40 or 5, and a short row; plain and into buffers."""
    B, N, V = 4, 64, 4099
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(B, N, V, generator=gen) * 3
    parents = (torch.arange(N) - 1).expand(B, N).clone()
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), logits.argmax(-1)[:, :-1]], dim=1)
    for row, miss in ((1, 40), (2, 5), (3, 20)):
        tokens[row, miss] = (tokens[row, miss] + 1) % V
    num_nodes = torch.tensor([N, N, N, 30])
    tokens, parents, logits, num_nodes = (t.to(DEVICE) for t in (tokens, parents, logits, num_nodes))
    want = verify_reference(tokens, parents, logits, num_nodes=num_nodes)
    assert want.accept_len.tolist() == [63, 39, 4, 19]
    got = verify(tokens, parents, logits, num_nodes=num_nodes)
    buf = VerifyBuffers(B, N, V, logits.device)
    into = verify(tokens, parents, logits, num_nodes=num_nodes, out=buf)
    for name in ("accept_len", "next_token", "accepted"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(getattr(into, name), getattr(want, name)), name
    S = want.path.shape[1]
    assert torch.equal(got.path, want.path) and torch.equal(into.path[:, :S], want.path)
    assert bool((into.path[:, S:] == -1).all())
    torch.testing.assert_close(into.node_prob, want.node_prob, atol=1e-6, rtol=0)


@needs_triton
@pytest.mark.skipif(not CUDA, reason="bf16 and full-size shapes only on CUDA")
@pytest.mark.parametrize("temperature,stochastic", [(0.0, False), (0.8, False), (1.0, True)])
def test_verify_parity_bf16_full_vocab(temperature: float, stochastic: bool) -> None:
    tokens, parents, logits, num_nodes, q, coins, final_coins = make_case(7, 8, 61, 49152, stochastic)
    logits = logits.bfloat16()
    kw = dict(
        num_nodes=num_nodes, temperature=temperature, draft_probs=q, coins=coins, final_coins=final_coins
    )
    got, want = verify(tokens, parents, logits, **kw), verify_reference(tokens, parents, logits, **kw)
    for name in ("path", "accept_len", "next_token", "accepted"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.node_prob, want.node_prob, atol=1e-6, rtol=0)


@needs_triton
def test_tree_buffers_parity() -> None:
    gen = torch.Generator().manual_seed(9)
    cases = [(torch.tensor([[-1, 0, 0, 1, 2, 3, 4, 5], [-1, 0, 1, 1, 1, 1, 3, 6]]), None)]
    cases += [random_trees(gen, B, N, branch=0.6) for B, N in ((6, 23), (3, 1), (2, 40))]
    for parents, num_nodes in cases:
        parents = parents.to(DEVICE)
        num_nodes = None if num_nodes is None else num_nodes.to(DEVICE)
        got, want = tree_buffers(parents, num_nodes), tree_buffers_reference(parents, num_nodes)
        for name in ("depth", "ancestor_mask", "first_child", "next_sibling", "paths", "num_leaves"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


@needs_triton
@pytest.mark.parametrize("path", [[0, 2, 3, 7], [0, 1, 2], [0, 1, 4, 5, 6], [0, 9]])
def test_compact_kv_parity(path: list[int]) -> None:
    kv = torch.randn(2, 3, 21, 6, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    a, b = kv.clone(), kv.clone()
    p = torch.tensor(path, device=DEVICE)
    assert compact_kv_(a, 5, p) == compact_kv_reference(b, 5, p) == 5 + len(path)
    assert torch.equal(a, b)


@needs_triton
def test_sampling_children_covering_the_vocabulary() -> None:
    """Deterministic drafts whose root's children are every token of the vocabulary, with coins near 1: in exact
    arithmetic the last child left holds all the mass that remains and is accepted for sure. The kernel's running
    sum of the rejected mass leaves it within a few roundings of that (one case a rounding under, one where the
    residual at the root comes out empty): the first committed token is the reference's, never -1."""
    z = torch.tensor([0.8216181397438049, 0.3304370641708374, -1.3031572103500366, 0.9053558707237244])
    tokens, parents = torch.tensor([[0, 0, 1, 2, 3]]), torch.tensor([[-1, 0, 0, 0, 0]])
    logits = torch.zeros(1, 5, 4)
    logits[0, 0] = z
    coins = torch.tensor([[0.0, 0.999, 0.999, 0.999, 0.99999994]])
    kw = dict(temperature=1.0, coins=coins.to(DEVICE), final_coins=torch.tensor([0.3]).to(DEVICE))
    args = [t.to(DEVICE) for t in (tokens, parents, logits)]
    got, want = verify(*args, **kw), verify_reference(*args, **kw)
    assert want.path.tolist() == [[0, 4]]
    for name in ("path", "accept_len", "next_token", "accepted"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name

    B, V = 8, 48
    gen = torch.Generator().manual_seed(0)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), torch.stack([torch.randperm(V, generator=gen)
                                                                         for _ in range(B)])], 1)  # fmt: skip
    parents = torch.tensor([[-1] + [0] * V] * B)
    logits = torch.randn(B, V + 1, V, generator=gen)
    logits[:, 0] = torch.randn(B, V, generator=gen) * 2
    kw = dict(temperature=1.0, coins=torch.full((B, V + 1), 0.9999999, device=DEVICE),
              final_coins=torch.rand(B, generator=gen).to(DEVICE))  # fmt: skip
    args = [t.to(DEVICE) for t in (tokens, parents, logits)]
    got, want = verify(*args, **kw), verify_reference(*args, **kw)
    assert bool((got.next_token >= 0).all()), got.next_token.tolist()
    first = lambda r: [int(tokens[b, r.path[b, 1]]) if r.accept_len[b] > 0 else int(r.next_token[b])  # noqa: E731
                       for b in range(B)]  # fmt: skip
    assert first(got) == first(want) == [int(tokens[b, V]) for b in range(B)]
