"""A CPU generator drives a verify on any device: the coins are drawn on the generator's device and moved, so one
seed gives the same verdicts on CPU (torch reference) and CUDA (Triton). Skipped without CUDA."""

import pytest
import torch

from kernels import verify
from kernels.bench import make_inputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stochastic", [False, True])
def test_a_cpu_generator_gives_the_same_verdicts_on_cpu_and_cuda(stochastic):
    tokens, parents, logits, q = make_inputs(8, 16, 1000, torch.float32, "cpu", stochastic, seed=4)
    out = {}
    for dev in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(11)  # a CPU generator, as the decoder keeps
        v = verify(
            tokens.to(dev),
            parents.to(dev),
            logits.to(dev),
            temperature=1.0,
            draft_probs=None if q is None else q.to(dev),
            generator=gen,
        )
        out[dev] = (v.accepted.cpu(), v.next_token.cpu(), v.accept_len.cpu())
    for a, b in zip(out["cpu"], out["cuda"]):
        assert torch.equal(a, b)
    assert int(out["cpu"][2].sum()) > 0  # some drafts were accepted: the coins mattered
