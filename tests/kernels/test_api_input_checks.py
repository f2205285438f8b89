"""The public kernels refuse inputs outside their contract with a one-line TypeError / ValueError naming the
argument, instead of a silent wrong answer (token 0, an overflowing copy) or a deep torch error."""

import os

import pytest
import torch

import kernels
from kernels import (
    argmax_lastdim,
    compact_kv_,
    process_logits,
    prompt_lookup,
    tree_attention,
    tree_attention_reference,
    tree_buffers,
    verify,
)
from kernels.common import MIN_TEMPERATURE
from kernels.lookup import check_lookup_args

# the logits' values are checked on the torch path (CPU tensors); the Triton kernels read nothing back to check
torch_path = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="values are checked on the torch path only"
)

V = 8
TOKENS = torch.tensor([[0, 3, 4]])
PARENTS = torch.tensor([[-1, 0, 1]])


def chain_logits() -> torch.Tensor:
    """[1, 3, V]: the argmax after node 0 is 3, after node 1 is 4, after node 2 is 2 (the chain is accepted)."""
    lg = torch.zeros(1, 3, V)
    lg[0, 0, 3] = lg[0, 1, 4] = lg[0, 2, 2] = 5.0
    return lg


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# temperature


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, MIN_TEMPERATURE / 2])
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    v = verify(TOKENS, PARENTS, chain_logits(), temperature=temperature, generator=gen())
    assert v.path.tolist() == [[0, 1, 2]] and v.next_token.tolist() == [2]
    p = process_logits(chain_logits()[0, 0], temperature)
    assert torch.equal(p, torch.nn.functional.one_hot(torch.tensor(3), V).float())


def test_small_sampling_temperature_stays_sampling_and_defined() -> None:
    # at MIN_TEMPERATURE itself z = logits * 2**100 is finite: the sampled distribution is the argmax's one-hot
    v = verify(TOKENS, PARENTS, chain_logits(), temperature=MIN_TEMPERATURE, generator=gen())
    assert v.path.tolist() == [[0, 1, 2]] and v.next_token.tolist() == [2]
    assert torch.equal(process_logits(chain_logits()[0], MIN_TEMPERATURE).argmax(-1), torch.tensor([3, 4, 2]))


@torch_path
def test_overflowing_logits_over_temperature_are_refused() -> None:
    with pytest.raises(ValueError, match=r"logits\[0, 0\] times 1/temperature overflows float32"):
        verify(TOKENS, PARENTS, chain_logits() * 1e9, temperature=1e-29, generator=gen())
    with pytest.raises(ValueError, match="overflows float32"):
        process_logits(chain_logits()[0, 0] * 1e9, 1e-29)


@pytest.mark.parametrize(
    "kw,error,message",
    [
        (dict(temperature=float("nan")), ValueError, "temperature must be a finite number, got nan"),
        (dict(temperature=float("inf")), ValueError, "temperature must be a finite number, got inf"),
        (dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
        (dict(temperature="1"), TypeError, "temperature must be a finite number, got '1' \\(str\\)"),
        (dict(temperature=1.0, top_p=-0.5), ValueError, r"top_p must be in \[0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), ValueError, r"top_p must be in \[0, 1\]"),
        (dict(temperature=1.0, top_p=float("nan")), ValueError, "top_p must be a finite number"),
        (dict(temperature=1.0, top_k=-1), ValueError, r"top_k must be in \[0, 2\*\*31 - 1\]"),
        (dict(temperature=1.0, top_k=1.5), TypeError, "top_k must be an integer, got 1.5"),
        (
            dict(temperature=1.0, generator=0),
            TypeError,
            "generator must be a torch.Generator or None, got int",
        ),
    ],
)
def test_sampling_settings_are_checked(kw: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        verify(TOKENS, PARENTS, chain_logits(), **kw)
    if "generator" not in kw:
        with pytest.raises(error, match=message):
            process_logits(chain_logits(), **{"top_k": 0, "top_p": 1.0, **kw})


# non-finite logits


@torch_path
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "value,message", [(float("nan"), "holds NaN"), (float("inf"), r"holds \+inf"), (None, "is all -inf")]
)
def test_non_finite_logits_are_refused(temperature: float, value: float | None, message: str) -> None:
    lg = chain_logits()
    if value is None:
        lg[0, 0] = float("-inf")
    else:
        lg[0, 0, 5] = value
    with pytest.raises(ValueError, match=r"logits\[0, 0\] " + message):
        verify(TOKENS, PARENTS, lg, temperature=temperature, generator=gen())
    with pytest.raises(ValueError, match=message):
        process_logits(lg[0], temperature)


@torch_path
def test_nan_in_a_later_greedy_row_and_masked_tokens() -> None:
    lg = chain_logits()
    lg[0, 2] = float("nan")
    with pytest.raises(ValueError, match=r"logits\[0, 2\] holds NaN"):
        verify(TOKENS, PARENTS, lg)
    # a padding row is never read: anything goes there; -inf entries are impossible tokens, not errors
    v = verify(TOKENS, PARENTS, lg, num_nodes=torch.tensor([2]))
    assert v.path.tolist() == [[0, 1]] and v.next_token.tolist() == [4]
    lg = chain_logits()
    lg[:, :, :2] = float("-inf")
    v = verify(TOKENS, PARENTS, lg, temperature=1e-3, generator=gen())
    assert v.path.tolist() == [[0, 1, 2]] and v.next_token.tolist() == [2]


@torch_path
def test_long_row_argmax_and_check_see_nan() -> None:
    x = torch.zeros(2, 8192)
    x[:, 100] = 1.0
    x[0, 5000] = float("nan")
    x[1, 8191] = float("nan")
    assert torch.equal(argmax_lastdim(x), x.argmax(-1))
    y = torch.zeros(2, 8292)  # a tail after the full blocks
    y[:, 100] = 1.0
    y[0, 8200] = float("nan")
    y[1, 3000] = y[1, 8200] = float("nan")
    assert torch.equal(argmax_lastdim(y), y.argmax(-1))
    with pytest.raises(ValueError, match=r"logits\[0, 0\] holds NaN"):
        verify(torch.tensor([[0]]), torch.tensor([[-1]]), x[:1, None])


# sampling inputs


@pytest.mark.parametrize("u", [1.5, 1.0, -1.0, float("nan")])
def test_final_coins_outside_unit_interval(u: float) -> None:
    with pytest.raises(ValueError, match=r"final_coins\[0\] = .* is not a uniform in \[0, 1\)"):
        verify(TOKENS, PARENTS, chain_logits(), temperature=1.0, final_coins=torch.tensor([u]))


@pytest.mark.parametrize("c", [5.0, float("nan"), -0.5])
def test_coins_outside_unit_interval(c: float) -> None:
    with pytest.raises(ValueError, match=r"coins\[0, 1\] = .* is not a uniform in \[0, 1\)"):
        verify(TOKENS, PARENTS, chain_logits(), temperature=1.0, coins=torch.tensor([[0.0, c, 0.0]]))
    # a padding node's coin is never read
    v = verify(TOKENS, PARENTS, chain_logits(), temperature=1.0, coins=torch.tensor([[0.0, 0.0, c]]),
               final_coins=torch.tensor([0.5]), num_nodes=torch.tensor([2]))  # fmt: skip
    assert v.path.tolist() == [[0, 1]]


def test_integer_coins_are_refused() -> None:
    with pytest.raises(TypeError, match="coins must hold real floating-point numbers, got a torch.int64"):
        verify(TOKENS, PARENTS, chain_logits(), temperature=1.0, coins=torch.zeros(1, 3, dtype=torch.int64))


@pytest.mark.parametrize(
    "fill,error,message",
    [
        pytest.param(
            0.0, ValueError, r"draft_probs\[0, 1, 3\] = 0.0: node 1 was drawn from it", marks=torch_path
        ),
        (-1.0, ValueError, r"draft_probs\[0, 0, 0\] = -1.0 is not a probability"),
        (float("nan"), ValueError, r"draft_probs\[0, 0, 0\] = nan is not a probability"),
        (2.0, ValueError, r"draft_probs\[0, 0, 0\] = 2.0 is not a probability"),
    ],
)
def test_draft_probs_values(fill: float, error: type, message: str) -> None:
    dp = torch.full((1, 3, V), fill)
    with pytest.raises(error, match=message):
        verify(TOKENS, PARENTS, chain_logits(), temperature=1.0, draft_probs=dp, generator=gen())


def test_integer_draft_probs_are_refused() -> None:
    dp = torch.ones(1, 3, V, dtype=torch.int64)
    with pytest.raises(TypeError, match="draft_probs must hold real floating-point numbers"):
        verify(TOKENS, PARENTS, chain_logits(), temperature=1.0, draft_probs=dp, generator=gen())


# tree attention


@pytest.mark.parametrize("fn", [tree_attention, tree_attention_reference])
def test_tree_attention_refuses_a_float_mask(fn) -> None:
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    mask = torch.ones(1, 1, 3, 5)
    with pytest.raises(TypeError, match="mask must hold booleans, got a torch.float32 tensor"):
        fn(q, k, k, mask, 0.5)
    assert fn(q, k, k, mask.bool(), 0.5).shape == (1, 3, 2, 4)


# KV compaction


@pytest.mark.parametrize(
    "start,path,error,message",
    [
        (2, [0, -1], ValueError, "must be non-negative and strictly increasing"),
        (2, [0, 2, 1], ValueError, "must be non-negative and strictly increasing"),
        (2, [0, 0], ValueError, "must be non-negative and strictly increasing"),
        (12, [0, 1], ValueError, r"start 12 is not a position of the cache \(0..10\)"),
        (-2, [0], ValueError, r"start -2 is not a position of the cache"),
        (2.5, [0, 1], TypeError, "start must be an integer, got 2.5"),
        (2, [0.0, 1.0], TypeError, "path must hold integers, got a torch.float32 tensor"),
        (2, [0, 9], ValueError, "path's last node 9 lies past the cache"),
        (8, [0, 1, 2], ValueError, r"path \(3,\) must be \[S\] with S <= L - start = 2"),
        (2, [[0, 1]], ValueError, r"path \(1, 2\) must be \[S\]"),
    ],
)
def test_compact_kv_checks(start, path, error: type, message: str) -> None:
    kv = torch.arange(10.0).reshape(1, 1, 10, 1)
    with pytest.raises(error, match=message):
        compact_kv_(kv, start, torch.tensor(path))
    assert torch.equal(kv, torch.arange(10.0).reshape(1, 1, 10, 1))  # nothing written


def test_compact_kv_valid_edges() -> None:
    kv = torch.arange(10.0).reshape(1, 1, 10, 1)
    assert compact_kv_(kv, 8, torch.tensor([0, 1])) == 10
    assert compact_kv_(kv, 10, torch.tensor([], dtype=torch.int64)) == 10
    assert compact_kv_(kv, 5, torch.tensor([0, 4])) == 7 and kv[0, 0, 6, 0] == 9.0
    with pytest.raises(TypeError, match="kv must be a torch.Tensor, got list"):
        compact_kv_([[1.0]], 0, torch.tensor([0]))


# prompt lookup


HIST = torch.tensor([[1, 2, 3, 1, 2, 0, 0]])


@pytest.mark.parametrize(
    "hist,cur_len,depth,ngram,error,message",
    [
        (HIST, torch.tensor([5]), -1, 2, ValueError, "depth must be >= 0, got -1"),
        (HIST, torch.tensor([5]), 2, 0, ValueError, "ngram must be >= 1, got 0"),
        (HIST, torch.tensor([5]), 2, -1, ValueError, "ngram must be >= 1, got -1"),
        (HIST, torch.tensor([5]), 2.0, 2, TypeError, "depth must be an integer, got 2.0"),
        (HIST, torch.tensor([5.0]), 2, 2, TypeError, "cur_len must hold integers, got a torch.float32"),
        (HIST, 5, 2, 2, TypeError, "cur_len must be a torch.Tensor of integers, got int"),
        (HIST, torch.tensor([5, 5]), 2, 2, ValueError, r"cur_len \(2,\) must be \[B\] with B = 1"),
        (HIST[0], torch.tensor([5]), 2, 2, ValueError, r"hist \(7,\) must be \[B, L\]"),
        (HIST[:, :0], torch.tensor([1]), 2, 2, ValueError, r"hist \(1, 0\) must be \[B, L\] with L >= 1"),
        (HIST.float(), torch.tensor([5]), 2, 2, TypeError, "hist must hold integers, got a torch.float32"),
    ],
)
def test_prompt_lookup_checks(hist, cur_len, depth, ngram, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        prompt_lookup(hist, cur_len, depth, ngram)


@pytest.mark.parametrize("cur", [0, -3, 9])
def test_prompt_lookup_cur_len_values_on_request(cur: int) -> None:
    # prompt_lookup reads nothing back (a device-resident step); a caller that may read asks for the values
    with pytest.raises(ValueError, match=rf"row 0: cur_len {cur} is not within 1..7"):
        check_lookup_args(HIST, torch.tensor([cur]), 2, 2, values=True)
    check_lookup_args(HIST, torch.tensor([7]), 2, 2, values=True)


def test_prompt_lookup_valid_edges() -> None:
    assert prompt_lookup(HIST, torch.tensor([5]), 2, 2).tolist() == [[3, 1]]
    assert prompt_lookup(HIST, torch.tensor([7]), 0, 1).shape == (1, 0)


# tree and logits types


@pytest.mark.parametrize(
    "args,kw,error,message",
    [
        ((TOKENS.float(), PARENTS), {}, TypeError, "tokens must hold integers, got a torch.float32"),
        ((TOKENS, torch.tensor([[-1, 0.5, 1.0]])), {}, TypeError, "parents must hold integers"),
        ((TOKENS, PARENTS), dict(num_nodes=torch.tensor([1.5])), TypeError, "num_nodes must hold integers"),
        (([[0, 3, 4]], PARENTS), {}, TypeError, "tokens must be a torch.Tensor of integers, got list"),
        ((TOKENS, PARENTS.tolist()), {}, TypeError, "parents must be a torch.Tensor of integers, got list"),
        ((TOKENS.bool(), PARENTS), {}, TypeError, "tokens must hold integers, got a torch.bool"),
        ((TOKENS, PARENTS), dict(out=object()), TypeError, "out must be kernels.VerifyBuffers or None"),
    ],
)
def test_verify_argument_types(args, kw: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        verify(*args, chain_logits(), **kw)


@pytest.mark.parametrize(
    "logits,error,message",
    [
        (chain_logits().to(torch.complex64), TypeError, "logits must hold real floating-point numbers"),
        (chain_logits().long(), TypeError, "logits must hold real floating-point numbers, got a torch.int64"),
        (chain_logits().to("meta"), ValueError, "logits is a meta tensor"),
        (torch.zeros(1, 3, 0), kernels.TreeError, r"logits \(1, 3, 0\) must be \[B, N, V\] .* V >= 1"),
    ],
)
def test_verify_logits_types(logits, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        verify(TOKENS, PARENTS, logits)


def test_tree_buffers_argument_types() -> None:
    with pytest.raises(TypeError, match="parents must hold integers, got a torch.float32"):
        tree_buffers(torch.tensor([[-1.0, 0.0, 1.0]]))
    with pytest.raises(TypeError, match="num_nodes must hold integers"):
        tree_buffers(PARENTS, torch.tensor([2.0]))
    with pytest.raises(TypeError, match="parents must be a torch.Tensor of integers, got list"):
        tree_buffers([[-1, 0]])
