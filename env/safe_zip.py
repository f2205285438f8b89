"""Reading zip archives, ``.npz`` arrays and JSON from files we did not write, as data and within bounds.

Every loader of a user-supplied file (policies, checkpoints, stable-baselines3 zips, traces) reads through here,
so that a hostile or corrupted file is one ``ArchiveProblem`` (a one-line message; the caller raises its own
error class with the file's name) and never more memory than the caller allows:

- only stored and deflated members are read (bzip2 and lzma members are decompressed whole by ``zipfile``
  before any size check; encrypted ones need a password), each in chunks, counting the bytes it really unpacks
  against the size it declares and against the caller's total;
- a ``.npy`` member is parsed by its header (``numpy.lib.format``) and refused unless its data is exactly the
  size the header declares and holds no Python objects (nothing is unpickled, nothing allocated from a declared
  shape alone);
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


class ArchiveProblem(ValueError):
    """What is wrong with an archive, in one line (without the file's name: the caller adds it)."""


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
            infos = zf.infolist()
            if len(infos) > max_members:
                raise ArchiveProblem(f"{len(infos)} members (at most {max_members} are read)")
            wanted = [i for i in infos if only is None or i.filename in only]
            declared = sum(i.file_size for i in wanted)
            if declared > max_bytes:
                raise ArchiveProblem(f"declares {declared} bytes unpacked (at most {max_bytes} are read)")
            out: dict[str, bytes] = {}
            total = 0
            for info in wanted:
                name = info.filename
                if name in out:
                    raise ArchiveProblem(f"member {name!r} appears twice")
                if info.flag_bits & 0x1:
                    raise ArchiveProblem(f"member {name!r} is encrypted")
                if info.compress_type not in READ_METHODS:
                    raise ArchiveProblem(
                        f"member {name!r} uses compression method {info.compress_type} "
                        "(only stored and deflated members are read)"
                    )
                buf = bytearray()
                with zf.open(info) as fh:
                    while chunk := fh.read(CHUNK):
                        buf += chunk
                        total += len(chunk)
                        if len(buf) > info.file_size:
                            raise ArchiveProblem(f"member {name!r} unpacks to more than it declares")
                        if total > max_bytes:
                            raise ArchiveProblem(
                                f"unpacks to more than {max_bytes} bytes (the most that are read)"
                            )
                if len(buf) != info.file_size:
                    raise ArchiveProblem(
                        f"member {name!r} unpacks to {len(buf)} bytes, not the {info.file_size} it declares"
                    )
                out[name] = bytes(buf)
            return out
    except ArchiveProblem:
        raise
    except MemoryError:
        raise ArchiveProblem("too large to read into memory") from None
    except (
        Exception
    ) as err:  # BadZipFile, EOFError, OSError, zlib.error, NotImplementedError, RuntimeError, ...
        raise ArchiveProblem(f"not a readable zip ({reason(err, kind=True)})") from None


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
    if any(int(s) < 0 or int(s) > 1 << 40 for s in shape):
        raise ArchiveProblem(f"{name} declares shape {tuple(shape)}: a dimension out of range")
    count = math.prod(int(s) for s in shape)
    rest = memoryview(data)[fh.tell() :]
    if count * dtype.itemsize != len(rest):
        raise ArchiveProblem(
            f"{name} declares shape {tuple(shape)} of {dtype} ({count * dtype.itemsize} bytes) "
            f"but holds {len(rest)} bytes"
        )
    try:  # (numpy's own limits on a shape, e.g. more elements than an index holds)
        flat = np.frombuffer(rest, dtype=dtype, count=count)
        return flat.reshape(shape, order="F" if fortran else "C").copy()
    except (ValueError, MemoryError) as err:
        raise ArchiveProblem(
            f"{name} cannot be read as shape {tuple(shape)} ({reason(err, kind=True)})"
        ) from None


def read_npz(src: str | Path | bytes, *, max_bytes: int, max_members: int = 4096) -> dict[str, np.ndarray]:
    """An ``np.savez`` archive as ``{name: array}`` (``read_zip``'s bounds, ``npy_array``'s checks); a member
    that is not ``NAME.npy`` is refused."""
    out = {}
    for member, data in read_zip(src, max_bytes=max_bytes, max_members=max_members).items():
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
