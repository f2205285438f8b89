"""Drafters whose state outlives a prompt (``drafters.Carries``: the suffix drafter's answer cache, the recycling
drafter's table) in a run that is killed and resumed.

``bench`` and ``run`` keep each method's drafters across the prompts of a run, so a suffix arm's fifth prompt drafts
from the answers of the first four. After every prompt of such a method its drafters' state is saved
(``POLICY_DIR/drafters-METHOD.npz``, with that prompt's record, before the record is appended to
``records.jsonl``); a resumed run restores it, after its warm-up (which the state already saw once), and appends a
record a kill left only in the state. Without it, the resumed run's drafters started empty and drafted other trees
than an uninterrupted run's.
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
from env.safe_zip import ArchiveProblem, read_npz
from experiments.records import Record

RECORD_KEY = "run_record"  # the JSON bytes of the record of the last prompt the state learned from
STATE_BYTES = 1 << 30


def state_file(state_dir: Path, method: str) -> Path:
    """Where a method's drafter state lives (a file name of safe characters, told apart by a hash of the name)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", method)[:80]
    return state_dir / f"drafters-{safe}-{hashlib.sha256(method.encode()).hexdigest()[:8]}.npz"


def _carriers(decoder: Any) -> dict[str, Any]:
    drafters = getattr(decoder, "drafters", None)
    if not isinstance(drafters, dict):
        return {}
    return {n: d for n, d in drafters.items() if isinstance(d, Carries)}


def save_drafters(decoder: Any, state_dir: Path, method: str, rec: Record) -> None:
    """After a prompt: the state of the method's drafters that carry one, with the prompt's record (atomically)."""
    carriers = _carriers(decoder)
    if not carriers:
        return
    arrays = {f"{n}/{k}": v for n, d in carriers.items() for k, v in d.carried().items()}
    arrays[RECORD_KEY] = np.frombuffer(json.dumps(asdict(rec)).encode(), dtype=np.uint8)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_file(state_dir, method)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def resume_drafters(
    decoders: dict[str, Any], state_dir: Path, rec_path: Path, records: list[Record]
) -> dict[str, dict[str, np.ndarray]]:
    """Read every saved drafter state of ``decoders``' methods (checked) and append to ``rec_path``/``records`` a
    record that a kill left only in its state; returns the states for ``restore_drafters`` (call it after the
    warm-up). A damaged or hostile file is a one-line ``UserError``."""
    from experiments.errors import UserError

    done = {(r.method, r.prompt_id) for r in records}
    pending = {}
    for m, dec in decoders.items():
        path = state_file(state_dir, m)
        if not (_carriers(dec) and path.is_file()):
            continue
        why = None
        try:
            arrays = read_npz(path, max_bytes=STATE_BYTES)
            raw = arrays.pop(RECORD_KEY, None)
            if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
                raise ArchiveProblem(f"no {RECORD_KEY}")
            row = json.loads(raw.tobytes())
            rec = Record(**row) if isinstance(row, dict) else None
            if rec is None or rec.method != m:
                raise ArchiveProblem(f"its record is not one of method {m!r}")
        except (ArchiveProblem, ValueError, TypeError, RecursionError) as err:
            why = str(err)
        if why is not None:
            raise UserError(
                f"{path} is not a drafter state of this run ({why}); delete it to rerun the method"
            )
        pending[m] = arrays
        if (rec.method, rec.prompt_id) not in done:
            with rec_path.open("a") as fh:
                fh.write(json.dumps(asdict(rec)) + "\n")
            records.append(rec)
            done.add((rec.method, rec.prompt_id))
    return pending


def restore_drafters(
    decoders: dict[str, Any], pending: dict[str, dict[str, np.ndarray]], state_dir: Path
) -> None:
    """Give each method's drafters their saved state (``resume_drafters``); a state a drafter refuses: one line."""
    from experiments.errors import UserError

    for m, arrays in pending.items():
        for n, d in _carriers(decoders[m]).items():
            try:
                d.restore({k.removeprefix(f"{n}/"): v for k, v in arrays.items() if k.startswith(f"{n}/")})
            except DrafterError as err:
                raise UserError(f"{state_file(state_dir, m)}: {err}; delete it to rerun the method") from None
