"""Logit processing (temperature, top-k, top-p, softmax; Hugging Face order) against a plain loop."""

import math

import pytest
import torch

from kernels import process_logits


def loop_process(row: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The definition, one token at a time: z = l * fp32(1/T); top-k keeps z >= k-th largest; top-p keeps t iff
    the mass (after top-k) of tokens with a strictly larger z is < top_p; softmax over what is kept."""
    inv_t = float(torch.tensor(1.0 / temperature, dtype=torch.float32))
    z = [float(torch.tensor(v, dtype=torch.float32) * inv_t) for v in row]
    keep = [True] * len(z)
    if 0 < top_k < len(z):
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [v >= kth for v in z]

    def softmax(mask: list[bool]) -> list[float]:
        m = max(v for v, k in zip(z, mask) if k)
        e = [math.exp(v - m) if k else 0.0 for v, k in zip(z, mask)]
        s = sum(e)
        return [x / s for x in e]

    if top_p < 1.0:
        p = softmax(keep)
        keep = [k and sum(ps for zs, ps in zip(z, p) if zs > zt) < top_p for zt, k in zip(z, keep)]
        keep[z.index(max(z))] = True
    return softmax(keep)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.6, 7, 0.9), (2.0, 3, 0.5), (1.0, 0, 0.0)],
)
def test_matches_loop(temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 37, generator=gen) * 2
    logits[0, 3:9] = logits[0, 2]  # ties, including at the top-k boundary
    logits[1] = torch.round(logits[1])  # many ties
    logits[2, 5] = float("-inf")
    got = process_logits(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32
    for r in range(logits.shape[0]):
        want = torch.tensor(loop_process(logits[r].tolist(), temperature, top_k, top_p), dtype=torch.float32)
        torch.testing.assert_close(got[r], want, atol=1e-6, rtol=0)


def test_ties_kept_together() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    assert (process_logits(logits, 1.0, top_k=2) > 0).tolist() == [[True, True, True, True, False]]


def test_top_p_keeps_top_token_and_boundary() -> None:
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = p.log()
    kept = lambda top_p: (process_logits(logits, 1.0, top_p=top_p) > 0).sum().item()  # noqa: E731
    assert kept(0.0) == 1 and kept(0.5) == 1 and kept(0.51) == 2 and kept(0.79) == 2 and kept(0.81) == 3


def test_greedy_is_one_hot_and_bf16_input() -> None:
    logits = torch.randn(3, 4, 11).bfloat16()
    out = process_logits(logits, 0.0)
    assert torch.equal(out.argmax(-1), logits.float().argmax(-1)) and torch.equal(
        out.sum(-1), torch.ones(3, 4)
    )
    torch.testing.assert_close(process_logits(logits, 1.0), torch.softmax(logits.float(), -1))
