"""Reading zip archives, ``.npz`` arrays and JSON from files we did not write, as data and within bounds.

Every loader of a user-supplied file (policies, checkpoints, stable-baselines3 zips, traces) reads through here,
so that a hostile or corrupted file is one ``ArchiveProblem`` (a one-line message; the caller raises its own
error class with the file's name) and never more memory than the caller allows:

- only stored and deflated members are read (bzip2 and lzma members are decompressed whole by ``zipfile``
  before any size check; encrypted ones need a password), each in chunks, counting the bytes it really unpacks
  against the size it declares and against the caller's total;
- a ``.npy`` member is parsed by its header (``numpy.lib.format``) and refused unless it holds numbers (bool,
  int, uint, float) or text (``U``, a trace's header) of a non-zero item size, and its data is exactly the size
  the header declares: nothing is unpickled, and nothing is allocated or walked from a declared shape alone (an
  item size of 0 would let any shape match no data);
- ``unpacked_bytes`` counts what a zip unpacks to at every level (an ``.npz`` or ``.pth`` inside a zip), so that
  a caller can bound the whole before the inner archives are read, each with its own allowance;
- JSON that is too deep or has an over-long integer is a problem like any other malformed JSON.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from drafters.base import reason

READ_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
CHUNK = 1 << 20
ZIP_MAGIC = b"PK\x03\x04"  # a zip's first local header: an .npz, a torch .pth, stable-baselines3's model.zip
# .npy item kinds read: bool, int, uint, float, and text (a trace's JSON header), all that draftgym's files hold
NPY_KINDS = "biufU"


class ArchiveProblem(ValueError):
    """What is wrong with an archive, in one line (without the file's name: the caller adds it)."""


def _members(zf: zipfile.ZipFile, max_members: int, only: Collection[str] | None) -> list[zipfile.ZipInfo]:
    """A zip's members (``only``: those names), refused past ``max_members`` in its directory."""
    infos = zf.infolist()
    if len(infos) > max_members:
        raise ArchiveProblem(f"{len(infos)} members (at most {max_members} are read)")
    return [i for i in infos if only is None or i.filename in only]


def read_zip(
    src: str | Path | bytes,
    *,
    max_bytes: int,
    max_members: int = 256,
    only: Collection[str] | None = None,
) -> dict[str, bytes]:
    """The members of a zip (``only``: just those names, the others neither counted nor unpacked), as bytes.
    Refused: more than ``max_members`` members, more than ``max_bytes`` unpacked (declared or real), a member
    that unpacks to more than it declares, compression other than stored/deflated, encryption, duplicate names,
    anything ``zipfile``/``zlib`` cannot read."""
    try:
        with zipfile.ZipFile(io.BytesIO(src) if isinstance(src, bytes) else src) as zf:
            wanted = _members(zf, max_members, only)
            declared = sum(i.file_size for i in wanted)
            if declared > max_bytes:
                raise ArchiveProblem(f"declares {declared} bytes unpacked (at most {max_bytes} are read)")
            out: dict[str, bytes] = {}
            total = 0
            for info in wanted:
                if info.filename in out:
                    raise ArchiveProblem(f"member {info.filename!r} appears twice")
                out[info.filename] = _unpack(zf, info, max_bytes - total, max_bytes)
                total += len(out[info.filename])
            return out
    except ArchiveProblem:
        raise
    except MemoryError:
        raise ArchiveProblem("too large to read into memory") from None
    except (
        Exception
    ) as err:  # BadZipFile, EOFError, OSError, zlib.error, NotImplementedError, RuntimeError, ...
        raise ArchiveProblem(f"not a readable zip ({reason(err, kind=True)})") from None


def _check_method(info: zipfile.ZipInfo) -> None:
    if info.flag_bits & 0x1:
        raise ArchiveProblem(f"member {info.filename!r} is encrypted")
    if info.compress_type not in READ_METHODS:
        raise ArchiveProblem(
            f"member {info.filename!r} uses compression method {info.compress_type} "
            "(only stored and deflated members are read)"
        )


def _unpack(zf: zipfile.ZipFile, info: zipfile.ZipInfo, budget: int, bound: int) -> bytes:
    """One member, in chunks, held to the size it declares and to ``budget`` (what is left of ``bound``)."""
    name = info.filename
    _check_method(info)
    buf = bytearray()
    with zf.open(info) as fh:
        while chunk := fh.read(CHUNK):
            buf += chunk
            if len(buf) > info.file_size:
                raise ArchiveProblem(f"member {name!r} unpacks to more than it declares")
            if len(buf) > budget:
                raise ArchiveProblem(f"unpacks to more than {bound} bytes (the most that are read)")
    if len(buf) != info.file_size:
        raise ArchiveProblem(
            f"member {name!r} unpacks to {len(buf)} bytes, not the {info.file_size} it declares"
        )
    return bytes(buf)


def member_names(src: str | Path | bytes, *, max_members: int = 256) -> list[str]:
    """The names of a zip's members (read from its directory: nothing is unpacked)."""
    try:
        with zipfile.ZipFile(io.BytesIO(src) if isinstance(src, bytes) else src) as zf:
            return [i.filename for i in _members(zf, max_members, None)]
    except ArchiveProblem:
        raise
    except Exception as err:
        raise ArchiveProblem(f"not a readable zip ({reason(err, kind=True)})") from None


def unpacked_bytes(
    src: str | Path | bytes,
    *,
    max_bytes: int,
    levels: int = 1,
    only: Collection[str] | None = None,
    max_members: int = 4096,
) -> int:
    """What the zip ``src`` unpacks to (``only``: just those members), as its members declare (``read_zip`` holds
    each to its declaration), plus, ``levels`` deep, what the zips among them unpack to in turn (an ``.npz``, a
    torch ``.pth``, a zip in a zip): the whole that reading it and its inner archives may take, where each
    reader bounds only its own level. An inner zip is unpacked to count its members (within what is left of
    ``max_bytes``); nothing else is. Past ``max_bytes``: an ``ArchiveProblem`` naming the bound."""
    try:
        total = _count(src, max_bytes, levels, only, max_members)
    except ArchiveProblem:
        raise
    except MemoryError:
        raise ArchiveProblem("too large to read into memory") from None
    except Exception as err:
        raise ArchiveProblem(f"not a readable zip ({reason(err, kind=True)})") from None
    if total > max_bytes:
        inside = ", counting the archives inside it" if levels > 1 else ""
        raise ArchiveProblem(
            f"declares more than {max_bytes} bytes unpacked{inside} (the most that are read)"
        )
    return total


def _count(
    src: str | Path | bytes, budget: int, levels: int, only: Collection[str] | None, max_members: int
) -> int:
    """``unpacked_bytes``' count, stopped as soon as it passes ``budget``."""
    with zipfile.ZipFile(io.BytesIO(src) if isinstance(src, bytes) else src) as zf:
        wanted = _members(zf, max_members, only)
        total = sum(i.file_size for i in wanted)
        for info in wanted if levels > 1 else ():
            if total > budget:
                break
            if info.file_size < len(ZIP_MAGIC):
                continue
            _check_method(info)
            with zf.open(info) as fh:
                if fh.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                    continue
            inner = _unpack(zf, info, info.file_size, budget)
            try:
                total += _count(inner, budget - total, levels - 1, None, max_members)
            except ArchiveProblem as err:
                raise ArchiveProblem(f"member {info.filename!r}: {err}") from None
            except Exception as err:
                raise ArchiveProblem(
                    f"member {info.filename!r} is not a readable zip ({reason(err, kind=True)})"
                ) from None
        return total


def npy_array(data: bytes, name: str = "array") -> np.ndarray:
    """One ``.npy`` file's bytes as an array (a writable copy), checked against its own header."""
    fh = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ArchiveProblem(f"{name} is .npy format {version}, not 1.0 or 2.0")
    except ArchiveProblem:
        raise
    except Exception as err:
        raise ArchiveProblem(f"{name} is not a .npy array ({reason(err, kind=True)})") from None
    if dtype.hasobject:
        raise ArchiveProblem(f"{name} holds Python objects (refused: reading it would unpickle)")
    if dtype.kind not in NPY_KINDS or dtype.itemsize == 0:
        raise ArchiveProblem(
            f"{name} holds {dtype.str} items (only bool, integer, float and text arrays of a non-zero size are read)"
        )
    if any(int(s) < 0 or int(s) > 1 << 40 for s in shape):
        raise ArchiveProblem(f"{name} declares shape {tuple(shape)}: a dimension out of range")
    count = math.prod(int(s) for s in shape)
    rest = memoryview(data)[fh.tell() :]
    # items of >= 1 byte: at most len(data) elements, whatever the shape declares
    if count * dtype.itemsize != len(rest):
        raise ArchiveProblem(
            f"{name} declares shape {tuple(shape)} of {dtype} ({count * dtype.itemsize} bytes) "
            f"but holds {len(rest)} bytes"
        )
    try:  # (numpy's own limits on a shape, e.g. a zero dimension beside ones past what an index holds)
        flat = np.frombuffer(rest, dtype=dtype, count=count)
        return flat.reshape(shape, order="F" if fortran else "C").copy()
    except (ValueError, OverflowError, MemoryError) as err:
        raise ArchiveProblem(
            f"{name} cannot be read as shape {tuple(shape)} ({reason(err, kind=True)})"
        ) from None


def read_npz(
    src: str | Path | bytes,
    *,
    max_bytes: int,
    max_members: int = 4096,
    only: Collection[str] | None = None,
) -> dict[str, np.ndarray]:
    """An ``np.savez`` archive as ``{name: array}`` (``read_zip``'s bounds, ``npy_array``'s checks; ``only``: just
    the arrays of those names, the others neither counted nor unpacked); a member that is not ``NAME.npy`` is
    refused."""
    out = {}
    members = None if only is None else {f"{n}.npy" for n in only}
    for member, data in read_zip(src, max_bytes=max_bytes, max_members=max_members, only=members).items():
        if not member.endswith(".npy"):
            raise ArchiveProblem(f"member {member!r} is not a .npy array")
        out[member[: -len(".npy")]] = npy_array(data, member)
    return out


def parse_json(raw: bytes | str) -> Any:
    """``json.loads``, with every way it fails on hostile text (bad UTF-8, syntax, nesting deeper than Python's
    recursion limit, an integer of more digits than Python converts) an ``ArchiveProblem``."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ArchiveProblem(f"not valid JSON ({reason(err, kind=True)})") from None
