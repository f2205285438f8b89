"""One command at a time in a folder it resumes from. Two processes writing one run folder at once (the same command
started twice, a scheduler's retry while the first still runs) would each append the same prompts' records and time
their methods on shared cores; a trace's parts or a head's training state would be written by both.

``claim_folder`` takes an exclusive ``flock`` on the folder itself (no file is made in it), held until
``release_folder``/``release_folders`` (the command lines release the folders a command claimed when it returns) or
the process ends — however it ends: the kernel drops the lock of a process killed with ``kill -9``, so there is
never a stale lock to delete (``claim_file`` holds a file replaced by renaming through a lock file beside it, which
a killed holder leaves behind unlocked). Another process holding it: ``FolderBusy``, one line naming the folder
and, where ``/proc/locks`` shows it, that process. A file system that cannot lock (``flock`` refused for another
reason than the lock being held) is used unlocked, as before. Taking a folder removes the temporaries that
writers killed mid-write left in it (``env.files.remove_stale_temporaries``): no other run writes there now.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from env.files import remove_stale_temporaries

_HELD: dict[Path, int] = {}  # folder (resolved) -> its open descriptor, while this process holds it


class FolderBusy(Exception):
    """Another process is writing the folder (one line: the folder and that process's pid)."""


def claim_folder(folder: str | Path, what: str) -> None:
    """Hold ``folder`` (an existing directory) for this process; ``what`` names it in the error (``--out runs/x``).
    Claiming a folder this process holds already is a no-op (a command resumed in the same process)."""
    key = Path(folder).resolve()
    if key in _HELD:
        return
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if _locked(fd, what, "folder"):
        _HELD[key] = fd
        remove_stale_temporaries(key)  # held: no other run writes here; what killed writers left is rubbish


def _locked(fd: int, what: str, kind: str) -> bool:
    """Lock ``fd`` (exclusive, not waiting): True when locked; False, ``fd`` closed, on a file system without
    locks; ``FolderBusy`` naming ``what`` and the holder, ``fd`` closed, when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        st = os.fstat(fd)
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False  # no locks on this file system
        holder = _holder(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
        raise FolderBusy(
            f"{what} is in use by another process{f' (pid {holder})' if holder else ''} writing the same results: "
            f"wait for it to end, or choose another {kind}"
        ) from None


def held_elsewhere(folder: str | Path) -> bool:
    """Whether another process holds ``folder`` (``claim_folder``). Asked once this process released its own: a
    lock is held by an open of the folder, so one this process still holds answers True too. False on a file
    system without locks."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        if _locked(fd, str(folder), "folder"):
            os.close(fd)  # (drops the lock just taken)
    except FolderBusy:
        return True
    return False


def _holder(where: str) -> int | None:
    """The pid ``/proc/locks`` shows holding a ``flock`` on ``where`` (``MAJOR:MINOR:INODE``, the device in hex), or
    None (none shown, or no such file). Its lines read ``1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF``."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == where and f[4].isdigit():
            return int(f[4])
    return None


def claim_file(path: str | Path, what: str) -> Path:
    """Hold ``path``, a file this process rewrites by renaming a new version over it (``calibrate --batch``'s
    ``OUT.partial``): a lock on the file itself would stay with the version renamed away, so the lock is on a
    file beside it, ``PATH.lock``, made here and removed at release (``release_folder`` of the path returned).
    A ``PATH.lock`` its holder removed between this process opening and locking it is opened again."""
    lock = Path(path).resolve()
    lock = lock.with_name(lock.name + ".lock")
    if lock in _HELD:
        return lock
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if not _locked(fd, what, "output"):
            return lock
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    _HELD[lock] = fd
    _LOCK_FILES.add(lock)
    return lock


_LOCK_FILES: set[Path] = set()  # the held paths that are ``claim_file``'s lock files (removed at release)


def release_folder(folder: str | Path) -> None:
    """Release ``folder`` (or a ``claim_file`` lock) if this process holds it (before the folder is removed)."""
    key = Path(folder).resolve()
    fd = _HELD.pop(key, None)
    if fd is not None:
        if key in _LOCK_FILES:  # removed while held: another process never takes a lock file on its way out
            _LOCK_FILES.discard(key)
            key.unlink(missing_ok=True)
        os.close(fd)  # closing the descriptor drops its lock


def held_folders() -> set[Path]:
    """The folders this process holds now."""
    return set(_HELD)


def release_folders(keep: Collection[Path] = ()) -> None:
    """Release every folder this process holds but ``keep`` (``held_folders()`` before a command: a command returning,
    however it returns, releases what it claimed, not what its in-process caller holds)."""
    for folder in [f for f in _HELD if f not in keep]:
        release_folder(folder)


__all__ = [
    "FolderBusy",
    "claim_file",
    "claim_folder",
    "held_elsewhere",
    "held_folders",
    "release_folder",
    "release_folders",
    "taking_turns",
]


_TURNS = threading.local()  # .held: the lock files this thread holds (a nested turn on one runs unlocked)


@contextmanager
def taking_turns(lock: str | Path) -> Iterator[None]:
    """Within the block, an exclusive ``flock`` on the file ``lock`` (made if missing), waited for: processes that
    would each do the same one-time job (convert the embedded model, probe a matmul) do it one at a time, and the
    later ones find it done (each checks again inside). The kernel drops the lock of a killed holder; other threads
    of this process wait as other processes do; a turn nested in one this thread holds on the same file runs as
    part of it (a second descriptor's ``flock`` would wait for the first forever). A lock file that cannot be made
    or locked (a read-only folder, a file system without locks): the block runs unlocked."""
    key = os.path.abspath(lock)
    held = _TURNS.__dict__.setdefault("held", set())
    fd = None
    if key not in held:
        try:
            Path(key).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(key, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)  # (flock needs no write access)
        except OSError:
            fd = None  # unlocked
    if fd is None:
        yield
        return
    try:
        with suppress(OSError):  # (no locks on this file system: unlocked, as before)
            fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(key)
        yield
    finally:
        held.discard(key)
        os.close(fd)  # (closing drops the lock)
