"""``draftgym report RUN_DIR...``: one Markdown report of runs (``draftgym run``) and sweeps (``draftgym sweep``),
with their tables, plots and provenance, and the runs compared side by side.

A run directory is summarized from its records first when it has no summary yet (killed before it was written) or
when its summary is older than its records (a resumed run added some since): ``summary.json`` counts the lines of
the ``records.jsonl`` it was made from. A run some method has not finished is marked partial, and its
methods are compared on the prompts every method has finished only (``experiments.runner.partial_note``).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from env.files import atomic_write_text
from experiments.args import output_file, same_file
from experiments.runner import machine_label, settings_line

# the most the report reads of a file (a sparse or runaway file would be read whole, or for ever): far above any
# run's summary, sweep, config or provenance, and any run's records
MAX_JSON_BYTES = 64 << 20
MAX_RECORDS_BYTES = 1 << 30


class ReportError(ValueError):
    """A path that is not a run or sweep directory; meant for the user."""


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
        return json.loads(_read_bytes(path / "summary.json", MAX_JSON_BYTES)).get("records_lines")
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


def _read_bytes(file: Path, cap: int) -> bytes:
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
        data = json.loads(_read_bytes(file, MAX_JSON_BYTES).decode("utf-8"))
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
        text = _read_bytes(file, MAX_JSON_BYTES).decode("utf-8", errors="replace")
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


def _line(x: Any) -> str:
    """``x`` as one line of Markdown text: line breaks folded (a value read from a file cannot start a heading)."""
    return " ".join(str(x).split())


def _code(x: Any) -> str:
    """``x`` as the text of a code span outside a table: one line, no backtick."""
    return _line(x).replace("`", "'")


def _text(x: Any) -> str:
    """``x`` as one line of Markdown table text: line breaks folded, ``|`` escaped (a name read from a file
    cannot split the table or start a heading)."""
    return _line(x).replace("|", "\\|")


def _name(x: str) -> str:
    """A run's or sweep's name as the report shows it, in code spans and tables: one line, no backtick."""
    return _text(x).replace("`", "'")


def _cell(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(map(_text, header)) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(_text, r)) + " |" for r in rows
    ]


def _img(title: str, png: Path, report_dir: Path) -> str:
    return f"![{_line(title)}]({os.path.relpath(png, report_dir)})"


def _ratio(row: dict[str, Any], key: str, base: str) -> str:
    from experiments.bench_summary import ratio_cell

    return ratio_cell(row, key, base, empty="–")


def label_items(items: list[dict[str, Any]]) -> None:
    """Give each item a ``label`` no other has: its name, with its folder where names repeat (two runs of one
    config on two machines), and its position where that repeats too."""
    names = [r["name"] for r in items]
    for i, r in enumerate(items):
        label = r["name"] if names.count(r["name"]) == 1 else f"{r['name']} ({Path(r['path']).name})"
        if (
            sum(1 for x in items if x["name"] == r["name"] and Path(x["path"]).name == Path(r["path"]).name)
            > 1
        ):
            label = f"{r['name']} #{i + 1}"
        r["label"] = label


def side_by_side(runs: list[dict[str, Any]]) -> list[str]:
    """Overall rows of every run, one column group per run (headed by its ``label``)."""
    methods = list(dict.fromkeys(m for r in runs for m in r["data"]["settings"]["methods"]))
    cols = ("tok/s", "tau", "× AR", "× HF")
    header = ["method"] + [f"{r.get('label', r['name'])} {c}" for r in runs for c in cols]
    rows = []
    for m in methods:
        row = [m]
        for r in runs:
            o = next(
                (x for x in r["data"]["summary"] if x["category"] == "overall" and x["method"] == m), None
            )
            row += (
                ["–"] * len(cols)
                if o is None
                else [
                    _cell(o["tokens_per_s"]),
                    _cell(o["tau"]),
                    _ratio(o, "speedup_vs_ar", "ar"),
                    _ratio(o, "speedup_vs_hf", "hf_greedy"),
                ]  # fmt: skip
            )
        rows.append(row)
    return _md_table(header, rows)


def run_section(r: dict[str, Any], report_dir: Path) -> list[str]:
    d, p = r["data"], r["provenance"]
    s = d["settings"]
    machine = p.get("machine", {})
    versions = p.get("versions", {})
    note = d.get("partial")
    if isinstance(note, dict) and isinstance(note.get("text"), str):
        partial = (
            f" (partial: some prompts have no record yet; {note['common']} of {note['prompts']} prompts "
            "finished by every method)"
        )
        notes = [f"- partial: {_line(note['text'])}"]
    else:  # a summary from before summaries said so: any method short of a prompt, or without a record at all
        done = {x["method"]: x["prompts"] for x in d["summary"] if x["category"] == "overall"}
        short = any(done.get(m, 0) < s["prompts"] for m in s["methods"])
        partial = " (partial: some prompts have no record yet)" if short else ""
        notes = []
    if r.get("stale"):
        notes.append(f"- stale: {r['stale']}")
    if isinstance(p.get("note"), str):  # a provenance file not read
        notes.append(f"- provenance: {_line(p['note'])}")
    # the summary's own notes: the timing sessions its records come from, greedy output unequal to AR's
    notes += [f"- {_line(n)}" for n in d.get("notes") or [] if isinstance(n, str)]
    lines = [
        f"## Run `{r.get('label', r['name'])}`{partial}",
        "",
        *notes,
        f"- directory: `{r['path']}`; command: `{_code(p.get('command', '?'))}` ({p.get('starts', 0)} start(s), "
        f"first at {_line(p.get('time', '?'))})",
        f"- {_line(settings_line(s))}",
        f"- machine: {_line(_machine_text(s, machine))}; "
        + ", ".join(
            f"{k} {_line(v)}" for k, v in versions.items() if v and k in ("torch", "transformers", "optuna")
        ),
        "",
    ]
    rows = [
        [
            x["category"],
            x["method"],
            str(x["prompts"]),
            str(x["tokens"]),
            _cell(x["tokens_per_s"]),
            _cell(x["tau"]),
            _ratio(x, "speedup_vs_ar", "ar"),
            _ratio(x, "speedup_vs_hf", "hf_greedy"),
        ]  # fmt: skip
        for x in d["summary"]
    ]
    lines += _md_table(["category", "method", "prompts", "tokens", "tok/s", "tau", "× AR", "× HF"], rows)
    lines += [
        "",
        "Speedups are ratios of aggregate tokens/s on the same prompts (the notes above say when the records "
        "come from several timing sessions).",
        "",
    ]
    for png in sorted((r["path"] / "plots").glob("*.png")):
        lines += [_img(png.stem.replace("_", " "), png, report_dir), ""]
    return lines


def _machine_text(s: dict[str, Any], machine: dict[str, Any]) -> str:
    """Where a run was measured: its summary's machine (the GPU only when the run's device was CUDA, and the CPU
    with its bf16 flags); for a summary from before it said, the first start's provenance, with a GPU named as
    present only (that summary does not say which device the run used)."""
    label = machine_label(s)
    cpus = f", {machine['cpu_count']} CPUs" if machine.get("cpu_count") else ""
    if label:
        return label + cpus
    cpu = machine.get("cpu_label") or machine.get("processor", "?")
    if not machine.get("cuda"):
        gpu = "no GPU"
    elif str(s.get("device", "")).startswith("cuda"):
        gpu = f"GPU {machine.get('gpu')}"
    elif s.get("device") in (None, "auto"):
        gpu = f"GPU {machine.get('gpu')} present (the run's device is not recorded)"
    else:
        gpu = "GPU not used"
    return f"{cpu}{cpus}, {gpu}"


def sweep_section(r: dict[str, Any], report_dir: Path) -> list[str]:
    d = r["data"]
    best = d["best"]
    states = ", ".join(f"{_line(k)} {_line(v)}" for k, v in sorted(d["states"].items()))
    table = r["path"] / "sweep.md"
    lines = [
        f"## Sweep `{r.get('label', r['name'])}`",
        "",
        f"- directory: `{r['path']}`; storage `{_code(d['storage'])}`; objective {_line(d['objective'])} "
        f"({_line(d['backend'])} backend); trials by state: {states}",
        f"- best: trial {_line(best['number'])}, {_line(best['method'])}, value {best['value']:.4f}; config "
        f"`{r['path'] / 'best.toml'}`",
        "",
        "```",
        _read_bytes(table, MAX_JSON_BYTES).decode("utf-8", errors="replace").split("```")[1].strip("\n")
        if table.is_file()
        else "",
        "```",
        "",
    ]
    for png in sorted((r["path"] / "plots").glob("*.png")):
        lines += [_img(png.stem.replace("_", " "), png, report_dir), ""]
    return lines


def write_report(paths: list[Path], out: Path) -> Path:
    paths = [Path(p) for p in paths]
    check_outputs(paths, out)  # before anything is read, or a stale summary made again
    items = [load_run(p) for p in paths]
    output_file(out)  # its folder made and writable, once the inputs read (a refused report makes no folder)
    label_items(items)
    runs = [r for r in items if r["kind"] == "run"]
    report_dir = out.parent
    report_dir.mkdir(parents=True, exist_ok=True)
    lines = [REPORT_HEAD, ""]
    lines += [f"- {r['kind']} `{r['label']}`: `{r['path']}`" for r in items] + [""]
    try:
        lines += _sections(items, runs, out, report_dir)
    except (
        KeyError,
        IndexError,
        TypeError,
        ValueError,
        AttributeError,
        OverflowError,
    ) as err:  # another shape
        where = ", ".join(str(r["path"]) for r in items)
        from drafters.base import reason

        why = reason(err, 160, kind=True)
        raise ReportError(
            f"a result file in {where} is not a draftgym result this report can read ({why})"
        ) from None
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out


def _sections(
    items: list[dict[str, Any]], runs: list[dict[str, Any]], out: Path, report_dir: Path
) -> list[str]:
    from experiments import plots

    lines: list[str] = []
    if len(runs) > 1:
        machines = [(r["label"], machine_label(r["data"]["settings"])) for r in runs]
        shared = {m for _, m in machines}
        note = (
            f"measured on {shared.pop()}"
            if len(shared) == 1 and "" not in shared
            else "; ".join(f"{n}: {m or 'machine not recorded'}" for n, m in machines)
        )
        png = plots.compare_runs(
            [(r["label"], r["data"]["summary"], r["data"]["settings"]["methods"]) for r in runs],
            compare_png(out),
            note=note,
        )
        lines += (
            ["## Runs side by side (overall)", "", f"- {note}", ""]
            + side_by_side(runs)
            + ["", _img("comparison", png, report_dir), ""]
        )
    for r in items:
        lines += run_section(r, report_dir) if r["kind"] == "run" else sweep_section(r, report_dir)
    return lines


REPORT_HEAD = "# draftgym report"


# what the report reads of a run or sweep directory: a report there of one of these names would be taken for it
READ_FILES = ("summary.json", "sweep.json", "config.toml", "records.jsonl", "sweep.md", "provenance.jsonl")


def _is_report(path: Path) -> bool:
    """``path`` is empty or an earlier report (it starts with ``REPORT_HEAD``), not a result file of a run or a
    sweep (``records.jsonl``, ``summary.json``, ``study.db``, ...) that writing the report would destroy."""
    try:
        with path.open("rb") as fh:
            head = fh.read(len(REPORT_HEAD.encode()))
    except OSError:
        return False  # not readable: cannot tell, so not overwritten
    return not head or head == REPORT_HEAD.encode()


def compare_png(out: Path) -> Path:
    """The comparison plot of the runs, written beside the report ``out``."""
    return out.with_name(out.stem + "_compare.png")


def _earlier_plot(png: Path, out: Path) -> bool:
    """``png`` is empty or the comparison plot of the earlier report ``out`` (which links it), not a file of
    someone else's that writing the report would replace."""
    try:
        if not png.stat().st_size:
            return True
        text = _read_bytes(out, MAX_JSON_BYTES).decode("utf-8", errors="replace")
    except (OSError, ReportError):
        return False  # no earlier report there, or not readable: cannot tell, so not overwritten
    return text.startswith(REPORT_HEAD) and f"]({os.path.relpath(png, out.parent)})" in text


def check_outputs(paths: list[Path], out: Path) -> None:
    """Check, before anything of ``paths`` is read (or a stale summary there made again), every file the report
    writes: ``out`` and, for two runs or more, its comparison plot. Each is no folder, device or FIFO, none of the
    files the report reads in a run or sweep directory, no PNG in one's ``plots`` (the report shows every PNG there
    as the run's), and replaces nothing but an earlier report of its own (``ReportError`` or ``UserError``, one line).
    The folders of ``paths`` are checked to be folders, each named once."""
    from env.cli import check_output_kind

    for i, p in enumerate(paths):
        if not p.is_dir():
            raise ReportError(f"{p} is not a directory")
        twin = next((q for q in paths[:i] if same_file(p, q)), None)
        if twin is not None:  # its runs would be reported, and compared, twice
            raise ReportError(f"{twin} and {p} are the same directory; name each run or sweep once")
    runs = sum(not (p / "sweep.json").is_file() for p in paths)
    png = compare_png(out)
    written = [("--out", out, _is_report, "a draftgym report")]
    if runs > 1:
        written.append((f"--out {out}: its comparison plot", png, lambda f: _earlier_plot(f, out),
                        f"the plot of an earlier report {out} (name another --out)"))  # fmt: skip
    for what, file, earlier, kind in written:
        check_output_kind(file, what)
        if file.is_file() and not earlier(file):
            raise ReportError(f"{what} {file} exists and is not {kind}; not overwritten")
        if file.name in READ_FILES and any(same_file(file.parent, p) for p in paths):  # one not written yet
            raise ReportError(
                f"{what} {file} is a result file of the run directory {file.parent}; name another file"
            )
        real = Path(os.path.realpath(file))  # a link loop stays a path, not an error
        inside = next((p for p in paths if real.is_relative_to(os.path.realpath(p / "plots"))), None)
        if inside is not None and file.name.endswith(".png"):
            raise ReportError(
                f"{what} {file} is in the plots folder of {inside}, which the report shows as that run's; "
                "name another file"
            )


def cmd_report(args: Any) -> int:
    paths = [Path(p) for p in args.run_dirs]
    out = Path(args.out) if args.out else (paths[0] / "report.md" if len(paths) == 1 else Path("report.md"))
    path = write_report(paths, out)  # every file it writes checked before anything is read
    if args.json:
        print(json.dumps({"report": str(path)}))
    else:
        print(f"report: {path}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("report", help="a Markdown report of run and sweep directories, side by side")
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="directories written by draftgym run / sweep"
    )
    p.add_argument(
        "--out", default=None, help="report file (default: RUN_DIR/report.md for one run, else report.md)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)
