"""``draftgym report RUN_DIR...``: one Markdown report of runs (``draftgym run``) and sweeps (``draftgym sweep``),
with their tables, plots and provenance, and the runs compared side by side.

A run directory is summarized from its records first when it has no summary yet (killed before it was written) or
when its summary is older than its records (a resumed run added some since): ``summary.json`` counts the lines of
the ``records.jsonl`` it was made from. A run some method has not finished is marked partial, and its
methods are compared on the prompts every method has finished only (``experiments.runner.partial_note``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from env.files import atomic_write_text
from experiments.args import output_file, path_arg, same_file
from experiments.report_inputs import (
    MAX_JSON_BYTES,
    READ_FILES,
    ReportError,
    load_run,
    md_code,
    md_line,
    md_text,
    read_bytes,
)
from experiments.runner import machine_label, settings_line


def _cell(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(map(md_text, header)) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(md_text, r)) + " |" for r in rows
    ]


def _img(title: str, png: Path, report_dir: Path) -> str:
    return f"![{md_line(title)}]({os.path.relpath(png, report_dir)})"


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
        notes = [f"- partial: {md_line(note['text'])}"]
    else:  # a summary from before summaries said so: any method short of a prompt, or without a record at all
        done = {x["method"]: x["prompts"] for x in d["summary"] if x["category"] == "overall"}
        short = any(done.get(m, 0) < s["prompts"] for m in s["methods"])
        partial = " (partial: some prompts have no record yet)" if short else ""
        notes = []
    if r.get("stale"):
        notes.append(f"- stale: {r['stale']}")
    if isinstance(p.get("note"), str):  # a provenance file not read
        notes.append(f"- provenance: {md_line(p['note'])}")
    # the summary's own notes: the timing sessions its records come from, greedy output unequal to AR's
    notes += [f"- {md_line(n)}" for n in d.get("notes") or [] if isinstance(n, str)]
    lines = [
        f"## Run `{r.get('label', r['name'])}`{partial}",
        "",
        *notes,
        f"- directory: `{r['path']}`; command: `{md_code(p.get('command', '?'))}` ({p.get('starts', 0)} start(s), "
        f"first at {md_line(p.get('time', '?'))})",
        f"- {md_line(settings_line(s))}",
        f"- machine: {md_line(_machine_text(s, machine))}; "
        + ", ".join(
            f"{k} {md_line(v)}" for k, v in versions.items() if v and k in ("torch", "transformers", "optuna")
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
    states = ", ".join(f"{md_line(k)} {md_line(v)}" for k, v in sorted(d["states"].items()))
    table = r["path"] / "sweep.md"
    lines = [
        f"## Sweep `{r.get('label', r['name'])}`",
        "",
        f"- directory: `{r['path']}`; storage `{md_code(d['storage'])}`; objective {md_line(d['objective'])} "
        f"({md_line(d['backend'])} backend); trials by state: {states}",
        f"- best: trial {md_line(best['number'])}, {md_line(best['method'])}, value {best['value']:.4f}; config "
        f"`{r['path'] / 'best.toml'}`",
        "",
        "```",
        read_bytes(table, MAX_JSON_BYTES).decode("utf-8", errors="replace").split("```")[1].strip("\n")
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
    # its folder made and writable, once the inputs read (a refused report makes no folder)
    output_file(out, flag="--out")
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
        text = read_bytes(out, MAX_JSON_BYTES).decode("utf-8", errors="replace")
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
        "run_dirs",
        nargs="+",
        type=path_arg,
        metavar="RUN_DIR",
        help="directories written by draftgym run / sweep",
    )
    p.add_argument(
        "--out", default=None, help="report file (default: RUN_DIR/report.md for one run, else report.md)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)
