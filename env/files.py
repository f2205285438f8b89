"""Writing result files atomically: a temporary name in the same folder, then ``os.replace``, so that a kill at
any point leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType

# ``atomic_write_bytes``'s temporary, .NAME.PID.dg.tmp: its own suffix, so that a folder's clean-up
# (``remove_stale_temporaries``) takes no other program's file
_TEMPORARY = re.compile(r"\..+\.([0-9]{1,9})\.dg\.tmp")


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    if path.is_dir():  # named as the error's file (not the temporary the replace would fail on)
        raise IsADirectoryError(errno.EISDIR, "a directory, not a file", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing_temporary(path, path.with_name(f".{path.name}.{os.getpid()}.dg.tmp")) as tmp:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


@contextmanager
def writing_temporary(path: str | Path, tmp: str | Path) -> Iterator[Path]:
    """Around writing ``tmp``, the temporary that then replaces ``path``: on any error (a full disk, a file size
    limit, Ctrl-C) the temporary is removed, and an OS error without a file name (a write's own carries none:
    "File too large", and no word of which) names ``path``."""
    try:
        yield Path(tmp)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        renamed = named(err, path)
        if renamed is err:
            raise
        raise renamed from err


def named(err: BaseException, path: str | Path) -> BaseException:
    """``err`` naming ``path`` when it is an OS error that names no file (a write's, a flush's); else ``err``."""
    if isinstance(err, OSError) and err.filename is None and err.errno is not None:
        return OSError(err.errno, err.strerror, str(path))  # (of the errno's own subclass: EPIPE, ...)
    return err


class Appending:
    """An append-only text file (a JSONL log of results) whose lines go to the OS as they are written (no buffer
    for a kill to lose), and whose write errors name the file (``named``): ``with Appending(path) as fh:
    fh.write(line)``. Text is UTF-8 (a file name's undecodable bytes written back as those bytes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by __exit__)

    def write(self, text: str) -> int:
        view = memoryview(text.encode("utf-8", errors="surrogateescape"))
        try:
            while view:
                n = self._fh.write(view)
                if not n:  # (a regular file takes a part or fails)
                    raise OSError(errno.EIO, "the file took none of a write")
                view = view[n:]
        except OSError as err:
            raise named(err, self.path) from err
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:  # (nothing is buffered)
        return None

    def __enter__(self) -> Appending:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._fh.close()


_MADE: list[Path] = []  # the folders ``make_folder`` made in this process, outermost first per call


def make_folder(folder: str | Path) -> Path:
    """``folder`` made with its missing parents (as ``mkdir -p``), each folder it made remembered, so that a
    command refused after making its output folder leaves none behind empty (``remove_made_folders``)."""
    folder = Path(folder)
    for level in [*reversed(folder.parents), folder]:
        if level.exists():
            continue
        try:
            level.mkdir()
        except FileExistsError:  # made by another process meanwhile: not ours to remove
            continue
        _MADE.append(level)
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)  # (the error it raises: a file in the way, permissions)
    return folder


def remove_made_folders() -> None:
    """Remove the folders ``make_folder`` made that are still empty, innermost first (a command refused in one
    line after making its output folder: an empty folder stayed behind); a folder with anything in it stays, and so
    does one another process holds. Called once the command has released its own folders."""
    from env.folder_lock import held_elsewhere  # (folder_lock imports this module)

    for folder in reversed(_MADE):
        if not held_elsewhere(folder):  # (another run that took the folder meanwhile keeps it)
            with suppress(OSError):
                folder.rmdir()
    _MADE.clear()


def forget_made_folders() -> None:
    """Keep the folders made so far (a command that ended well: an empty output folder is its result)."""
    _MADE.clear()


def remove_stale_temporaries(folder: str | Path, depth: int = 1) -> int:
    """Remove the temporaries (``.NAME.PID.dg.tmp``) that writers killed mid-write left in ``folder`` and in its
    subfolders up to ``depth`` levels down, those of processes no longer running (a live writer's stays; a pid
    reused since is left alone too); how many were removed. Called once as a command takes its folder
    (``env.folder_lock.claim_folder``): one listing per run, not one per write."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        m = _TEMPORARY.fullmatch(entry.name)
        try:
            if m and entry.is_file(follow_symlinks=False) and not _running(int(m.group(1))):
                os.unlink(entry.path)
                removed += 1
            elif depth > 0 and entry.is_dir(follow_symlinks=False):
                removed += remove_stale_temporaries(entry.path, depth - 1)
        except OSError:
            continue
    return removed


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (this one, or one we may not signal, counts; so does 0, a group)."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``text`` as UTF-8; a file name of bytes that are not UTF-8 (Python keeps them as surrogates) quoted in it is
    written back as those bytes, not an encoding error after the work is done."""
    return atomic_write_bytes(path, text.encode("utf-8", errors="surrogateescape"))


def jsonl_lines(path: str | Path, repair: bool = True) -> list[str]:
    """The complete lines of an append-only JSONL file (``[]`` when there is none); a torn last line (a kill
    mid-write) is left out and, with ``repair`` (the writer resuming), cut from the file so that the next append
    starts on a fresh line. A reader beside a run that may still be writing passes ``repair=False``: the torn line
    may be an append in progress. Lines end at ``\n`` only (JSON allows U+2028 and the like inside strings)."""
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        if repair:
            with path.open("r+b") as fh:
                fh.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    return data.decode("utf-8", errors="replace").split("\n")[:-1]


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (which version of a policy or a trace a result came from)."""
    import hashlib

    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def other_command(folder: str | Path, before: object, command: str | None) -> str | None:
    """The one line when ``before`` (a folder's settings, or None to read its ``settings.json``) were written by
    another draftgym command than ``command``; None when by this one, by none named, or ``command`` is None. (A
    sweep's folder from before the command was recorded names its study's storage, and nothing else.)"""
    import json

    if command is None:
        return None
    if before is None:
        try:
            before = json.loads((Path(folder) / "settings.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return None  # none, or damaged: the command's own settings check says so
    if not isinstance(before, dict):
        return None
    other = before.get("command", "sweep" if set(before) == {"storage", "study"} else None)
    if other is None or other == command:
        return None
    from drafters.base import shown

    said = (
        other
        if isinstance(other, str) and other.replace("-", "").replace(" ", "").isalnum()
        else shown(other, 40)
    )
    return (f"{folder} is draftgym {said[:40]}'s folder; draftgym {command} writes one of its own: use another "
            "output folder")  # fmt: skip


# settings of one method's drafter (``drafter_head.NAME``: a head's sha256): a resume may leave the method out or
# add it, as ``extendable`` mappings; an entry kept is compared, and the file keeps every one it has seen
PER_METHOD = "drafter_head."


def settings_conflict(
    folder: str | Path,
    settings: dict,
    started: bool,
    name: str = "settings.json",
    extendable: tuple[str, ...] = ("policies",),
    command: str | None = None,
) -> str | None:
    """A run folder remembers the settings its results depend on (``folder/name``). With results on disk
    (``started``) and other settings there, returns a one-line message naming what differs (the caller raises
    its own error); else writes the settings (a folder of results from before the file existed is taken as it
    is, and so is a setting its file does not name yet, with a note on stderr) and returns None. An ``extendable`` setting is a mapping (policy name -> file digest) to which a resume
    may add entries or leave some out (as it may methods); an entry of another value differs, and the file keeps
    every entry it has seen. ``command``: the draftgym command writing the folder, recorded as ``command``; a
    folder another command wrote is refused with or without results (a run's records in a sweep's folder
    replaced the sweep's settings, and the sweep no longer resumed)."""
    import json

    path = Path(folder) / name
    now = json.loads(json.dumps(settings, sort_keys=True, default=str))
    if command is not None:
        now["command"] = command
    before: object = None
    if path.is_file():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:  # JSON's and UTF-8's errors are ValueErrors
            from drafters.base import reason

            why = reason(err)
            return f"{path} is not readable JSON ({why}); delete it or use another output folder"
        if not isinstance(before, dict):
            return f"{path} is not a settings object; delete it or use another output folder"
        why = other_command(folder, before, command)
        if why:
            return why
    if started and isinstance(before, dict) and before != now:
        from drafters.base import shown

        def differs(k: str) -> bool:
            # a setting checked since this folder's file was written: recorded, not compared (as a folder from
            # before the file existed is taken as it is)
            if k not in before or (k.startswith(PER_METHOD) and k not in now):  # (a method left out)
                return False
            a, b = before.get(k), now.get(k)
            if k in extendable and isinstance(a, dict) and isinstance(b, dict):
                return any(n in b and b[n] != a[n] for n in a)
            return a != b

        def value(v: object, width: int) -> str:
            # a file's sha256 (a policy's, a head's): its first 12 digits tell them apart
            sha = isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)
            return f"sha256 {v[:12]}…" if sha else shown(v, width)

        def described(k: str) -> str:
            # a mapping (the policies' digests, a drafter's options): the entries that differ, by name
            a, b = before.get(k), now.get(k)
            if isinstance(a, dict) and isinstance(b, dict):
                grew = k in extendable  # (entries added or left out are not a difference)
                changed = [n for n in a if n in b and a[n] != b[n]]
                subs = sorted(changed if grew else [*changed, *(n for n in {*a, *b} if (n in a) != (n in b))])

                def side(d: dict, n: str) -> str:
                    return value(d[n], 60) if n in d else "(none)"

                def name(n: str) -> str:
                    return n if re.fullmatch(r"[\w:.@+-]{1,40}", n) else shown(n, 40)

                if subs:
                    return "; ".join(f"{k}.{name(n)}: {side(a, n)} there, {side(b, n)} now" for n in subs[:3])
            return f"{k}: {value(a, 100)} there, {value(b, 100) if k in now else '(none)'} now"

        keys = sorted(k for k in {*before, *now} if differs(k))
        diff = "; ".join(described(k) for k in keys[:3])
        more = f"; and {', '.join(keys[3:])}" if keys[3:] else ""
        if keys:
            return f"{folder} holds results run with other settings ({diff}{more})"
    if started and isinstance(before, dict) and before:
        # a setting this folder's file does not name yet (a folder from before it was recorded): taken, and said
        new = sorted(k for k in now if k not in before and not k.startswith(PER_METHOD))  # (a method added)
        if new:
            import sys

            print(f"note: {path} did not record {', '.join(new)}; its earlier results are taken as run with "
                  "the values now recorded", file=sys.stderr)  # fmt: skip
    if isinstance(
        before, dict
    ):  # an extendable mapping keeps the entries of earlier runs (their results stay)
        for k in extendable:
            if isinstance(before.get(k), dict) and isinstance(now.get(k), dict):
                now[k] = {**before[k], **now[k]}
        now.update({k: v for k, v in before.items() if k.startswith(PER_METHOD) and k not in now})
    if before != now:
        atomic_write_text(path, json.dumps(now, sort_keys=True, indent=1))
    return None
