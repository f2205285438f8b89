"""Recording a trace (``draftgym record``; the format is ``env.trace``): greedy autoregressive decoding of every
prompt on the batch engine, with each root's position features and every probe drafter's largest proposal.

One part per prompt is written under ``OUT.parts/`` as it goes (atomically), so a killed run resumes where it
stopped; probes whose state outlives a prompt (``drafters.Carries``) have it saved after every part and restored on
a resume. ``OUT`` is assembled at the end and the parts removed.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from drafters import Carries, Drafter, DrafterError, DraftTree, make_drafter
from drafters.base import carried_state, restore_state
from drafters.heads import head_paths
from env.features import FeatureSpec, position_feature_names, position_features, projection
from env.file_checks import int64_problem, one_line
from env.files import atomic_write_text, file_digest, writing_temporary
from env.folder_lock import claim_folder, release_folder
from env.safe_zip import ArchiveProblem, parse_json, read_npz
from env.step import Stepper, largest_shape
from env.trace import (
    FORMAT,
    TRACE_BYTES,
    TREE_NODES,
    VERSION,
    Trace,
    TraceError,
    TreeArrays,
    check_trace,
    load_trace,
    model_fingerprint,
)


def _drafter_header(name: str, d: Drafter, options: dict[str, Any]) -> dict[str, Any]:
    s = largest_shape(d)
    exact = bool(getattr(d, "exact_replay", False)) and hasattr(d, "max_shape")
    return {"exact": exact, "shape": [s.depth, s.topk, s.budget], "options": options}


def drafter_options_problem(name: Any, opts: Any) -> str | None:
    """What is wrong with ``opts`` as the constructor options of drafter ``name``, as read from a file (a trace's
    header, a serving policy's meta), or None: a drafter this draftgym lacks, options that are not a table, an option
    it does not take, a 64-bit overflow, or a value it refuses. The text does not name the file."""
    from drafters import DRAFTERS
    from drafters.base import keyword_options, shown

    if not isinstance(name, str) or name not in DRAFTERS:
        return "not a drafter this draftgym has"
    if not isinstance(opts, dict):
        return "not a table of options"
    bad = sorted(shown(k, 40) for k in opts if k not in keyword_options(DRAFTERS[name]))
    if bad:
        return f"{bad[0]} is not an option of {name}"
    why = int64_problem(opts)
    if why:
        return f"a value {why}"
    try:
        make_drafter(name, **opts)  # a value the drafter refuses: here, not mid-run
    except (DrafterError, TypeError, ValueError, ArithmeticError) as err:
        return one_line(str(err))[:200]
    return None


def recorded_drafter_options(trace: Trace, source: str) -> dict[str, dict[str, Any]]:
    """The drafter options ``trace`` was recorded with (``draftgym record --drafter-option``, kept in its header):
    what a live run of its menu must serve with, so that live serves the drafters replay priced. The header comes
    from a file: a drafter this draftgym lacks, an option it does not take, a 64-bit overflow or a value it refuses
    is a ``TraceError`` naming ``source`` (``drafter_options_problem``)."""
    from drafters.base import shown

    out: dict[str, dict[str, Any]] = {}
    for name, head in trace.drafters.items():
        opts = head.get("options") if isinstance(head, dict) else None
        if not opts:
            continue
        why = drafter_options_problem(name, opts)
        if why:
            where = f"{source}: the options recorded for {shown(name, 40)}"
            raise TraceError(f"{where} are {why}" if why == "not a table of options" else f"{where}: {why}")
        out[name] = dict(opts)
    return out


def record_prompt(
    stepper: Stepper,
    probes: dict[str, Drafter],
    prompt_ids: list[int],
    max_new_tokens: int,
    spec: FeatureSpec,
    proj: np.ndarray,
) -> dict[str, np.ndarray]:
    """Greedy autoregressive decoding of one prompt (``stepper``'s menu: no draft alone); at every root, its
    position features and each probe drafter's largest proposal. Returns the arrays of one part."""
    seq = stepper.start(prompt_ids, max_new_tokens, probes)
    row = seq.row
    feats: list[np.ndarray] = []
    trees: dict[str, list[DraftTree]] = {n: [] for n in probes}
    try:
        while True:
            feats.append(position_features(row.last_logits, row.last_hidden, row.tokens, spec, proj))
            for name, tree in stepper.proposals(seq, list(probes)).items():
                trees[name].append(tree)
            if seq.done:
                break
            stepper.step([0])
    finally:
        stepper.retire(seq)
    out = {
        "prompt": np.asarray(prompt_ids, dtype=np.int32),
        "traj": np.asarray(row.tokens[row.prompt_len :], dtype=np.int32),
        "feat": np.stack(feats).astype(np.float32),
    }
    for name, ts in trees.items():
        sizes = [t.num_nodes for t in ts]
        out[f"{name}/off"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        out[f"{name}/tokens"] = np.concatenate([t.tokens.numpy() for t in ts]).astype(np.int32)
        out[f"{name}/parents"] = np.concatenate([t.parents.numpy() for t in ts]).astype(np.int16)
    assert out["traj"].shape[0] == out["feat"].shape[0]
    return out


def _assemble(header: dict[str, Any], parts: list[dict[str, np.ndarray]]) -> Trace:
    def cat_off(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        off = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrays])]).astype(np.int64)
        return np.concatenate(arrays), off

    prompt_tokens, prompt_off = cat_off([p["prompt"] for p in parts])
    traj, traj_off = cat_off([p["traj"] for p in parts])
    feat = np.concatenate([p["feat"] for p in parts])
    trees = {}
    for name in header["drafters"]:
        offs, base = [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            offs.append(p[f"{name}/off"][1:] + base)
            base += int(p[f"{name}/off"][-1])
        trees[name] = TreeArrays(
            np.concatenate(offs),
            np.concatenate([p[f"{name}/tokens"] for p in parts]),
            np.concatenate([p[f"{name}/parents"] for p in parts]),
        )
    return Trace(header, prompt_tokens, prompt_off, traj, traj_off, feat, trees)


def record(
    loaded: Any,
    prompts: Sequence[Any],
    drafter_names: Sequence[str],
    out: str | Path,
    *,
    max_new_tokens: int = 128,
    spec: FeatureSpec | None = None,
    drafter_options: dict[str, dict[str, Any]] | None = None,
    workload: str = "builtin",
    progress: bool = True,
    overwrite: bool = False,
) -> Trace:
    """Record a trace of ``prompts`` (``env.workloads.Prompt``) into ``out``; resumes from ``out.parts/``. A
    finished ``out`` of the same settings is returned as it is (a rerun after the end, or after a kill while the
    parts were deleted); one of other settings is refused unless ``overwrite``."""
    from env.batch import BatchEngine
    from env.decoder import chat_prompt
    from env.target import check_prompt
    from env.workloads import prompts_digest

    out = Path(out)
    spec = spec or FeatureSpec()
    if max_new_tokens < 2:
        raise TraceError(f"max_new_tokens must be >= 2, got {max_new_tokens}")
    names = [n for n in dict.fromkeys(drafter_names) if n != "none"]
    if not names:
        raise TraceError("record needs at least one drafter (e.g. --drafters ngram)")
    options = drafter_options or {}
    probes = {n: make_drafter(n, **options.get(n, {})) for n in names}
    for n, d in probes.items():  # a tree a trace cannot hold (int16 parents) refused before any decoding
        s = largest_shape(d)
        if s.max_nodes + 1 > TREE_NODES:
            raise TraceError(
                f"{n}'s largest proposal (depth {s.depth}, topk {s.topk}, budget {s.budget or 'none'}: "
                f"{s.max_nodes} draft nodes) is more than a trace's {TREE_NODES - 1}; lower its options"
            )
    ids = [str(p.prompt_id) for p in prompts]
    if len(set(ids)) != len(ids):
        raise TraceError("the workload repeats a prompt id; a trace needs unique prompt ids")
    engine = BatchEngine(loaded, max_rows=1)
    for p in prompts:  # every prompt fits, before anything is written
        check_prompt(chat_prompt(loaded.tokenizer, p.text), loaded.max_context, f"prompt {p.prompt_id}")
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": model_fingerprint(loaded),
        "sampling": "greedy",
        "max_new_tokens": int(max_new_tokens),
        # the context the trajectories were decoded in: replay cuts trees that outgrow it as the live engine does
        "max_context": int(loaded.max_context),
        "features": {"spec": spec.as_dict(), "names": position_feature_names(spec)},
        "drafters": {n: _drafter_header(n, d, options.get(n, {})) for n, d in probes.items()},
        "workload": str(workload),
        "prompts": {"ids": ids, "categories": [str(p.category) for p in prompts]},
        # what else decides the trajectories: the weight format and forward the target ran in, and the workload
        # file's bytes (an edited file under the same path: other prompts under the same ids)
        "engine": {
            "weights": str(getattr(loaded, "weights", "dense")),
            "forward": str(getattr(loaded, "forward", "lean")),
        },
        "workload_sha256": file_digest(workload) if Path(str(workload)).is_file() else None,
        # the built-in set's or a ``code:`` source's prompts (no file of the user's: a package upgrade may change
        # their text under the same ids)
        "workload_prompts_sha256": prompts_digest(str(workload)),
        # the device the target ran on: greedy outputs may differ between a GPU's kernels and the CPU's, so a
        # recording is not resumed on another
        "device": str(loaded.device),
        # the head files the drafters load, by sha256 (a head retrained or swapped under its file name between a
        # kill and a resume: its trees would be of two heads)
        "heads": {
            k: file_digest(p) for n, d in probes.items() for k, p in head_paths(n, d, loaded.model_id).items()
        },
    }
    parts_dir = _parts_folders(out)[0]
    check_parts_folders(out)
    if out.exists() and not overwrite:
        old = load_trace(out)
        want = json.loads(json.dumps(header))
        diff = sorted(k for k in want if _differs(old.header, want, k))
        if diff:
            raise TraceError(
                f"{out} already holds a trace of other settings ({_named(diff, old.header, want)} differ); delete it, "
                f"pass --overwrite or choose another --out"
            )
        if parts_dir.is_dir():  # a finished recording's parts: removed, though not while another writes them
            claim_folder(parts_dir, str(parts_dir))
            try:
                _check_parts_contents(out)
                _remove_parts(parts_dir)
            finally:
                release_folder(parts_dir)
        return old
    parts_dir.mkdir(parents=True, exist_ok=True)
    claim_folder(parts_dir, str(parts_dir))  # one recording at a time writes these parts
    try:
        _check_parts_contents(out)  # (held: another recording's files no longer come and go)
        return _record_held(
            loaded, engine, prompts, probes, out, max_new_tokens, spec, header, parts_dir, progress
        )
    finally:
        release_folder(parts_dir)  # after the parts are removed (another recording could take them at once)


def _record_held(loaded: Any, engine: Any, prompts: list[Any], probes: dict[str, Drafter], out: Path,
                 max_new_tokens: int, spec: FeatureSpec, header: dict[str, Any], parts_dir: Path, progress: bool
                 ) -> Trace:  # fmt: skip
    """``record``'s work once it holds ``parts_dir``: the parts checked or started, the prompts not yet recorded
    recorded, the trace assembled and saved, the parts removed."""
    from tqdm import tqdm

    from env.decoder import chat_prompt
    from env.engine import NO_DRAFT

    head_file = parts_dir / "header.json"
    if head_file.is_file():
        try:
            old = parse_json(head_file.read_bytes())
        except (ArchiveProblem, OSError) as err:
            raise TraceError(
                f"{head_file} is not readable ({err}); delete {parts_dir} to record again"
            ) from None
        if not isinstance(old, dict):
            raise TraceError(f"{head_file} is not a recording's header; delete {parts_dir} to record again")
        diff = sorted(k for k in header if _differs(old, header, k))
        if diff:
            raise TraceError(
                f"{parts_dir} holds a partial recording with other settings ({_named(diff, old, header)} differ); "
                f"delete it or choose another --out"
            )
    else:
        atomic_write_text(head_file, json.dumps(header))  # torn, it would stop every later resume
    carriers = {n: d for n, d in probes.items() if isinstance(d, Carries)}
    if carriers:
        _resume_carriers(parts_dir, len(prompts), carriers, int(loaded.config.vocab_size))
    parts = {}  # an earlier run's parts, each checked before anything is recorded
    for i in range(len(prompts)):
        if (parts_dir / f"{i:05d}.npz").is_file():
            parts[i] = _read_part(parts_dir / f"{i:05d}.npz", header, i)
            if not np.array_equal(parts[i]["prompt"], chat_prompt(loaded.tokenizer, prompts[i].text)):
                raise TraceError(  # a part copied or moved into another's place: the trace would mislabel it
                    f"{parts_dir / f'{i:05d}.npz'} records another prompt than prompt {prompts[i].prompt_id}, "
                    f"number {i + 1} of the workload; delete it to record that prompt again"
                )
    if parts and progress:
        print(f"resuming: {len(parts)} of {len(prompts)} prompts already recorded", file=sys.stderr)
    stepper = Stepper(engine, [NO_DRAFT])
    proj = projection(int(loaded.config.hidden_size), spec)
    bar = tqdm(prompts, desc="record", unit="prompt", disable=not progress)
    for i, p in enumerate(bar):
        part_file = parts_dir / f"{i:05d}.npz"
        if i not in parts:
            arrays = record_prompt(
                stepper, probes, chat_prompt(loaded.tokenizer, p.text), max_new_tokens, spec, proj
            )
            with writing_temporary(part_file, parts_dir / f"{i:05d}.tmp.npz") as tmp:
                np.savez(tmp, **arrays)
                tmp.replace(part_file)
            if (
                carriers
            ):  # after the part: a kill in between leaves the state one part behind (that part redone)
                state = carried_state(carriers)
                with writing_temporary(parts_dir / PROBES_FILE, parts_dir / "probes.tmp.npz") as tmp:
                    np.savez(tmp, part=np.int64(i + 1), **state)
                    tmp.replace(parts_dir / PROBES_FILE)
            parts[i] = _read_part(part_file, header, i)
    header = dict(header)
    header["created"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    header["provenance"] = _provenance()  # where it was recorded (not compared on a resume)
    try:
        trace = _assemble(header, [parts[i] for i in range(len(prompts))])
    except (KeyError, ValueError) as err:
        raise TraceError(
            f"{parts_dir} holds a part of another recording ({one_line(str(err))}); delete it"
        ) from None
    trace.save(out)
    _remove_parts(parts_dir)
    return trace


def _read_part(part_file: Path, header: dict[str, Any], i: int) -> dict[str, np.ndarray]:
    """Part ``i`` read back and given the checks ``load_trace`` gives a trace's arrays (``env.trace.check_trace``,
    as a trace of this one prompt): a damaged part is refused here, while the parts are kept, not assembled into a
    trace that no command could load."""
    again = f"delete {part_file.parent} to record afresh"
    try:
        part = read_npz(part_file, max_bytes=TRACE_BYTES)
    except ArchiveProblem as err:
        raise TraceError(
            one_line(f"{part_file} is a corrupted part of this recording ({err}); delete it to record again")
        ) from None
    names = [
        "prompt",
        "traj",
        "feat",
        *(f"{n}/{a}" for n in header["drafters"] for a in ("off", "tokens", "parents")),
    ]
    missing = [n for n in names if n not in part]
    if missing:
        raise TraceError(f"recorded part {part_file} holds no {missing[0]} array; {again}")
    ids, cats = header["prompts"]["ids"], header["prompts"]["categories"]
    one = {**header, "prompts": {"ids": [ids[i]], "categories": [cats[i]]}}
    prompt, traj = part["prompt"], part["traj"]
    trees = {
        n: TreeArrays(part[f"{n}/off"], part[f"{n}/tokens"], part[f"{n}/parents"]) for n in header["drafters"]
    }
    # .size: a 0-d or 2-D array gets offsets here and is refused by its rank in check_trace
    prompt_off, traj_off = (np.array([0, a.size], dtype=np.int64) for a in (prompt, traj))
    try:
        check_trace(
            f"recorded part {part_file}", Trace(one, prompt, prompt_off, traj, traj_off, part["feat"], trees)
        )
    except TraceError as err:
        raise TraceError(one_line(f"{err}; {again}")) from None
    return part


# header keys a recording from before they existed does not have: not compared then (it is taken as it is)
LATER_KEYS = ("engine", "workload_sha256", "device", "max_context", "workload_prompts_sha256", "heads")


def _provenance() -> dict[str, Any]:
    """The machine, library versions and command line of a recording (DESIGN's provenance of a result file)."""
    import sys

    from env.machine import library_versions, machine_info

    return {"machine": machine_info(), "versions": library_versions(),
            "command": " ".join(["draftgym", *sys.argv[1:]])}  # fmt: skip


def _named(keys: list[str], old: dict[str, Any], new: dict[str, Any]) -> str:
    """The header keys that differ, the heads by drafter (``heads: eagle``: a head retrained under its name)."""
    a, b = old.get("heads"), new.get("heads")
    if "heads" in keys and isinstance(a, dict) and isinstance(b, dict):
        names = sorted(n for n in {*a, *b} if a.get(n) != b.get(n))
        keys = [f"heads ({', '.join(map(str, names))})" if k == "heads" else k for k in keys]
    return ", ".join(keys)


def _differs(old: dict[str, Any], new: dict[str, Any], key: str) -> bool:
    if key in LATER_KEYS and key not in old:
        return False
    return old.get(key) != new.get(key)


PROBES_FILE = "probes.npz"  # the probes' carried state after the parts before ``part``


def _resume_carriers(parts_dir: Path, n_prompts: int, carriers: dict[str, Any], vocab: int) -> None:
    """Probes whose state outlives a prompt (``drafters.Carries``: the suffix drafter's answer cache, the
    recycling drafter's table) must go on, after a kill, as they were at the first prompt recorded again: their
    state is restored from ``PROBES_FILE`` (kept after every part), and the parts it does not cover are recorded
    again (a kill between a part and the state; a part deleted by hand: all, from fresh probes)."""
    state_file = parts_dir / PROBES_FILE
    have = 0
    while have < n_prompts and (parts_dir / f"{have:05d}.npz").is_file():
        have += 1
    covered, arrays = 0, {}
    if state_file.is_file():
        try:
            arrays = read_npz(state_file, max_bytes=TRACE_BYTES)
            part = arrays.pop("part", None)
            if (
                part is None
                or part.shape != ()
                or part.dtype.kind not in "iu"
                or not 0 < int(part) <= n_prompts
            ):
                raise ArchiveProblem(f"no part count in 1..{n_prompts}")
        except ArchiveProblem as err:
            raise TraceError(
                f"{state_file} is not the probes' state of this recording ({err}); delete it to record again"
            ) from None
        covered = int(part)
    keep = covered if covered <= have else 0  # state past a missing part: nothing before it can be continued
    redo = sorted(f for f in parts_dir.glob("[0-9]*[0-9].npz") if f.stem.isdigit() and int(f.stem) >= keep)
    if redo:
        print(
            f"record: {len(redo)} recorded prompt(s) past the probes' saved state are recorded again",
            file=sys.stderr,
        )
    for f in redo:
        f.unlink()
    if keep == 0:
        state_file.unlink(missing_ok=True)
        return
    try:
        restore_state(carriers, arrays, vocab)
    except DrafterError as err:
        raise TraceError(f"{state_file}: {err}; delete it to record again") from None


# what a recording writes in its parts folder: the header, a part per prompt (five digits or more), the probes'
# state (each also as the temporary file it is renamed from), and ``env.files``' temporary files
_PARTS_FILE = re.compile(r"header\.json|\d{5,}(\.tmp)?\.npz|probes(\.tmp)?\.npz|\..+\.\d+(\.dg)?\.tmp")


def _parts_folders(out: Path) -> tuple[Path, Path]:
    """The parts folder of a recording into ``out`` and its trash (``.parts.done``, while its parts are deleted):
    both are deleted whole when the recording ends."""
    parts = out.with_name(out.name + ".parts")
    return parts, parts.with_name(parts.name + ".done")


def check_parts_folders(out: str | Path) -> None:
    """Refuse (``TraceError``) a parts folder or its trash that is a file or a link (a link's target was not what
    the deletion removes): checked before the model loads; what they hold is checked once the folder is held."""
    for folder in _parts_folders(Path(out)):
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise TraceError(
                f"{folder} is not a folder of recorded parts; move it away or choose another --out"
            )


def _check_parts_contents(out: Path) -> None:
    """Refuse a parts folder or its trash holding anything a recording does not write: a user's files would be
    deleted with them. Called while the parts folder is held, so no other recording's files come and go meanwhile."""
    for folder in _parts_folders(out):
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            if not _PARTS_FILE.fullmatch(f.name) or f.is_symlink() or not f.is_file():
                raise TraceError(
                    f"{folder} holds {one_line(f.name)!r}, which no recording writes (the folder is deleted when "
                    f"the recording ends); move it away or choose another --out"
                )


def _remove_parts(parts_dir: Path) -> None:
    """Delete the parts of a finished recording, renamed away first: a kill while deleting must not leave a
    ``.parts`` folder without its header, whose remaining parts a later recording would take as its own."""
    trash = parts_dir.with_name(parts_dir.name + ".done")
    shutil.rmtree(trash, ignore_errors=True)
    if parts_dir.is_dir():
        parts_dir.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def part_progress(out: str | Path) -> int:
    """How many prompts a resumable recording into ``out`` has finished."""
    parts_dir = Path(out).with_name(Path(out).name + ".parts")
    return len(list(parts_dir.glob("[0-9]*[0-9].npz"))) if parts_dir.is_dir() else 0


__all__ = ["check_parts_folders", "part_progress", "record", "record_prompt"]
