"""Small files that would make a loader allocate, walk or loop without end: zip bombs (a member, or an archive
inside a member, that deflates to far more than the file), ``.npy`` headers whose items are 0 bytes (any shape
matches no data) and trees that make replay quadratic. Each is refused in one line before the memory or the time
is spent (peak memory measured with ``tracemalloc``), and the files draftgym ships still load."""

from __future__ import annotations

import hashlib
import io
import json
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from env.safe_zip import ArchiveProblem, npy_array, read_npz, unpacked_bytes

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20
BOMB = 272 * MB  # past a policy's bound (policies.archive.POLICY_BYTES: 256 MB)


def zeros_member(zf: zipfile.ZipFile, name: str, size: int, head: bytes = b"") -> None:
    """A member of ``head`` then zeros, ``size`` bytes in all, written in chunks (deflated: a few hundred KB)."""
    with zf.open(name, "w", force_zip64=True) as fh:
        fh.write(head)
        left = size - len(head)
        while left > 0:
            fh.write(bytes(min(MB, left)))
            left -= MB


def npy_head(descr, shape) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def padded_npz(size: int) -> bytes:
    """A deflated ``.npz`` of one uint8 array of ``size`` zero bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        head = npy_head("|u1", (size,))
        zeros_member(zf, "pad.npy", size + len(head), head)
    return buf.getvalue()


def shipped(name: str) -> dict[str, bytes]:
    with zipfile.ZipFile(ROOT / "policies" / "data" / name) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def write_zip(path: Path, members: dict[str, bytes], big: dict[str, int] | None = None) -> Path:
    """``members``, then a zero-filled member of each size in ``big``, deflated."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, size in (big or {}).items():
            zeros_member(zf, name, size)
    return path


def with_payload(members: dict[str, bytes], **replace: bytes) -> dict[str, bytes]:
    """A policy's members with ``replace`` in them, their checksums in header.json made to match."""
    header = json.loads(members["header.json"])
    for name, data in replace.items():
        header["payload"][name] = hashlib.sha256(data).hexdigest()
    return {**members, **replace, "header.json": json.dumps(header).encode()}


def peak_mb(fn) -> float:
    """Peak Python/numpy allocation (MB) while ``fn()`` runs (raising or not)."""
    tracemalloc.start()
    try:
        fn()
    except Exception:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / MB


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Imports and lazy caches out of the measured calls."""
    from env.trace import load_trace
    from policies.base import load_policy

    load_trace()
    for name in ("ucb1.zip", "linucb.zip"):
        load_policy(ROOT / "policies" / "data" / name)


# ---- policies ------------------------------------------------------------------------------------------------------


def test_a_member_the_payload_does_not_name_is_refused_unread(tmp_path):
    from policies.archive import POLICY_BYTES
    from policies.base import PolicyError, load_policy

    path = write_zip(tmp_path / "junk.zip", shipped("ucb1.zip"), big={"junk.bin": 1000})
    with pytest.raises(PolicyError, match="member 'junk.bin' is not in header.json's payload") as err:
        load_policy(path)
    assert "\n" not in str(err.value)
    bomb = write_zip(tmp_path / "bomb.zip", shipped("ucb1.zip"), big={"junk.bin": BOMB})
    assert bomb.stat().st_size < 2 * MB
    with pytest.raises(PolicyError, match=f"declares more than {POLICY_BYTES} bytes unpacked"):
        load_policy(bomb)
    assert peak_mb(lambda: load_policy(bomb)) < 8


def test_a_named_member_past_the_policy_bound_is_refused_before_unpacking(tmp_path):
    from policies.archive import POLICY_BYTES
    from policies.base import PolicyError, load_policy

    members = with_payload(shipped("ucb1.zip"), **{"state.json": bytes(BOMB)})
    path = write_zip(tmp_path / "big.zip", members)
    with pytest.raises(PolicyError, match=f"more than {POLICY_BYTES} bytes"):
        load_policy(path)
    assert peak_mb(lambda: load_policy(path)) < 8


def test_an_archive_inside_a_policy_shares_its_bound(tmp_path):
    """linucb's state.npz holding 272 MB of deflated zeros: each level alone is within its reader's bound, the two
    together are not, and the inner one is not unpacked."""
    from policies.base import PolicyError, load_policy

    path = write_zip(
        tmp_path / "nested.zip", with_payload(shipped("linucb.zip"), **{"state.npz": padded_npz(BOMB)})
    )
    assert path.stat().st_size < 2 * MB
    with pytest.raises(PolicyError, match="counting the archives inside it") as err:
        load_policy(path)
    assert "\n" not in str(err.value)
    assert peak_mb(lambda: load_policy(path)) < 8


def test_a_plain_stable_baselines3_zip_whose_policy_pth_inflates_is_refused(tmp_path):
    """policy.pth is itself a zip (torch's format): its deflated tensor record counts against the bound."""
    from policies.base import PolicyError, load_policy

    pth = io.BytesIO()
    with zipfile.ZipFile(pth, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        zeros_member(zf, "archive/data/0", BOMB)
    path = write_zip(tmp_path / "sb3.zip", {"policy.pth": pth.getvalue(), "data": b"{}"})
    with pytest.raises(
        PolicyError, match="not a readable stable-baselines3 zip.*counting the archives inside it"
    ):
        load_policy(path)


def test_unpacked_bytes_counts_every_level_and_only_what_is_asked(tmp_path):
    inner = padded_npz(1000)
    middle = io.BytesIO()
    with zipfile.ZipFile(middle, "w") as zf:
        zf.writestr("state.npz", inner)
        zf.writestr("notes", b"x" * 10)
    outer = write_zip(tmp_path / "o.zip", {"model.zip": middle.getvalue(), "other": b"y" * 7})
    n_inner = 1000 + len(npy_head("|u1", (1000,)))
    assert unpacked_bytes(outer, max_bytes=MB) == len(middle.getvalue()) + 7
    assert (
        unpacked_bytes(outer, max_bytes=MB, levels=3)
        == len(middle.getvalue()) + 7 + len(inner) + 10 + n_inner
    )
    assert unpacked_bytes(outer, max_bytes=MB, levels=3, only={"other"}) == 7
    with pytest.raises(ArchiveProblem, match="more than 1500 bytes unpacked, counting the archives"):
        unpacked_bytes(outer, max_bytes=1500, levels=3)


def test_the_shipped_policies_load_within_the_bound():
    from policies.base import load_policy

    for path in sorted((ROOT / "policies" / "data").rglob("*.zip")):
        load_policy(path)


def test_a_policy_bomb_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    from experiments.cli import main

    path = write_zip(tmp_path / "p.zip", shipped("ucb1.zip"), big={"junk.bin": BOMB})
    assert main(["evaluate", str(path), "--no-live"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and f"{path} is not a readable draftgym policy file" in err[0], err
    assert "declares more than 268435456 bytes unpacked" in err[0] and "Traceback" not in err[0], err


# ---- .npy headers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("descr", "shape"),
    [([], (1 << 40, 1 << 20)), ("|V0", (1 << 40,) * 3), ("<U0", (1 << 40,)), ("|S0", (1 << 30,)),
     ([("a", "<f8")], (2,)), ("<c16", (1,)), ("<M8[s]", (1,))],
)  # fmt: skip
def test_npy_items_of_no_size_or_of_kinds_draftgym_never_writes_are_refused(descr, shape):
    """An empty structured dtype once walked 2**60 elements; ``|V0`` over 2**120 elements overflowed in numpy."""
    data = npy_head(descr, shape)
    data += bytes(
        np.dtype(descr).itemsize * int(np.prod(shape, dtype=object)) if np.dtype(descr).itemsize else 0
    )
    with pytest.raises(ArchiveProblem, match="only bool, integer, float and text"):
        npy_array(data, "x.npy")


def test_the_kinds_draftgym_writes_still_read():
    kinds = ("?", "i1", "i2", "<i4", ">i8", "u1", "u8", "<f2", "<f4", ">f8")
    arrays = {k: (np.arange(6) % 2).astype(k).reshape(2, 3) for k in kinds}
    arrays["header"] = np.array('{"format": "draftgym-trace"}')
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    got = read_npz(buf.getvalue(), max_bytes=MB)
    assert all(got[k].dtype == v.dtype and np.array_equal(got[k], v) for k, v in arrays.items())
    assert set(read_npz(buf.getvalue(), max_bytes=MB, only={"header"})) == {"header"}


def test_a_trace_with_an_empty_structured_array_is_one_line(tmp_path):
    from env.trace import TraceError, default_trace_path, load_trace

    with zipfile.ZipFile(default_trace_path()) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    members["feat.npy"] = npy_head([], (1 << 40, 1 << 20))
    path = write_zip(tmp_path / "t.npz", members)
    with pytest.raises(TraceError, match="feat.npy holds") as err:
        load_trace(path)
    assert "\n" not in str(err.value)


# ---- traces --------------------------------------------------------------------------------------------------------


def trace_arrays() -> dict[str, np.ndarray]:
    from env.trace import default_trace_path

    with np.load(default_trace_path(), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_a_trace_array_past_what_its_header_allows_is_refused_before_unpacking(tmp_path):
    from env.trace import TraceError, default_trace_path, load_trace, trace_bytes

    bound = trace_bytes(load_trace().header)
    assert bound < 64 * MB  # 12 prompts x 128 tokens: not the flat GBs of before
    with zipfile.ZipFile(default_trace_path()) as zf:
        members = {n: zf.read(n) for n in zf.namelist() if n != "traj.npy"}
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        head = npy_head("<i4", (bound // 4 + MB,))
        zeros_member(zf, "traj.npy", len(head) + bound + 4 * MB, head)
    with pytest.raises(TraceError, match=f"allow {bound} bytes") as err:
        load_trace(path)
    assert "\n" not in str(err.value)
    assert peak_mb(lambda: load_trace(path)) < 8


def test_an_array_the_format_does_not_name_is_refused_unread(tmp_path):
    from env.trace import TraceError, default_trace_path, load_trace

    with zipfile.ZipFile(default_trace_path()) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    path = write_zip(tmp_path / "pad.npz", members, big={"pad.npy": BOMB})
    with pytest.raises(TraceError, match="member 'pad.npy' is not an array of the trace format"):
        load_trace(path)
    assert peak_mb(lambda: load_trace(path)) < 8


def test_a_tree_larger_than_its_drafter_shape_is_refused(tmp_path):
    """A chain of 2,000 nodes at position 0 (a valid tree, but drafter shape [16, 32, 0] proposes at most 512 draft
    nodes): refused at load, before replay's depth computation."""
    from env.trace import TraceError, load_trace

    a = trace_arrays()
    off, tok, par = a["tree/ngram/off"], a["tree/ngram/tokens"], a["tree/ngram/parents"]
    n, first = 2000, int(off[1])
    a["tree/ngram/parents"] = np.concatenate([np.arange(-1, n - 1), par[first:]]).astype(np.int16)
    a["tree/ngram/tokens"] = np.concatenate([np.zeros(n, np.int32), tok[first:]])
    a["tree/ngram/off"] = np.concatenate([[0], off[1:] - first + n]).astype(np.int64)
    np.savez_compressed(tmp_path / "chain.npz", **a)
    with pytest.raises(TraceError, match="position 0 has 2000 nodes, past the 513 that drafter shape") as err:
        load_trace(tmp_path / "chain.npz")
    assert "\n" not in str(err.value)


def test_int16_parents_bound_a_tree_whatever_the_shape_declares():
    from env.trace import TREE_NODES, tree_nodes

    assert tree_nodes([16, 32, 0]) == 513 and tree_nodes([16, 8, 24]) == 25 and tree_nodes([5, 1, 0]) == 6
    assert tree_nodes([1 << 20, 1, 0]) == TREE_NODES == 32769
    assert tree_nodes([1 << 20, 1 << 20, 0]) == TREE_NODES


def test_replay_depth_of_a_long_chain_is_linear_log(tmp_path):
    """Depth by pointer doubling: a 200,000-node chain (which no loaded trace holds, but a trace built in memory
    may) is ~18 rounds over the nodes; the level-by-level sweep it replaces took one pass per level (minutes)."""
    from env.replay import tree_index
    from env.trace import TreeArrays, load_trace

    trace = load_trace()
    t = trace.trees["ngram"]
    n, first = 200_000, int(t.off[1])
    trace.trees["ngram"] = TreeArrays(
        np.concatenate([[0], t.off[1:] - first + n]).astype(np.int64),
        np.concatenate([np.zeros(n, np.int32), t.tokens[first:]]),
        np.concatenate([np.arange(-1, n - 1), t.parents[first:]]).astype(np.int64),
    )
    ix = tree_index(trace, "ngram")
    assert np.array_equal(ix["depth"][:n], np.arange(n)) and not ix["maxrank"][:n].any()


def test_replay_depth_and_max_rank_match_a_walk_to_the_root():
    from env.replay import tree_index
    from env.trace import load_trace

    trace = load_trace()
    ix = tree_index(trace, "ngram")
    depth, maxrank = np.zeros_like(ix["depth"]), np.zeros_like(ix["maxrank"])
    for v, g in enumerate(ix["gpar"].tolist()):  # parents precede children
        if g >= 0:
            depth[v], maxrank[v] = depth[g] + 1, max(maxrank[g], ix["rank"][v])
    assert np.array_equal(ix["depth"], depth) and np.array_equal(ix["maxrank"], maxrank)
    assert depth.max() == 16 and maxrank.max() > 0


def test_a_policy_past_the_bound_is_not_written(tmp_path, monkeypatch):
    """Saving counts as loading does: a policy that load_policy would refuse is not written, and the file it would
    have replaced is left as it was."""
    import policies.base as base
    from policies.base import PolicyError, load_policy

    pol = load_policy(ROOT / "policies" / "data" / "linucb.zip")
    path = tmp_path / "p.zip"
    pol.save(path)
    before = path.read_bytes()
    monkeypatch.setattr(base, "POLICY_BYTES", 2048)
    with pytest.raises(PolicyError, match="too large to be read back"):
        pol.save(path)
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))
