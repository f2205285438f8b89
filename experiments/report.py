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
from pathlib import Path
from typing import Any

from env.files import atomic_write_text
from experiments.args import output_file, same_file
from experiments.runner import machine_label, settings_line


class ReportError(ValueError):
    """A path that is not a run or sweep directory; meant for the user."""


def load_run(path: Path) -> dict[str, Any]:
    """What the report needs of one directory: kind (run | sweep), name, summary or trials, provenance."""
    from env.folder_lock import FolderBusy
    from experiments.errors import is_user_error, one_line

    if not path.is_dir():
        raise ReportError(f"{path} is not a directory")
    prov = _provenance(path)
    if (path / "sweep.json").is_file():
        data = _read(path / "sweep.json", {"study": str})
        return {"kind": "sweep", "path": path, "name": _name(data["study"]), "data": data, "provenance": prov}
    has_records = (path / "config.toml").is_file() and (path / "records.jsonl").is_file()
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
        return json.loads((path / "summary.json").read_text(encoding="utf-8")).get("records_lines")
    except (OSError, ValueError, RecursionError, AttributeError):
        return _UNREADABLE


def _read(file: Path, fields: dict[str, type]) -> dict[str, Any]:
    """A result file as the report reads it: a JSON object with ``fields`` of their types (``ReportError`` else)."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
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
    lines = [ln for ln in file.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
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
                raise ReportError(f"{where}: {k} is not a count ({v!r})")
        for k in ROW_RATES:
            v = row.get(k)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf
            ):
                raise ReportError(f"{where}: {k} is not a finite number >= 0 ({v!r})")


def _text(x: Any) -> str:
    """``x`` as one line of Markdown table text: line breaks folded, ``|`` escaped (a name read from a file
    cannot split the table or start a heading)."""
    return " ".join(str(x).split()).replace("|", "\\|")


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
    return f"![{title}]({os.path.relpath(png, report_dir)})"


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
        notes = [f"- partial: {note['text']}"]
    else:  # a summary from before summaries said so: any method short of a prompt, or without a record at all
        done = {x["method"]: x["prompts"] for x in d["summary"] if x["category"] == "overall"}
        short = any(done.get(m, 0) < s["prompts"] for m in s["methods"])
        partial = " (partial: some prompts have no record yet)" if short else ""
        notes = []
    if r.get("stale"):
        notes.append(f"- stale: {r['stale']}")
    # the summary's own notes: the timing sessions its records come from, greedy output unequal to AR's
    notes += [f"- {n}" for n in d.get("notes") or [] if isinstance(n, str)]
    lines = [
        f"## Run `{r.get('label', r['name'])}`{partial}",
        "",
        *notes,
        f"- directory: `{r['path']}`; command: `{p.get('command', '?')}` ({p.get('starts', 0)} start(s), "
        f"first at {p.get('time', '?')})",
        f"- {settings_line(s)}",
        f"- machine: {_machine_text(s, machine)}; "
        + ", ".join(
            f"{k} {v}" for k, v in versions.items() if v and k in ("torch", "transformers", "optuna")
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
    lines = [
        f"## Sweep `{r.get('label', r['name'])}`",
        "",
        f"- directory: `{r['path']}`; storage `{d['storage']}`; objective {d['objective']} ({d['backend']} backend); "
        f"trials by state: {', '.join(f'{k} {v}' for k, v in sorted(d['states'].items()))}",
        f"- best: trial {best['number']}, {best['method']}, value {best['value']:.4f}; config `{r['path'] / 'best.toml'}`",
        "",
        "```",
        (r["path"] / "sweep.md").read_text().split("```")[1].strip("\n")
        if (r["path"] / "sweep.md").is_file()
        else "",
        "```",
        "",
    ]
    for png in sorted((r["path"] / "plots").glob("*.png")):
        lines += [_img(png.stem.replace("_", " "), png, report_dir), ""]
    return lines


def write_report(paths: list[Path], out: Path) -> Path:
    items = [load_run(Path(p)) for p in paths]
    label_items(items)
    runs = [r for r in items if r["kind"] == "run"]
    report_dir = out.parent
    report_dir.mkdir(parents=True, exist_ok=True)
    lines = [REPORT_HEAD, ""]
    lines += [f"- {r['kind']} `{r['label']}`: `{r['path']}`" for r in items] + [""]
    try:
        lines += _sections(items, runs, out, report_dir)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:  # a file of another shape
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
            out.with_name(out.stem + "_compare.png"),
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


def cmd_report(args: Any) -> int:
    paths = [Path(p) for p in args.run_dirs]
    for p in paths:  # read before anything is written
        load_run(p)
    out = Path(args.out) if args.out else (paths[0] / "report.md" if len(paths) == 1 else Path("report.md"))
    # a run's records, summary, study or config named by a misplaced --out
    output_file(out, earlier=(_is_report, "a draftgym report"))
    if out.name in READ_FILES and any(same_file(out.parent, p) for p in paths):  # one not written yet
        raise ReportError(f"{out} is a result file of the run directory {out.parent}; name another file")
    path = write_report(paths, out)
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
