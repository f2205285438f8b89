"""The work file of ``draftgym calibrate --batch`` (``env.batch_calibrate.calibrate_batch(work=...)``): what a
calibration has measured so far — the grid's samples after each pass, then the probe, the prefill, the drafters, the policy's bookkeeping —
written atomically after each, so that a killed calibration resumes where it stopped. A rerun resumes only with the
same settings on the same CPU (timings of another machine or grid would be mixed in); anything else in the file is
refused in one line naming the field, and nothing in it is run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drafters.base import shown
from env.batch_cost import BatchedDraft
from env.cost import CostModelError
from env.file_checks import Bad, finite_seconds, get, integer, one_line

STATE_FORMAT = "draftgym-batch-calibration-state"
MAX_STATE_BYTES = 16 << 20  # a grid of 5 x 6 x 2 cells at a few hundred samples each is ~100 kB


def _cell_key(cell: Sequence[int]) -> str:
    return ",".join(str(int(x)) for x in cell)


def _measured(d: dict[str, Any], key: str, kind: type, need: str) -> Any:
    """A phase's measurements, or None where the phase has not run (absent or null)."""
    return None if d.get(key) is None else get(d, key, kind, need)


@dataclass
class CalibrationState:
    path: Path | None
    settings: dict[str, Any]
    passes: int = 0
    samples: dict[tuple[int, int, int], list[float]] = field(default_factory=dict)
    probe: dict[tuple[int, int], float] | None = None
    prefill: list[float] | None = None
    drafters: dict[str, float] | None = None
    batched: dict[str, BatchedDraft] = field(default_factory=dict)
    policy_book: list[float] | None = None  # per grid row count, after the drafters (the last phase)
    resumed: bool = False
    run_steps: int = 1  # samples per cell per pass

    @classmethod
    def open(cls, work: str | Path | None, loaded: Any, names: Sequence[str], options: dict[str, Any],
             rows: Sequence[int], nodes: Sequence[int], contexts: Sequence[int], reps: int, *,
             batching: Sequence[str] = (), prefill_lengths: Sequence[int] = (), run_steps: int = 1,
             batched_timing: str = "") -> CalibrationState:  # fmt: skip
        """The state of a calibration with these settings: read from ``work`` when it holds one (a resume), else
        empty (and nothing written until the first pass; ``work`` None: kept in memory only). ``batching``: the
        drafters of ``names`` timed per batch; ``prefill_lengths``: the prompt lengths the prefill is timed at;
        ``batched_timing``: how those are timed (a work file that timed them otherwise is not resumed)."""
        import torch

        from env.machine import cpu_label

        settings = json.loads(json.dumps({
            "model": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."),
            "weights": str(getattr(loaded, "weights", "dense")), "forward": getattr(loaded, "forward", "hf"),
            "device": str(getattr(loaded, "device", "cpu")), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "drafters": list(names), "batched": list(batching), "options": options,
            "rows": [int(r) for r in rows], "nodes": [int(n) for n in nodes], "contexts": [int(c) for c in contexts],
            "reps": int(reps), "prefill_lengths": [int(n) for n in prefill_lengths], "cpu": cpu_label(),
            **({"batched_timing": batched_timing} if batching else {})},
            default=str))  # fmt: skip
        path = None if work is None else Path(work)
        state = cls(path, settings, run_steps=int(run_steps))
        if path is not None and path.exists():
            state._read(path)
        return state

    @staticmethod
    def check_file(path: str | Path) -> None:
        """A work file there, if any, is readable and one of this command's (its format and version): checked
        before the model loads; whether its settings are this run's is checked by ``open``."""
        path = Path(path)
        if path.exists() or path.is_symlink():
            d = CalibrationState._load(path)
            try:
                if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
                    raise Bad("format", f"must be {STATE_FORMAT!r} (this is no calibration work file)")
                integer(d.get("version"), "version", 1, 1)
            except Bad as bad:
                field_, problem = bad.args
                raise CostModelError(
                    one_line(f"calibration work file {path}: {field_} {problem}; delete it to start over")
                ) from None

    @staticmethod
    def _load(path: Path) -> Any:
        where = f"calibration work file {path}"
        if not path.is_file():  # a folder, a FIFO (which would block the read) or a device
            raise CostModelError(f"{where} is not a regular file; delete it to start over")
        try:
            if path.stat().st_size > MAX_STATE_BYTES:
                raise CostModelError(
                    f"{where} is over {MAX_STATE_BYTES >> 20} MB: not one this command wrote"
                )
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:  # JSON's and UTF-8's errors are ValueErrors
            raise CostModelError(
                one_line(f"{where} is not readable JSON ({err}); delete it to start over")
            ) from None
        return d

    def _read(self, path: Path) -> None:
        where = f"calibration work file {path}"
        d = self._load(path)
        try:
            self._check(d)
        except Bad as bad:
            field_, problem = bad.args
            raise CostModelError(one_line(f"{where}: {field_} {problem}; delete it to start over")) from None

    def _check(self, d: Any) -> None:
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
            raise Bad("format", f"must be {STATE_FORMAT!r} (this is no calibration work file)")
        integer(d.get("version"), "version", 1, 1)
        before = get(d, "settings", dict, "an object")
        if before != self.settings:
            diff = sorted(
                k for k in set(before) | set(self.settings) if before.get(k) != self.settings.get(k)
            )
            said = ", ".join(
                f"{shown(k)} {shown(before.get(k))} (now {shown(self.settings.get(k))})" for k in diff[:3]
            )
            raise Bad("settings", f"are another calibration's: {said}")
        extra = sorted(set(d) - {"format", "version", "settings", "passes", "samples", "probe", "prefill", "drafters",
                                 "batched", "policy_book"})  # fmt: skip
        if extra:
            raise Bad(shown(extra[0]), "is no field of a calibration work file")
        reps = self.settings["reps"]
        self.passes = integer(d.get("passes"), "passes", 0, reps)
        cells = {_cell_key((r, n, c)): (r, n, c) for r in self.settings["rows"] for n in self.settings["nodes"]
                 for c in self.settings["contexts"]}  # fmt: skip
        raw = get(d, "samples", dict, "an object")
        for key, values in raw.items():
            if key not in cells:
                raise Bad(f"samples.{shown(key)}", "is no cell of this grid")
            if not isinstance(values, list) or len(values) != self.passes * self.run_steps:
                raise Bad(f"samples.{key}", f"must be a list of {self.passes * self.run_steps} seconds")
            self.samples[cells[key]] = [finite_seconds(v, f"samples.{key}", positive=True) for v in values]
        if self.passes and set(raw) != set(cells):
            raise Bad("samples", f"must hold the grid's {len(cells)} cells")
        later = [k for k in ("probe", "prefill", "drafters", "policy_book") if d.get(k) is not None] + (
            ["batched"] if d.get("batched") else []
        )
        if later and self.passes < reps:
            raise Bad(later[0], f"is measured after the grid's {reps} passes, and the file has {self.passes}")
        probe = _measured(d, "probe", dict, "an object")
        if probe is not None:
            pairs = {f"{r},{c}": (r, c) for r in self.settings["rows"] for c in self.settings["contexts"]}
            if set(probe) != set(pairs):
                raise Bad("probe", f"must hold {len(pairs)} cells (rows,context)")
            self.probe = {pairs[k]: finite_seconds(v, f"probe.{k}", positive=True) for k, v in probe.items()}
        prefill = _measured(d, "prefill", list, "a list")
        if prefill is not None:
            n = len(self.settings["prefill_lengths"])
            if len(prefill) != n:
                raise Bad(
                    "prefill",
                    f"must be {n} seconds, one per prompt length {self.settings['prefill_lengths']}",
                )
            self.prefill = [finite_seconds(v, "prefill", positive=True) for v in prefill]
        drafters = _measured(d, "drafters", dict, "an object")
        if drafters is not None:
            if set(drafters) != set(self.settings["drafters"]):
                raise Bad("drafters", f"must be the timings of {self.settings['drafters']}")
            self.drafters = {
                k: finite_seconds(v, f"drafters.{k}", positive=True) for k, v in drafters.items()
            }
        for name, b in get(d, "batched", dict, "an object").items():
            if name not in self.settings["batched"]:
                raise Bad(
                    f"batched.{shown(name)}",
                    f"is no drafter timed per batch here ({self.settings['batched']})",
                )
            try:
                self.batched[name] = BatchedDraft.from_json(b, "it")
            except CostModelError as err:
                raise Bad(
                    f"batched.{name}", one_line(str(err)).removeprefix("it ").removeprefix("it: ")
                ) from None
            if list(self.batched[name].rows) != self.settings["rows"]:
                raise Bad(f"batched.{name}.rows", f"must be the grid's rows {self.settings['rows']}")
        book = _measured(d, "policy_book", list, "a list")
        if book is not None:
            n = len(self.settings["rows"])
            if len(book) != n:
                raise Bad("policy_book", f"must be {n} seconds, one per row count {self.settings['rows']}")
            if self.drafters is None or set(self.batched) != set(self.settings["batched"]):
                raise Bad(
                    "policy_book", "is measured after the drafters, and the file has not timed them all"
                )
            self.policy_book = [finite_seconds(v, "policy_book") for v in book]
            if max(self.policy_book) > 1.0 or any(
                b < a for a, b in zip(self.policy_book, self.policy_book[1:])
            ):
                raise Bad("policy_book", "must be seconds in [0, 1], not falling with more rows")
        self.resumed = bool(self.passes)

    def _write(self) -> None:
        if self.path is None:
            return
        from env.files import atomic_write_text

        d = {"format": STATE_FORMAT, "version": 1, "settings": self.settings, "passes": self.passes,
             "samples": {_cell_key(c): v for c, v in self.samples.items()},
             "probe": None if self.probe is None else {f"{r},{c}": s for (r, c), s in self.probe.items()},
             "prefill": self.prefill, "drafters": self.drafters,
             "batched": {k: b.to_json() for k, b in self.batched.items()},
             "policy_book": self.policy_book}  # fmt: skip
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(d) + "\n")

    def save_pass(self, samples: dict[tuple[int, int, int], list[float]], passes: int) -> None:
        self.samples, self.passes = {c: list(v) for c, v in samples.items()}, passes
        self._write()

    def save_phase(self, name: str, value: Any) -> None:
        """``name``: ``probe``, ``prefill``, ``drafters`` or ``policy_book``, measured."""
        setattr(self, name, value)
        self._write()

    def save_batched(self, name: str, value: BatchedDraft) -> None:
        self.batched[name] = value
        self._write()


__all__ = ["STATE_FORMAT", "CalibrationState"]
