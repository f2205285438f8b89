"""Tree index tables: a golden case with a known answer, and random padded trees against brute force."""

import torch
from kernel_cases import random_trees

from kernels import tree_buffers, tree_buffers_reference

GOLDEN_PARENTS = torch.tensor([[-1, 0, 0, 1, 2, 3, 4, 5], [-1, 0, 1, 1, 1, 1, 3, 6]])


def check_golden(tb) -> None:
    assert tb.depth.tolist() == [[0, 1, 1, 2, 2, 3, 3, 4], [0, 1, 2, 2, 2, 2, 3, 4]]
    assert tb.first_child.tolist() == [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
    assert tb.next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
    assert tb.num_leaves.tolist() == [2, 4]
    assert tb.paths.tolist() == [
        [[0, 2, 4, 6, -1], [0, 1, 3, 5, 7], [-1] * 5, [-1] * 5],
        [[0, 1, 2, -1, -1], [0, 1, 4, -1, -1], [0, 1, 5, -1, -1], [0, 1, 3, 6, 7]],
    ]
    assert tb.ancestor_mask[1, 7].nonzero().flatten().tolist() == [0, 1, 3, 6, 7]
    assert tb.ancestor_mask[0, 6].nonzero().flatten().tolist() == [0, 2, 4, 6]


def test_golden_reference() -> None:
    check_golden(tree_buffers_reference(GOLDEN_PARENTS))


def test_golden_dispatcher() -> None:
    check_golden(tree_buffers(GOLDEN_PARENTS))


def brute_force(parents: torch.Tensor, num_nodes: torch.Tensor) -> dict:
    B, N = parents.shape
    depth = torch.zeros(B, N, dtype=torch.int64)
    anc = torch.zeros(B, N, N, dtype=torch.bool)
    fc = torch.full((B, N), -1)
    ns = torch.full((B, N), -1)
    paths = []
    for b in range(B):
        n, par = int(num_nodes[b]), parents[b].tolist()
        for i in range(N):
            anc[b, i, i] = True
            j = i
            while i < n and j > 0:
                j = par[j]
                anc[b, i, j] = True
                depth[b, i] += 1
        for i in range(1, n):
            if fc[b, par[i]] < 0:
                fc[b, par[i]] = i
            later = [j for j in range(i + 1, n) if par[j] == par[i]]
            ns[b, i] = later[0] if later else -1
        leaves = [i for i in range(n) if fc[b, i] < 0]
        paths.append([anc[b, leaf].nonzero().flatten().tolist() for leaf in leaves])
    return dict(depth=depth, ancestor_mask=anc, first_child=fc, next_sibling=ns, paths=paths)


def test_random_padded_trees_match_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    for N in (1, 2, 7, 23):
        parents, num_nodes = random_trees(gen, 9, N, branch=0.6)
        tb = tree_buffers_reference(parents, num_nodes)
        want = brute_force(parents, num_nodes)
        for name in ("depth", "ancestor_mask", "first_child", "next_sibling"):
            assert torch.equal(getattr(tb, name), want[name]), name
        assert tb.num_leaves.tolist() == [len(p) for p in want["paths"]]
        for b, leaf_paths in enumerate(want["paths"]):
            for ell, p in enumerate(leaf_paths):
                row = tb.paths[b, ell]
                assert row[: len(p)].tolist() == p and bool((row[len(p) :] == -1).all())
            assert bool((tb.paths[b, len(leaf_paths) :] == -1).all())


def test_padding_rows_only_themselves() -> None:
    parents = torch.tensor([[-1, 0, 1, 5, 2]])
    tb = tree_buffers_reference(parents, torch.tensor([3]))
    assert tb.ancestor_mask[0, 3].nonzero().flatten().tolist() == [3]
    assert tb.ancestor_mask[0, 4].nonzero().flatten().tolist() == [4]
    assert tb.depth.tolist() == [[0, 1, 2, 0, 0]]
    assert tb.first_child.tolist() == [[1, 2, -1, -1, -1]]
    assert tb.paths.tolist() == [[[0, 1, 2]]]
