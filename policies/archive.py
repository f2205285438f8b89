"""Policy files as data: the zip archive every policy and training checkpoint is saved in, read back bounded.

``write_archive`` writes a zip of one JSON head member and data members atomically; ``read_archive`` reads one
back as data (JSON, and members the caller decodes: ``.npz`` arrays through ``read_npz`` with
``allow_pickle=False``, safetensors), checking its format and version and, for a policy file, that every member is
one its head's ``payload`` names, all within a bound on the bytes unpacked. Nothing here unpickles. What a policy
file's head holds, and how a policy is restored from it, is ``policies.base``.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from env.files import writing_temporary
from policies.errors import PolicyError


def write_archive(
    path: Path,
    head: str,
    meta: dict[str, Any],
    files: dict[str, bytes],
    compression: int = zipfile.ZIP_DEFLATED,
    check: Callable[[Path], None] | None = None,
) -> None:
    """A zip of the JSON member ``head`` (``meta``) and data members, written atomically (temporary name, rename);
    ``check(tmp)`` may refuse it before it takes ``path``'s place (``path`` is then left as it was)."""
    with writing_temporary(path, path.with_name(path.name + ".tmp")) as tmp:  # (removed if anything fails)
        with zipfile.ZipFile(tmp, "w", compression=compression) as zf:
            zf.writestr(head, json.dumps(meta, indent=2))
            for name, data in sorted(files.items()):
                zf.writestr(name, data)
        if check is not None:
            check(tmp)
        tmp.replace(path)


# A policy file unpacks to at most POLICY_BYTES, counting the archives inside it (a bandit's state.npz, an old
# file's model.zip and its policy.pth) and each such archive's own bytes too: the largest shipped is 46 KB, a PPO
# policy of net_arch 2048,2048 on the default observation ~35 MB of float32 tensors (~70 MB counted in a plain
# stable-baselines3 zip, ~9x its weights in an old file with its optimizer's state). Saving refuses a policy past it,
# so every policy draftgym writes loads. A training checkpoint holds a DQN replay buffer (buffer_size up to
# 2**26 rows): up to GBs, so ARCHIVE_BYTES. Either is read into memory; a file declaring more is refused before its
# members are unpacked. A compression-ratio guard is not added: deflate tops out near 1030:1, which a legitimate
# array of zeros (an untrained bandit's counts) reaches too, and these bounds already cap the memory.
POLICY_BYTES = 256 << 20
ARCHIVE_BYTES = 4 << 30
ARCHIVE_MEMBERS = 256
# what policies.sb3_files reads of a plain stable-baselines3 zip
SB3_MEMBERS = ("policy.pth", "data", "_stable_baselines3_version")


def read_archive(
    path: Path,
    head: str,
    fmt: str,
    version: int,
    what: str,
    *,
    max_bytes: int | None = None,
    named: bool = False,
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The JSON member ``head`` of a zip and its other members, as data (nothing is unpickled), checked to be
    ``fmt`` at ``version``; every problem is a one-line ``PolicyError`` naming the file (``what`` it should be).
    At most ``max_bytes`` (never past ``ARCHIVE_BYTES``) are unpacked. ``named``: what the whole archive declares
    is checked, ``head`` read, then only the members its ``payload`` names (one it does not name is refused),
    within ``max_bytes`` in all, the archives inside them included."""
    from env.safe_zip import ArchiveProblem, member_names, parse_json, read_zip, unpacked_bytes

    max_bytes = ARCHIVE_BYTES if max_bytes is None else min(max_bytes, ARCHIVE_BYTES)
    try:
        if named:
            names = member_names(path, max_members=ARCHIVE_MEMBERS)
            unpacked_bytes(path, max_bytes=max_bytes, max_members=ARCHIVE_MEMBERS)  # (its directory alone)
            files = read_zip(path, max_bytes=max_bytes, max_members=ARCHIVE_MEMBERS, only={head})
        else:
            files = read_zip(path, max_bytes=max_bytes, max_members=ARCHIVE_MEMBERS)
    except ArchiveProblem as err:
        raise PolicyError(f"{path} is not a readable {what} ({err})") from None
    if head not in files:
        raise PolicyError(f"{path} is not a {what} (no {head})")
    raw = files.pop(head)
    try:
        meta = parse_json(raw)
    except ArchiveProblem as err:
        raise PolicyError(f"{path}: {head} is corrupted ({err})") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != fmt:
        raise PolicyError(f"{path} is not a {what} (format {found!r})")
    if meta.get("format_version") != version:
        raise PolicyError(
            f"{path} has {what} format version {meta.get('format_version')}; this draftgym reads {version}"
        )
    if not named:
        return meta, files
    payload = meta.get("payload") or {}
    if not isinstance(payload, dict) or not all(isinstance(d, str) for d in payload.values()):
        raise PolicyError(f"{path}: {head} lacks or mangles a field (payload must map members to checksums)")
    unknown = sorted(set(names) - set(payload) - {head})
    if unknown:
        raise PolicyError(
            f"{path} is not a readable {what}: member {unknown[0]!r} is not in {head}'s payload "
            f"(named: {', '.join(sorted(payload)) or 'none'})"
        )
    try:  # the bound on the whole first, the archives inside included; then the members, each level on its own
        unpacked_bytes(
            path, max_bytes=max_bytes, levels=3, only={head, *payload}, max_members=ARCHIVE_MEMBERS
        )
        files = read_zip(path, max_bytes=max_bytes, max_members=ARCHIVE_MEMBERS, only=set(payload) - {head})
    except ArchiveProblem as err:
        raise PolicyError(f"{path} is not a readable {what} ({err})") from None
    return meta, files


def is_policy_zip(path: str | Path) -> bool:
    """A zip holding a draftgym policy's ``header.json`` (what ``save`` writes): a file a policy may replace."""
    if not Path(path).is_file():  # (a FIFO would block the read)
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            return "header.json" in zf.namelist()
    except (OSError, zipfile.BadZipFile, EOFError):
        return False


def is_sb3_zip(path: str | Path) -> bool:
    """A zip with stable-baselines3's ``policy.pth`` and no draftgym ``header.json`` (a ``model.save`` file)."""
    if not Path(path).is_file():  # (a FIFO would block the read)
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
    except (OSError, zipfile.BadZipFile, EOFError):
        return False
    return "policy.pth" in names and "header.json" not in names


def one_line(err: BaseException) -> str:
    """An error's type and the first line of its message (torch's are paragraphs), for one-line user errors."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def read_npz(data: bytes, what: str = "the policy's arrays") -> dict[str, np.ndarray]:
    """An ``npz_bytes`` member as arrays (``env.safe_zip``: bounded, no objects); a bad one is a ``PolicyError``."""
    from env.safe_zip import ArchiveProblem
    from env.safe_zip import read_npz as safe_read_npz

    try:
        return safe_read_npz(data, max_bytes=ARCHIVE_BYTES)
    except ArchiveProblem as err:
        raise PolicyError(f"{what}: corrupted ({err})") from None
