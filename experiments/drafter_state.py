"""Drafters whose state outlives a prompt (``drafters.Carries``: the suffix drafter's answer cache, the recycling
drafter's table) in a run that is killed and resumed.

``bench`` and ``run`` keep each method's drafters across the prompts of a run, so a suffix arm's fifth prompt drafts
from the answers of the first four. After every prompt of such a method its drafters' state is saved
(``POLICY_DIR/drafters-METHOD.npz``, with that prompt's record, before the record is appended to
``records.jsonl``); a resumed run restores it, after its warm-up (which the state already saw once), and appends a
record a kill left only in the state. Without it, the resumed run's drafters started empty and drafted other trees
than an uninterrupted run's.

A policy method (an online bandit over drafting arms) saves its policy's state too, in another file: the drafters'
state is written aside first (``save_drafters``: ``.new.npz``), then the policy's, then the aside file takes its
place (``commit_drafters``), then the record. A kill before the policy was saved leaves both at the prompt before
(the aside file is dropped on resume); a kill after it, the aside file holds the policy's prompt and takes its place
then — the policy and the drafters never resume from different prompts.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from drafters import Carries, DrafterError
from drafters.base import carried_state, restore_state
from env.files import Appending
from env.safe_zip import ArchiveProblem, read_npz
from experiments.records import RUN_RECORD, Record, check_learned, learns_online

RECORD_KEY = "run_record"  # the JSON bytes of the record of the last prompt the state learned from
LEARNED_KEY = "learned"  # the JSON bytes of the prompt ids the state learned from, in order
STATE_BYTES = 1 << 30


def state_file(state_dir: Path, method: str, aside: bool = False) -> Path:
    """Where a method's drafter state lives (a file name of safe characters, told apart by a hash of the name);
    ``aside``: the one written before the policy's state (``commit_drafters`` puts it in place)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", method)[:80]
    name = f"drafters-{safe}-{hashlib.sha256(method.encode()).hexdigest()[:8]}"
    return state_dir / (name + (".new.npz" if aside else ".npz"))


def _carriers(decoder: Any) -> dict[str, Any]:
    drafters = getattr(decoder, "drafters", None)
    if not isinstance(drafters, dict):
        return {}
    return {n: d for n, d in drafters.items() if isinstance(d, Carries)}


def save_drafters(decoder: Any, state_dir: Path, method: str, rec: Record, learned: list[str]) -> None:
    """After a prompt, before the policy's state: the state of the method's drafters that carry one, with the
    prompt's record and the prompts they learned from (``learned``: this one last), written aside (atomically);
    ``commit_drafters`` puts it in place once the policy is saved."""
    carriers = _carriers(decoder)
    if not carriers:
        return
    arrays = carried_state(carriers)
    arrays[RECORD_KEY] = np.frombuffer(json.dumps(asdict(rec)).encode(), dtype=np.uint8)
    arrays[LEARNED_KEY] = np.frombuffer(json.dumps(list(learned)).encode(), dtype=np.uint8)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_file(state_dir, method, aside=True)
    tmp = path.with_name(path.name.removesuffix(".new.npz") + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def commit_drafters(state_dir: Path, method: str) -> None:
    """The state written aside by ``save_drafters`` in place (after the policy's state, before the record)."""
    aside = state_file(state_dir, method, aside=True)
    if aside.is_file():
        aside.replace(state_file(state_dir, method))


def _json(arrays: dict[str, np.ndarray], key: str) -> Any:
    raw = arrays.pop(key, None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise ArchiveProblem(f"no {key}")
    return json.loads(raw.tobytes())


def _read(path: Path, method: str) -> tuple[dict[str, np.ndarray], Record, list[str]]:
    """A saved state's arrays, record and learned prompts (checked: a damaged or hostile file is one line)."""
    from experiments.errors import UserError

    why = None
    try:
        arrays = read_npz(path, max_bytes=STATE_BYTES)
        row, learned = _json(arrays, RECORD_KEY), _json(arrays, LEARNED_KEY)
        rec = Record(**row) if isinstance(row, dict) else None
        if rec is None or rec.method != method:
            raise ArchiveProblem(f"its record is not one of method {method!r}")
        if not isinstance(learned, list) or not learned or learned[-1] != rec.prompt_id:
            raise ArchiveProblem("its learned prompts do not end at its record's")
    except (ArchiveProblem, ValueError, TypeError, RecursionError) as err:
        why = str(err)
    if why is not None:
        raise UserError(f"{path} is not a drafter state of this run ({why}); delete it to rerun the method")
    return arrays, rec, [str(p) for p in learned]


def _policy_record(decoder: Any) -> Any:
    """The last record an online policy's loaded state learned from (a dict; {} when it has none); None: no online
    policy."""
    if not learns_online(decoder):
        return None
    row = (getattr(decoder.policy, "meta", None) or {}).get(RUN_RECORD)
    return row if isinstance(row, dict) else {}


def resume_drafters(
    decoders: dict[str, Any], state_dir: Path, rec_path: Path, records: list[Record], vocab: int | None
) -> dict[str, dict[str, np.ndarray]]:
    """Read every saved drafter state of ``decoders``' methods (their online policies' states already loaded) and
    append to ``rec_path``/``records`` a record that a kill left only in its state; returns the states for
    ``restore_drafters`` (call it after the warm-up). ``vocab``: the target's vocabulary size (state that could
    not have come from it is refused)."""
    from experiments.errors import UserError

    done = {(r.method, r.prompt_id) for r in records}
    pending = {}
    for m, dec in decoders.items():
        if not _carriers(dec):
            continue
        aside = state_file(state_dir, m, aside=True)
        if aside.is_file():  # killed between the drafters' state and the record
            _, rec, _ = _read(aside, m)
            policy = _policy_record(dec)
            if policy is None or policy == asdict(rec):
                commit_drafters(state_dir, m)  # the policy's state (if any) learned that prompt too
            else:
                aside.unlink()  # killed before the policy's state was saved: both resume from the prompt before
        path = state_file(state_dir, m)
        ran = [r.prompt_id for r in records if r.method == m]
        if not path.is_file():
            if ran:  # records of drafters whose state was not kept (a folder from before, a deleted file)
                raise UserError(f"{m} has {len(ran)} records in {rec_path} but no saved drafter state ({path.name}): "
                                "its drafters cannot go on as they were; delete its records to run it again")  # fmt: skip
            continue
        arrays, rec, learned = _read(path, m)
        check_learned(path, m, learned, rec.prompt_id, records)
        restore_drafters({m: dec}, {m: arrays}, state_dir, vocab)  # checked before its record is appended
        pending[m] = arrays
        if (rec.method, rec.prompt_id) not in done:
            with Appending(rec_path) as fh:
                fh.write(json.dumps(asdict(rec)) + "\n")
            records.append(rec)
            done.add((rec.method, rec.prompt_id))
    return pending


def restore_drafters(
    decoders: dict[str, Any], pending: dict[str, dict[str, np.ndarray]], state_dir: Path, vocab: int | None
) -> None:
    """Give each method's drafters their saved state (``resume_drafters``); a state a drafter refuses: one line."""
    from experiments.errors import UserError

    for m, arrays in pending.items():
        try:
            restore_state(_carriers(decoders[m]), arrays, vocab)
        except DrafterError as err:
            raise UserError(f"{state_file(state_dir, m)}: {err}; delete it to rerun the method") from None
