"""``draftgym run CONFIG``: the workload x methods of one config, into a run directory.

Reads top to bottom: config -> run directory (resolved config, provenance) -> model and decoders -> loop over
prompts (methods interleaved, order rotated per prompt, as ``draftgym bench`` does) -> summary table -> plots.

The run directory holds::

    config.toml        the resolved config (file < --set), every field written out
    provenance.jsonl   one line per start that decodes (written once the model loaded): command, versions, machine
    records.jsonl      one line per (method, prompt), appended and flushed as each finishes
    policies/NAME.zip  the state of each online policy after its last finished prompt
    summary.json       the summary rows (per category and overall) and the run's settings as resolved (dtype,
                       device, weights, forward) with the machine (settings.json: what a resume must match)
    summary.md         the summary table, its settings and machine
    plots/*.png        speedup per category, tau distribution, arm choices over the generation

A run killed at any point (SIGKILL included) and started again with the same config and directory skips every
(method, prompt) already in ``records.jsonl`` and loses nothing; a torn last line is cut off and redone. Greedy
decoding is deterministic, so the restarted run's tokens equal an uninterrupted run's.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from env.files import Appending, atomic_write_text
from env.workloads import Prompt, load_workload, prompts_digest
from experiments.bench import interleaved, run_method, warm_up
from experiments.bench_summary import format_table, summarize, summary_notes
from experiments.config import Config, diff_configs, load_config, to_toml
from experiments.provenance import provenance
from experiments.records import (
    RUN_LEARNED,
    RUN_RECORD,
    Record,
    check_learned,
    load_done,
    machine_identity,
    machine_label,
    new_session,
    run_identity,
    workload_digest,
    workload_identity,
)


class RunDirError(ValueError):
    """A run directory that holds another config's results; meant for the user."""


# what a run writes in its folder (the docstring's list): checked writable before anything runs
RUN_FILES = (
    "config.toml",
    "provenance.jsonl",
    "records.jsonl",
    "summary.json",
    "summary.md",
    "settings.json",
)


def select_prompts(cfg: Config) -> list[Prompt]:
    w = cfg.workload
    prompts = load_workload(
        w.path, per_category=w.per_category or None, categories=list(w.categories) or None
    )
    return prompts[: w.limit] if w.limit else prompts


def prepare_run_dir(
    cfg: Config, out: Path, ignore: tuple[str, ...] = ("sweep.",), provenance_line: bool = True
) -> None:
    """Write the resolved config (or check that it equals the one already there, except keys starting with an
    ``ignore`` prefix: the sweep table does not change a run's results) and, with ``provenance_line``, a
    provenance line (``run`` writes its own once the model is loaded: ``append_provenance``)."""
    check_run_dir(cfg, out, ignore)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.toml"
    if not path.is_file():
        text = to_toml(
            cfg, header="Resolved config of this run (file < --set). Rerun: draftgym run config.toml"
        )
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    if provenance_line:
        append_provenance(out)


def check_run_dir(cfg: Config, out: Path, ignore: tuple[str, ...] = ("sweep.",)) -> None:
    """A ``RunDirError`` when ``out`` holds a run of another config (``prepare_run_dir``); writes nothing."""
    path = out / "config.toml"
    if path.is_file():
        diff = diff_configs(load_config(path), cfg, ignore=ignore)
        if diff:
            raise RunDirError(
                f"{out} holds a run of another config (differs in {', '.join(diff[:5])}); "
                "rerun with the same config to resume it, or pass another --out"
            )


def append_provenance(out: Path) -> None:
    """One line of ``provenance.jsonl``: written once the model is loaded (the products it settled are named)."""
    with Appending(out / "provenance.jsonl") as fh:
        fh.write(json.dumps(provenance()) + "\n")


def run(cfg: Config, out: Path, *, progress: bool = True, loaded: Any = None) -> dict[str, Any]:
    """Run (or resume) ``cfg`` into ``out``; returns the summary object also written to summary.json.
    ``loaded``: an already loaded model to use instead of loading ``cfg.model`` (tests, notebooks)."""
    from env.decoder import chat_prompt
    from env.model import load_model, model_id_of
    from experiments.drafter_state import commit_drafters, restore_drafters, resume_drafters, save_drafters
    from experiments.methods import make_decoders, prepare_decoders, sampling_of, save_policy_states

    prompts = select_prompts(cfg)  # a missing or bad workload: refused before the run folder is written
    check_run_dir(cfg, out)  # written (config.toml, provenance) once the checks below have passed
    session = new_session()  # stamped on each record timed here: a resume is another session
    methods = list(cfg.methods)
    rec_path = out / "records.jsonl"
    records = load_done(rec_path)
    records += recover_policy_records(cfg, out / "policies", rec_path, records)
    done = {(r.method, r.prompt_id) for r in records}
    todo = [(i, p) for i, p in enumerate(prompts) if any((m, p.prompt_id) not in done for m in methods)]

    if not todo:  # a finished run: its summary is rebuilt, from records of these files' contents only
        check_finished(cfg, out, model_id_of(cfg.model.name) if loaded is None else loaded.model_id)
        prepare_run_dir(cfg, out, provenance_line=False)
    if todo:
        bar = tqdm(total=1, desc="load model", disable=not progress, leave=False)
        if loaded is None:
            loaded = load_model(
                cfg.model.name, dtype=cfg.model.dtype, device=cfg.model.device, weights=cfg.model.weights
            )
        bar.update(1)
        bar.close()
        from env.target import check_prompt
        from experiments.args import same_settings

        prompt_ids = {p.prompt_id: chat_prompt(loaded.tokenizer, p.text) for p in prompts}
        for p in prompts:  # every prompt fits the context, before anything is decoded or written
            check_prompt(prompt_ids[p.prompt_id], loaded.max_context, f"prompt {p.prompt_id}")
        state_dir = out / "policies"
        lengths = {len(ids) for ids in prompt_ids.values()}
        longest = max(lengths, default=0)
        decoders = make_decoders(cfg, loaded, state_dir, context=longest + cfg.decode.max_new_tokens)
        prepare_decoders(decoders.values())  # a bad head file: before the folder is written
        # what "auto" resolved to on this machine, and the files' contents: a resume with others is refused
        out.mkdir(parents=True, exist_ok=True)
        same_settings(out, run_settings(cfg, loaded), started=bool(records), command="run")
        prepare_run_dir(cfg, out)  # the provenance line names what the loaded model settled
        vocab = int(loaded.config.vocab_size)
        carried = resume_drafters(decoders, state_dir, rec_path, records, vocab)  # restored after the warm-up
        done |= {(r.method, r.prompt_id) for r in records}
        sampling = sampling_of(cfg)
        if cfg.decode.warmup:  # untimed: the first call of each decoder that is then timed pays for lazy init
            warm_ids = chat_prompt(loaded.tokenizer, "Say hello.")
            for m in tqdm(methods, desc="warm-up", disable=not progress, leave=False):
                warm_up(m, loaded, decoders, warm_ids, sampling=sampling, seed=cfg.seed, lengths=lengths,
                        max_new_tokens=cfg.decode.max_new_tokens)  # fmt: skip
        restore_drafters(decoders, carried, state_dir, vocab)
        bar = tqdm(
            total=len(prompts) * len(methods), initial=len(done), desc=f"run {cfg.name}", disable=not progress
        )
        with Appending(rec_path) as fh:
            for i, p, order in interleaved(todo, methods, done):
                given = prompt_ids[p.prompt_id]
                for m in order:
                    ids, wall, steps, tau, arms = run_method(
                        m,
                        loaded,
                        decoders,
                        given,
                        cfg.decode.max_new_tokens,
                        sampling=sampling,
                        seed=cfg.seed + i,
                    )
                    rec = Record(m, p.prompt_id, p.category, len(given), len(ids), wall, steps, tau, ids, arms,
                                 session)  # fmt: skip
                    learned = [r.prompt_id for r in records if r.method == m] + [p.prompt_id]
                    policy = getattr(decoders.get(m), "policy", None)
                    if policy is not None:  # the state after this prompt and its record, saved together
                        policy.meta = {**policy.meta, RUN_RECORD: asdict(rec), RUN_LEARNED: learned}
                    # before the record (a kill in between: recover_policy_records)
                    # the drafters' state aside, then the policy's, then the drafters' in place, then the record
                    save_drafters(decoders.get(m), state_dir, m, rec, learned)
                    save_policy_states(decoders, state_dir, m)
                    commit_drafters(state_dir, m)
                    fh.write(json.dumps(asdict(rec)) + "\n")
                    fh.flush()
                    records.append(rec)
                    done.add((m, p.prompt_id))
                    bar.update(1)
        bar.close()
    problems = check_results(records, prompts, methods)  # before the summary is rewritten from them
    if problems:
        from experiments.errors import UserError

        raise UserError(f"run {out} is inconsistent: {'; '.join(problems[:5])}")
    return finish(cfg, out, records, prompts)


def run_settings(cfg: Config, loaded: Any) -> dict[str, Any]:
    """What a run's records depend on beyond its config file's values (``config.toml``): the model, dtype, device,
    weights and forward as loaded here (``auto`` resolves per machine) and the machine, with ``file_settings``:
    kept in ``settings.json`` (``experiments.args.same_settings``), as ``draftgym bench`` keeps them."""
    options = {name: dict(opts) for name, opts in cfg.drafters.items()}
    return {
        **run_identity(loaded, cfg.decode.max_new_tokens, options),
        **machine_identity(loaded.device),
        **file_settings(cfg, loaded.model_id),
    }


def file_settings(cfg: Config, model_id: str) -> dict[str, Any]:
    """The settings of ``run_settings`` that need no model, checked also when a finished run is rerun: the workload
    and the contents of its file (or, for the built-in set and a ``code:`` source, of all its prompts), of each
    policy method's file (``policies.NAME.path``) and of each head file the methods' drafters load
    (``drafter_head.DRAFTER``)."""
    from env.files import file_digest

    policies = {}
    for m in cfg.methods:
        p = cfg.policies.get(m.removeprefix("policy:")) if m.startswith("policy:") else None
        if p is not None and p.path and Path(p.path).is_file():
            policies[m] = file_digest(p.path)
    return {
        "workload": workload_identity(cfg.workload.path),
        "workload_sha256": workload_digest(cfg.workload.path),
        "workload_prompts_sha256": prompts_digest(cfg.workload.path),
        "policies": policies,
        # one key a head: a refusal names the drafter; a folder from before these keys is taken as it is
        **head_digests(cfg, model_id),
    }


def head_digests(cfg: Config, model_id: str) -> dict[str, str]:
    """``experiments.records.head_identity`` of the drafters of the methods and policy arms of ``cfg``."""
    from experiments.records import head_identity, method_drafters

    arms = []
    for m in cfg.methods:
        if m.startswith("policy:") and m.removeprefix("policy:") in cfg.policies:
            arms += list(cfg.policies[m.removeprefix("policy:")].arms)
        else:
            arms.append(m)
    return head_identity(method_drafters(arms), cfg.drafters, model_id)


def check_finished(cfg: Config, out: Path, model_id: str) -> None:
    """A rerun of a finished run loads no model, but its records must still be of these files' contents
    (``file_settings``), else the summary it rebuilds describes prompts, policies or heads the run no longer has.
    A folder without ``settings.json`` (from before it) is taken as it is; a head no longer found is not
    compared (a head cache cleared after the run does not stop its summary)."""
    from experiments.args import same_settings

    path = out / "settings.json"
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        saved = None  # same_settings says so
    saved = saved if isinstance(saved, dict) else {}
    same_settings(out, {**saved, **file_settings(cfg, model_id)}, started=True, command="run")


def recover_policy_records(
    cfg: Config, state_dir: Path, rec_path: Path, records: list[Record]
) -> list[Record]:
    """An online policy's state is saved after each prompt, with that prompt's record in its ``meta``, before the
    record is appended to ``records.jsonl``. A kill in between leaves the record only in the state: append it
    (else the rerun would decode the prompt again, with a policy that has already learned from it, and go on
    from a state an uninterrupted run never had). Returns the records appended."""
    done = {(r.method, r.prompt_id) for r in records}
    found = []
    for m in cfg.methods:
        path = state_dir / f"{m.removeprefix('policy:')}.zip"
        if not (m.startswith("policy:") and path.is_file()):
            continue
        from policies.base import read_policy

        meta = read_policy(path)[0].meta
        row = meta.get(RUN_RECORD)
        try:
            rec = Record(**row) if isinstance(row, dict) else None
        except TypeError:  # a state whose record is not one: the prompt runs again
            rec = None
        check_learned(path, m, meta.get(RUN_LEARNED), None if rec is None else rec.prompt_id, records)
        if rec is not None and (rec.method, rec.prompt_id) not in done:
            found.append(rec)
    if found:
        with Appending(rec_path) as fh:
            fh.writelines(json.dumps(asdict(r)) + "\n" for r in found)
    return found


def finish(
    cfg: Config, out: Path, records: list[Record], prompts: list[Prompt], write: bool = True
) -> dict[str, Any]:
    """Summary table and plots from the records (also what a rerun of a finished run does); ``write=False``: the
    summary only, nothing written (``report`` beside a run that is still writing the folder)."""
    from experiments import plots

    keep = {p.prompt_id for p in prompts}
    methods = list(cfg.methods)
    records = [r for r in records if r.prompt_id in keep and r.method in methods]
    partial = partial_note(records, prompts, methods)
    if partial:  # methods are compared on the same prompts: those every method has finished
        common = set(partial["common_prompts"])
        records = [r for r in records if r.prompt_id in common]
    greedy = cfg.decode.temperature == 0
    rows = summarize(records, methods, greedy=greedy)
    rec_file = out / "records.jsonl"
    settings = summary_settings(cfg, out, len(prompts))
    machine = machine_label(settings)
    notes = summary_notes(records, rows, str(settings["dtype"]), greedy)
    result = {
        "name": cfg.name,
        "settings": settings,
        "records": len(records),
        "records_lines": records_stamp(rec_file),  # what it was made from (a report redoes a stale summary)
        "partial": None if partial is None else {k: v for k, v in partial.items() if k != "common_prompts"},
        "summary": rows,
        "notes": notes,  # the records' sessions when several; greedy output that differs from AR's
    }
    if not write:
        return result
    atomic_write_text(out / "summary.json", json.dumps(result, indent=2))
    table = format_table(rows)
    note = f"Partial: {partial['text']}.\n\n" if partial else ""
    atomic_write_text(
        out / "summary.md",
        f"# {cfg.name}\n\n{note}{settings_line(settings)}\n\nMachine: {machine or 'not recorded'}.\n\n"
        f"Speedups are ratios of aggregate tokens/s on the same prompts.\n\n```\n{table}\n```\n"
        + "".join(f"\n{n}\n" for n in notes),
    )
    table += "".join(f"\n\n{n}" for n in notes)
    result["plots"] = [
        str(p) for p in plots.run_plots(records, rows, methods, out / "plots", machine=machine)
    ]
    result["table"] = table
    return result


def summary_settings(cfg: Config, out: Path, prompts: int) -> dict[str, Any]:
    """The settings a summary names: the model, dtype, device, weight format and forward as the run resolved them
    and the machine it ran on (``cpu``: ``env.machine.cpu_label``, ``gpu``: on CUDA), from the run folder's
    ``settings.json`` (``run_settings``); the config's values where a folder has none (one from before it)."""
    try:
        saved = json.loads((out / "settings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        saved = None
    saved = saved if isinstance(saved, dict) else {}
    machine = {k: saved[k] for k in ("cpu", "gpu") if isinstance(saved.get(k), str)}
    return {
        "model": saved.get("model", cfg.model.name),
        "dtype": saved.get("dtype", cfg.model.dtype),
        "device": saved.get("device", cfg.model.device),
        "weights": saved.get("weights", cfg.model.weights),
        "forward": saved.get("forward"),
        "machine": machine or None,
        "workload": cfg.workload.path,
        "prompts": prompts,
        "max_new_tokens": cfg.decode.max_new_tokens,
        "temperature": cfg.decode.temperature,
        "methods": list(cfg.methods),
    }


def settings_line(s: dict[str, Any]) -> str:
    """A summary's settings in one line (those an older ``summary.json`` lacks left out)."""
    how = ", ".join(f"{k} {s[k]}" for k in ("weights", "forward") if s.get(k))
    dev = f" on {s['device']}" if s.get("device") else ""
    return (f"model {s.get('model', '?')} ({s.get('dtype', '?')}{', ' + how if how else ''}){dev}, workload "
            f"{s.get('workload', '?')} ({s.get('prompts', '?')} prompts), max_new_tokens {s.get('max_new_tokens', '?')}, "
            f"temperature {s.get('temperature', '?')}")  # fmt: skip


def partial_note(records: list[Record], prompts: list[Prompt], methods: list[str]) -> dict[str, Any] | None:
    """None when every method has a record of every prompt; else which prompts every method has finished
    (``common_prompts``, in workload order), how many each method has (``per_method``) and a sentence saying so."""
    have = {m: {r.prompt_id for r in records if r.method == m} for m in methods}
    if all(len(have[m]) == len(prompts) for m in methods):
        return None
    common = [p.prompt_id for p in prompts if all(p.prompt_id in have[m] for m in methods)]
    per_method = {m: len(have[m]) for m in methods}
    each = ", ".join(f"{m} {n}" for m, n in per_method.items())
    text = (
        f"{len(common)} of {len(prompts)} prompts finished by every method; the table compares the methods on "
        f"those only (records per method: {each})"
    )
    return {"prompts": len(prompts), "common": len(common), "per_method": per_method, "text": text,
            "common_prompts": common}  # fmt: skip


def records_stamp(path: Path) -> int | None:
    """The complete lines of a records file (None: no file). It only grows (a resume appends, a torn last line is
    not counted), so a summary made from fewer lines than are there now is stale."""
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return None


def check_results(records: list[Record], prompts: list[Prompt], methods: list[str]) -> list[str]:
    """Problems of a finished run: missing or duplicate (method, prompt) records."""
    seen: dict[tuple[str, str], int] = {}
    for r in records:
        seen[(r.method, r.prompt_id)] = seen.get((r.method, r.prompt_id), 0) + 1
    problems = [f"duplicate {k}" for k, n in seen.items() if n > 1]
    problems += [
        f"missing {(m, p.prompt_id)}" for p in prompts for m in methods if (m, p.prompt_id) not in seen
    ]
    return problems


# ------------------------------------------------------------------------------------------------ command line


def cmd_run(args: Any) -> int:
    import sys

    from experiments.args import output_dir, run_folder_outputs
    from experiments.errors import UserError

    cfg = load_config(args.config, sets=args.set or [])
    select_prompts(cfg)  # a missing or bad workload: one line before the run folder is made
    out = output_dir(args.out or f"runs/{cfg.name}", exclusive=True)
    run_folder_outputs(out, RUN_FILES, ("plots", "policies"))
    result = run(cfg, out, progress=not args.json)
    problems = check_results(load_done(out / "records.jsonl"), select_prompts(cfg), list(cfg.methods))
    if problems:
        raise UserError(f"run {out} is inconsistent: {'; '.join(problems[:5])}")
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "table"}))
        for line in result["notes"]:
            if line.startswith("WARNING"):  # loud in JSON mode too
                print(line, file=sys.stderr)
    else:
        print(
            f"{settings_line(result['settings'])}\nmachine: {machine_label(result['settings']) or 'not recorded'}"
        )
        print(result["table"])
        print(f"\nresults, plots and provenance in {out}/ (draftgym report {out})")
    return 0


def add_config_args(p: Any, out_default: str = "runs/<name>") -> None:
    from experiments.args import path_arg

    p.add_argument("config", type=path_arg, help="a TOML config (see experiments/configs/)")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set decode.max_new_tokens=16 (repeatable; wins over the file)",
    )
    p.add_argument("--out", default=None, help=f"run directory (default {out_default}); reuse it to resume")
    p.add_argument("--json", action="store_true", help="machine-readable output, no progress bars")


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="run the workload x methods of a config into a run directory")
    add_config_args(p)
    p.set_defaults(func=cmd_run)
