"""``kernels.verify`` refuses trees outside the contract (DESIGN.md "Trees") with a ``TreeError`` naming the row, the
node and the rule, instead of verifying them silently (the reference and the Triton kernel used to disagree on
them: a node whose parent is -1, an empty tree). Padding nodes past ``num_nodes`` may hold anything."""

import pytest
import torch

from kernels import TreeError, VerifyBuffers, tree_buffers, verify


def chain(B: int = 2, N: int = 5, V: int = 50):
    tokens = torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(0))
    parents = (torch.arange(N) - 1)[None].repeat(B, 1)
    return tokens, parents, torch.randn(B, N, V)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t, p, n: p.__setitem__((1, 3), 3), "row 1: node 3's parent 3 is not an earlier node"),
        (lambda t, p, n: p.__setitem__((0, 2), -1), "row 0: node 2's parent -1 is not an earlier node"),
        (lambda t, p, n: p.__setitem__((1, 0), 0), "row 1: the root's parent is 0, not -1"),
        (lambda t, p, n: n.__setitem__(0, 0), "row 0: num_nodes 0 is not within 1..5"),
        (lambda t, p, n: n.__setitem__(1, 6), "row 1: num_nodes 6 is not within 1..5"),
        (lambda t, p, n: t.__setitem__((0, 4), 50), "row 0: node 4's token 50 is not within the vocabulary"),
        (lambda t, p, n: t.__setitem__((1, 1), -2), "row 1: node 1's token -2 is not within the vocabulary"),
    ],
)
def test_a_tree_outside_the_contract_is_refused(edit, message) -> None:
    tokens, parents, logits = chain()
    num_nodes = torch.tensor([5, 5])
    verify(tokens, parents, logits, num_nodes=num_nodes)  # the chain itself is fine
    edit(tokens, parents, num_nodes)
    for temperature in (0.0, 1.0):
        with pytest.raises(TreeError, match=message.replace("(", r"\(")):
            verify(tokens, parents, logits, num_nodes=num_nodes, temperature=temperature)


@pytest.mark.parametrize(
    "parents,num_nodes,message",
    [
        ([[-1, 2, 1]], None, "row 0: node 1's parent 2 is not an earlier node"),
        ([[-1, 0, 7]], None, "row 0: node 2's parent 7 is not an earlier node"),
        ([[3, 0, 1]], None, "row 0: the root's parent is 3, not -1"),
        ([[-1, 0, 1]], [4], "row 0: num_nodes 4 is not within 1..3"),
    ],
)
def test_tree_buffers_refuse_links_that_are_not_trees(parents, num_nodes, message) -> None:
    """The tables of a tree's attention (depths, ancestors) are built before ``verify`` checks it: garbage links
    are refused there too, not turned into garbage depths or an indexing error."""
    n = None if num_nodes is None else torch.tensor(num_nodes)
    with pytest.raises(TreeError, match=message):
        tree_buffers(torch.tensor(parents), n)
    tree_buffers(
        torch.tensor([[-1, 0, 0, 2, 9]]), torch.tensor([4])
    )  # padding past num_nodes may hold anything


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_of_no_sequences_gives_empty_results(temperature) -> None:
    v = verify(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3, 5),
               temperature=temperature)  # fmt: skip
    assert v.path.shape == (0, 1) and v.accept_len.shape == v.next_token.shape == (0,)
    assert v.accepted.shape == (0, 3)


def test_padding_nodes_may_hold_anything() -> None:
    tokens, parents, logits = chain()
    tokens[0, 3:] = -7
    parents[0, 3:] = 99
    v = verify(tokens, parents, logits, num_nodes=torch.tensor([3, 5]))
    assert int(v.accept_len[0]) <= 2


def test_shapes_are_checked_into_buffers_too() -> None:
    tokens, parents, logits = chain()
    buf = VerifyBuffers(2, 5, 50, "cpu")
    with pytest.raises(TreeError, match=r"tokens \(2, 5\) and parents \(2, 4\) must both be \[B, N\]"):
        verify(tokens, parents[:, :4], logits, out=buf)
    with pytest.raises(TreeError, match=r"logits \(2, 4, 50\) must be \[B, N, V\]"):
        verify(tokens, parents, logits[:, :4], out=buf)
    with pytest.raises(TreeError, match=r"num_nodes \(3,\) must be \[B\]"):
        verify(tokens, parents, logits, num_nodes=torch.tensor([5, 5, 5]), out=buf)
    with pytest.raises(TreeError, match="trees of no nodes"):
        verify(tokens[:, :0], parents[:, :0], logits[:, :0])


def test_sampling_inputs_of_other_shapes_are_refused() -> None:
    """One row's coins broadcast to every row would tie the rows' draws together (and the Triton kernel read past
    the buffer): coins [B, N], final_coins [B] and draft_probs [B, N, V] are checked like the trees."""
    tokens, parents, logits = chain()
    kw = dict(temperature=1.0)
    with pytest.raises(TreeError, match=r"coins \(1, 5\) must be \[2, 5\]"):
        verify(tokens, parents, logits, coins=torch.rand(1, 5), final_coins=torch.rand(2), **kw)
    with pytest.raises(TreeError, match=r"final_coins \(1,\) must be \[2\]"):
        verify(tokens, parents, logits, coins=torch.rand(2, 5), final_coins=torch.rand(1), **kw)
    with pytest.raises(TreeError, match=r"draft_probs \(1, 5, 50\) must be \[2, 5, 50\]"):
        verify(tokens, parents, logits, draft_probs=torch.rand(1, 5, 50), **kw)
    verify(tokens, parents, logits, coins=torch.rand(2, 5), final_coins=torch.rand(2), **kw)  # the right ones
