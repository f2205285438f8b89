"""What ``draftgym report`` reads of a run or sweep directory, bounded and checked: ``load_run`` (a run summarized
again from its records when its summary is missing or older), every file read within a size (a FIFO or device
refused before a byte is read), each field the report shows checked to be of its type and finite, and the names
read from files made safe to show in Markdown (one line, no table break or code span end). Every problem is a
one-line ``ReportError``; the report itself is ``experiments.report``."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

# the most the report reads of a file (a sparse or runaway file would be read whole, or for ever): far above any
# run's summary, sweep, config or provenance, and any run's records
MAX_JSON_BYTES = 64 << 20
MAX_RECORDS_BYTES = 1 << 30


class ReportError(ValueError):
    """A path that is not a run or sweep directory; meant for the user."""


def _unfinished_sweep(path: Path) -> bool:
    """A sweep's folder without its sweep.json (written at the end): its config and study, or its settings.json
    naming the sweep command (a study in a --storage before any trial ended)."""
    if not (path / "config.toml").is_file():
        return False
    if any((path / n).is_file() for n in ("trials.jsonl", "study.db")):
        return True
    try:
        settings = json.loads((path / "settings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(settings, dict) and settings.get("command") == "sweep"


def load_run(path: Path) -> dict[str, Any]:
    """What the report needs of one directory: kind (run | sweep), name, summary or trials, provenance."""
    from env.folder_lock import FolderBusy
    from experiments.errors import is_user_error, one_line

    if not path.is_dir():
        raise ReportError(f"{path} is not a directory")
    for name in READ_FILES:  # a FIFO blocks the read, a device (a link to /dev/zero) never ends it
        if (path / name).exists() and not (path / name).is_file():
            raise ReportError(
                f"{path / name} is not a regular file (a folder, FIFO, device or socket); not read"
            )
    prov = _provenance(path)
    if (path / "sweep.json").is_file():
        data = _read(path / "sweep.json", {"study": str})
        _check_sweep(data, path / "sweep.json")
        return {"kind": "sweep", "path": path, "name": _name(data["study"]), "data": data, "provenance": prov}
    has_records = (path / "config.toml").is_file() and (path / "records.jsonl").is_file()
    if has_records:  # read whole by the modules that summarize them
        _check_size(path / "records.jsonl", MAX_RECORDS_BYTES)
        _check_size(path / "config.toml", MAX_JSON_BYTES)
    stale, data = None, None
    if not (path / "summary.json").is_file():
        if not has_records and _unfinished_sweep(path):
            from env.folder_lock import held_elsewhere

            if held_elsewhere(path):
                raise ReportError(
                    f"{path} is a sweep still running (no sweep.json until it ends): report it then"
                )
            raise ReportError(
                f"{path} is a sweep that has not finished (no sweep.json yet: it is written at the end); rerun its "
                f"draftgym sweep command (the same config, --out {path}) to finish it, then report it"
            )
        if not has_records:
            raise ReportError(
                f"{path} is not a run directory (no summary.json or sweep.json, and no config.toml with records.jsonl; "
                "a bench folder's table is its bench.json)"
            )
        try:
            _summarize_partial(path)
        except FolderBusy as err:  # a run's first session, still writing: its records so far, in memory
            data = _summarize_partial(path, write=False)
            stale = (
                f"no summary.json yet: {one_line(err)}; its records so far are summarized here, not written"
            )
    elif has_records and _stale(path):
        try:  # the records changed since the summary was made (a resumed run): summarize them again
            _summarize_partial(path)
        except Exception as err:
            if not is_user_error(err) and not isinstance(
                err, OSError
            ):  # a read-only folder: report what is there
                raise
            stale = f"summary.json is older than records.jsonl and could not be made again ({one_line(err)})"
    if data is None:
        data = _read(path / "summary.json", {"name": str, "settings": dict, "summary": list})
    if not isinstance(data["settings"].get("methods"), list):
        raise ReportError(f"{path / 'summary.json'} is not a run summary (settings.methods is not a list)")
    _check_rows(data["summary"], path / "summary.json")
    return {
        "kind": "run",
        "path": path,
        "name": _name(data["name"]),
        "data": data,
        "provenance": prov,
        "stale": stale,
    }


def _stale(path: Path) -> bool:
    """Whether ``summary.json`` was made from another ``records.jsonl`` than the one there now (or says not which:
    one written before summaries named their records)."""
    from experiments.runner import records_stamp

    made_from = _made_from(path)
    return made_from is not _UNREADABLE and made_from != records_stamp(path / "records.jsonl")


_UNREADABLE = object()


def _made_from(path: Path) -> Any:
    """The lines of ``records.jsonl`` the run's ``summary.json`` says it was made from (None: it says not;
    ``_UNREADABLE``: no readable summary, which ``_read`` reports in one line)."""
    try:
        return json.loads(read_bytes(path / "summary.json", MAX_JSON_BYTES)).get("records_lines")
    except (OSError, ValueError, RecursionError, AttributeError):
        return _UNREADABLE


def _too_large(file: Path, cap: int) -> ReportError:
    return ReportError(f"{file} is over {cap >> 20} MiB, more than the report reads of it; not read")


def _check_size(file: Path, cap: int) -> None:
    """``ReportError`` when ``file`` holds more than ``cap`` bytes (a sparse file of 20 GB reads as zeros), before
    another module reads it whole."""
    try:
        size = file.stat().st_size
    except OSError:
        return  # the read that follows names it
    if size > cap:
        raise _too_large(file, cap)


def read_bytes(file: Path, cap: int) -> bytes:
    """The bytes of the regular file ``file``, ``cap`` at most (``ReportError`` for more, or for a FIFO or device:
    opened without blocking, and checked before a byte is read)."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReportError(f"{file} is not a regular file (a folder, FIFO, device or socket); not read")
        if st.st_size > cap:
            raise _too_large(file, cap)
        data = fh.read(cap + 1)
    if len(data) > cap:  # grown since
        raise _too_large(file, cap)
    return data


def _read(file: Path, fields: dict[str, type]) -> dict[str, Any]:
    """A result file as the report reads it: a JSON object with ``fields`` of their types (``ReportError`` else)."""
    try:
        data = json.loads(read_bytes(file, MAX_JSON_BYTES).decode("utf-8"))
    except ReportError:
        raise
    except (OSError, ValueError, RecursionError) as err:
        raise ReportError(f"{file} is not readable JSON ({err})") from None
    bad = [k for k, t in fields.items() if not isinstance(data, dict) or not isinstance(data.get(k), t)]
    if bad:
        raise ReportError(f"{file} is not a draftgym result (no valid {', '.join(bad)})")
    return data


def _summarize_partial(path: Path, write: bool = True) -> dict[str, Any]:
    """Make ``summary.json`` again from ``records.jsonl``; ``ReportError`` (the summary left as it is) when a
    complete line of the records is no record, or when they hold fewer lines than the summary was made from: a
    cut or replaced file, which a run never writes (it only appends), would otherwise replace good results.
    ``FolderBusy`` while a run is writing the folder (``env.folder_lock``): two writers of one summary;
    ``write=False`` holds nothing and writes nothing. Returns the summary."""
    from env.folder_lock import claim_folder, held_folders, release_folder
    from experiments.config import load_config
    from experiments.records import load_done
    from experiments.runner import finish, records_stamp, select_prompts

    mine = not write or path.resolve() in held_folders()
    if write:
        claim_folder(
            path, f"run folder {path}"
        )  # FolderBusy while a run writes it: that run makes its summary
    try:
        file = path / "records.jsonl"
        records = load_done(file, repair=False, strict=True)  # a bad line named, not summarized away
        made_from = _made_from(path)
        if type(made_from) is int and (records_stamp(file) or 0) < made_from:
            raise ReportError(
                f"{file} holds fewer lines than the {made_from} summary.json was made from (cut or replaced?); "
                "summary.json left as it is"
            )
        cfg = load_config(path / "config.toml")
        return finish(cfg, path, records, select_prompts(cfg), write=write)
    finally:
        if not mine:
            release_folder(path)


def _provenance(path: Path) -> dict[str, Any]:
    file = path / "provenance.jsonl"
    if not file.is_file():
        return {}
    try:
        text = read_bytes(file, MAX_JSON_BYTES).decode("utf-8", errors="replace")
    except (OSError, ReportError) as err:  # context, not a result: the report says so and goes on
        from experiments.errors import one_line

        return {"note": f"{file.name} not read: {one_line(err)}"}
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        first = json.loads(lines[0]) if lines else {}
    except (ValueError, RecursionError):
        first = None
    if not isinstance(first, dict):  # provenance is context, not a result: a damaged file is reported as such
        first = {"note": f"{file.name} is not readable"}
    first["starts"] = len(lines)
    return first


ROW_TEXT = ("category", "method")
ROW_COUNTS = ("prompts", "tokens")
ROW_RATES = ("tokens_per_s", "tau", "speedup_vs_ar", "speedup_vs_hf")  # None: not measured


def _check_rows(rows: list[Any], file: Path) -> None:
    """``ReportError`` naming the first row of a run summary the report cannot show as measured: not an object,
    a name that is not text, a count that is not one, a rate that is negative, NaN or infinite."""
    for i, row in enumerate(rows):
        where = f"{file}: summary row {i}"
        if not isinstance(row, dict):
            raise ReportError(f"{where} is not an object")
        for k in ROW_TEXT:
            if not isinstance(row.get(k), str):
                raise ReportError(f"{where}: {k} is not text")
        for k in ROW_COUNTS:
            v = row.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ReportError(f"{where}: {k} is not a count ({_shown(v)})")
        for k in ROW_RATES:
            v = row.get(k)
            if v is not None and (not _finite(v) or v < 0):
                raise ReportError(f"{where}: {k} is not a finite number >= 0 ({_shown(v)})")


def _check_sweep(data: dict[str, Any], file: Path) -> None:
    """``ReportError`` naming a sweep's best value the report cannot show as a number (other shapes are named when
    the section is made)."""
    best = data.get("best")
    if isinstance(best, dict) and not _finite(best.get("value")):
        raise ReportError(f"{file}: best.value is not a finite number ({_shown(best.get('value'))})")


def _finite(v: Any) -> bool:
    """Whether ``v`` is a number that is finite as a float: an integer past a float's range (a 401-digit one) is
    not, though ``10**400 < math.inf``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _shown(v: Any) -> str:
    """``v`` as a message shows it: a long value cut."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def md_line(x: Any) -> str:
    """``x`` as one line of Markdown text: line breaks folded (a value read from a file cannot start a heading)."""
    return " ".join(str(x).split())


def md_code(x: Any) -> str:
    """``x`` as the text of a code span outside a table: one line, no backtick."""
    return md_line(x).replace("`", "'")


def md_text(x: Any) -> str:
    """``x`` as one line of Markdown table text: line breaks folded, ``|`` escaped (a name read from a file
    cannot split the table or start a heading)."""
    return md_line(x).replace("|", "\\|")


def _name(x: str) -> str:
    """A run's or sweep's name as the report shows it, in code spans and tables: one line, no backtick."""
    return md_text(x).replace("`", "'")


# what the report reads of a run or sweep directory: a report there of one of these names would be taken for it
READ_FILES = ("summary.json", "sweep.json", "config.toml", "records.jsonl", "sweep.md", "provenance.jsonl")
