"""``env.safe_zip``: zips, ``.npz`` arrays and JSON from hostile files are read as data within bounds, and every way
they fail is one ``ArchiveProblem`` — and through it, a one-line error of the loader (policies, stable-baselines3
zips, checkpoints, traces): members in compression methods ``zipfile`` decompresses whole before any size check,
encrypted members, archives declaring more than the bound, ``.npy`` headers declaring shapes their data does not
hold, object arrays, JSON nested past the recursion limit or with integers too long to convert."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from env.safe_zip import ArchiveProblem, npy_array, parse_json, read_npz, read_zip

ROOT = Path(__file__).resolve().parents[2]


def zip_bytes(members: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def lying_npy(shape: tuple[int, ...], data: bytes = b"\0" * 16) -> bytes:
    """A ``.npy`` whose header declares ``shape`` of float64 over ``data``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return buf.getvalue() + data


def test_arrays_round_trip_as_numpy_saves_them():
    arrays = {"a": np.arange(12, dtype=np.int16).reshape(3, 4), "b": np.asfortranarray(np.eye(3)),
              "s": np.array('{"x": 1}'), "e": np.zeros((0, 5), np.float32)}  # fmt: skip
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    got = read_npz(buf.getvalue(), max_bytes=1 << 20)
    assert sorted(got) == sorted(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v)
        assert got[k].flags.writeable


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_members_decompressed_whole_by_zipfile_are_refused(method):
    data = zip_bytes({"header.json": b"{}", "big": b"\0" * 100_000}, method)
    with pytest.raises(ArchiveProblem, match="only stored and deflated"):
        read_zip(data, max_bytes=1 << 30)


def test_an_archive_declaring_more_than_the_bound_is_refused_before_unpacking():
    data = zip_bytes({"a": b"\0" * 5000, "b": b"\0" * 5000})
    with pytest.raises(ArchiveProblem, match="declares 10000 bytes"):
        read_zip(data, max_bytes=8000)
    assert set(read_zip(data, max_bytes=8000, only={"a"})) == {"a"}  # members not asked for: not counted
    with pytest.raises(ArchiveProblem, match="3 members"):
        read_zip(zip_bytes({"a": b"", "b": b"", "c": b""}), max_bytes=100, max_members=2)


def test_encrypted_duplicate_and_torn_archives_are_one_problem_each():
    raw = bytearray(zip_bytes({"secret": b"data"}, zipfile.ZIP_STORED))
    raw[6] |= (
        0x1  # the encryption bit of the general purpose flags: in the local header and the central directory
    )
    raw[raw.find(b"PK\x01\x02") + 8] |= 0x1
    with pytest.raises(ArchiveProblem, match="encrypted"):
        read_zip(bytes(raw), max_bytes=100)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, pytest.warns(UserWarning):
        zf.writestr("twice", b"1")
        zf.writestr("twice", b"2")
    with pytest.raises(ArchiveProblem, match="twice"):
        read_zip(buf.getvalue(), max_bytes=100)
    whole = zip_bytes({"a": b"x" * 4000})
    for cut in (len(whole) // 2, 30):
        with pytest.raises(ArchiveProblem, match="not a readable zip"):
            read_zip(whole[:cut], max_bytes=1 << 20)
    flipped = bytearray(zip_bytes({"a": bytes(range(256)) * 64}))
    flipped[60:90] = b"\xff" * 30  # the deflate stream
    with pytest.raises(ArchiveProblem):
        read_zip(bytes(flipped), max_bytes=1 << 20)


def test_npy_headers_must_match_their_data():
    with pytest.raises(ArchiveProblem, match=r"declares shape \(1099511627776,\)"):
        npy_array(lying_npy((1 << 40,)), "traj.npy")  # nothing allocated from the declared shape
    with pytest.raises(ArchiveProblem, match="holds 16 bytes"):
        npy_array(lying_npy((3,)))
    assert npy_array(lying_npy((2,))).tolist() == [0.0, 0.0]
    obj = np.empty(2, dtype=object)
    buf = io.BytesIO()
    np.save(buf, obj, allow_pickle=True)
    with pytest.raises(ArchiveProblem, match="Python objects"):
        npy_array(buf.getvalue())
    with pytest.raises(ArchiveProblem, match="not a .npy array"):
        npy_array(b"PK\3\4 not an array")
    with pytest.raises(ArchiveProblem, match="is not a .npy array"):
        read_npz(zip_bytes({"notes.txt": b"hello"}), max_bytes=100)


def test_hostile_json_is_a_problem_not_a_crash():
    assert parse_json(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for raw in (b"[" * 200_000, b"9" * 5000, b"\xff\xfe", b'{"a": ', b"NaN-ish"):
        with pytest.raises(ArchiveProblem, match="not valid JSON"):
            parse_json(raw)


def test_loaders_turn_archive_problems_into_their_own_one_line_errors(tmp_path):
    from env.trace import TraceError, load_trace
    from policies.base import PolicyError, load_policy

    shipped = ROOT / "policies" / "data" / "linucb.zip"
    with zipfile.ZipFile(shipped) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    bad = tmp_path / "bzip.zip"
    bad.write_bytes(zip_bytes(members, zipfile.ZIP_BZIP2))
    with pytest.raises(PolicyError, match="only stored and deflated") as err:
        load_policy(bad)
    assert "\n" not in str(err.value)
    deep = tmp_path / "deep.zip"
    deep.write_bytes(zip_bytes({**members, "header.json": b"[" * 100_000}))
    with pytest.raises(PolicyError, match="header.json is corrupted"):
        load_policy(deep)
    head = json.loads(members["header.json"])
    for field, value in (("obs_size", 1e400), ("features", [[1], [2]]), ("arms", "ngram-d3")):
        odd = tmp_path / f"odd-{field}.zip"
        odd.write_bytes(zip_bytes({**members, "header.json": json.dumps({**head, field: value}).encode()}))
        with pytest.raises(PolicyError, match="mangles a field"):
            load_policy(odd)
    sb3 = tmp_path / "sb3.zip"  # a stable-baselines3 zip whose policy.pth claims 4 GB it does not hold
    sb3.write_bytes(zip_bytes({"policy.pth": b"x", "data": b"{}"}))
    raw = bytearray(sb3.read_bytes())
    i = raw.find(b"PK\x01\x02")  # the central directory's entry of policy.pth: its unpacked size at +24
    raw[i + 24 : i + 28] = (0xFFFFFFF0).to_bytes(4, "little")
    sb3.write_bytes(bytes(raw))
    with pytest.raises(PolicyError, match="not a readable stable-baselines3 zip") as err:
        load_policy(sb3)
    assert "\n" not in str(err.value)
    trace = tmp_path / "trace.npz"
    with zipfile.ZipFile(ROOT / "env" / "data" / "builtin_trace.npz") as zf:
        arrays = {n: zf.read(n) for n in zf.namelist()}
    arrays["traj.npy"] = lying_npy((1 << 40,))
    trace.write_bytes(zip_bytes(arrays))
    with pytest.raises(TraceError, match="declares shape") as err:
        load_trace(trace)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [((-2, -4), 64), ((0, 9223372036854775808), 0), ((3000000000, 0, 3000000000, 3000000000), 0)],
)
def test_npy_headers_of_impossible_shapes_are_archive_problems(shape, nbytes):
    """Negative dimensions whose product matches the data, or shapes past numpy's limits, are an ``ArchiveProblem``
    (one line for the user), not numpy's ValueError from the reshape."""
    import io

    import numpy as np

    from env.safe_zip import ArchiveProblem, npy_array

    b = io.BytesIO()
    np.lib.format.write_array_header_1_0(b, {"descr": "<f8", "fortran_order": False, "shape": shape})
    with pytest.raises(ArchiveProblem):
        npy_array(b.getvalue() + b"\0" * nbytes)
