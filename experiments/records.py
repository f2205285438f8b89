"""The records a benchmark or run writes, one JSON line per (method, prompt), and what a resumed run reads back:
the records (checked: a wrong-typed one runs again), an online policy's state saved with its last record, and the
settings a run folder's results depend on (``experiments.args.same_settings``). Each record names the session
(one ``bench`` or ``run`` call, ``new_session``) that timed it: a folder resumed or extended later holds records
of several sessions, and a ratio between two of them compares runs made at different times.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from env.files import Appending, file_digest, jsonl_lines
from env.model import LoadedModel


@dataclass(frozen=True)
class Record:
    method: str
    prompt_id: str
    category: str
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    steps: int
    tau: float | None
    token_ids: list[int]
    arms: list[str] = field(default_factory=list)  # the arm of each step after prefill (our decoders only)
    session: str | None = None  # the call that timed it (``new_session``); None: an older record

    def __post_init__(self) -> None:
        """A record read back from a results file must be one we could have written (``TypeError`` otherwise: the
        readers skip it, and the prompt runs again)."""

        def count(x: object) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0

        def real(x: object) -> bool:
            return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

        ok = (
            all(isinstance(x, str) for x in (self.method, self.prompt_id, self.category))
            and all(count(x) for x in (self.prompt_tokens, self.new_tokens, self.steps))
            and real(self.wall_s)
            and (self.tau is None or real(self.tau))
            and isinstance(self.token_ids, list)
            and all(count(t) for t in self.token_ids)
            and isinstance(self.arms, list)
            and all(isinstance(a, str) for a in self.arms)
            and (self.session is None or isinstance(self.session, str))
        )
        # ... and consistent: its tokens are the ids it lists (10^6 of them with 16 ids gave 10^12 tokens/s; a wall
        # of 0 s compares nothing in the tables, ``experiments.bench.summarize``)
        if not ok:
            raise TypeError(f"not a result record: {self.method!r} on prompt {self.prompt_id!r}")
        if self.new_tokens != len(self.token_ids):
            raise TypeError(f"not a result record: {self.method!r} on prompt {self.prompt_id!r} counts "
                            f"{self.new_tokens} new tokens and lists {len(self.token_ids)} ids")  # fmt: skip


def new_session() -> str:
    """A name for one timing session (a ``bench`` or ``run`` call): its start time, process id and 4 random hex
    digits, e.g. ``2025-01-31T14:02:11-pid4242-9f3a``."""
    import datetime as dt
    import os
    import secrets

    return f"{dt.datetime.now():%Y-%m-%dT%H:%M:%S}-pid{os.getpid()}-{secrets.token_hex(2)}"


RUN_RECORD = "run_record"  # policy state meta: the record of the last prompt that state learned from
RUN_LEARNED = "run_learned"  # policy state meta: the prompt ids that state learned from, in order


def check_learned(where: Any, method: str, learned: Any, last: str | None, records: list[Record]) -> None:
    """A saved state (an online policy's, a method's drafters') learned from the prompts ``learned``, ``last`` the
    prompt of the record it holds: the method's records must be those prompts (``last`` may be missing — a kill
    before its record), else resuming would go on from a state that saw prompts the run has no record of (a
    deleted or replaced records file) or missed some it has. One line; a state without the list (from before it
    was kept) is not checked."""
    if not isinstance(learned, list):
        return
    ran = {r.prompt_id for r in records if r.method == method}
    if ran - {last} != {str(p) for p in learned} - {last}:
        from experiments.errors import UserError

        raise UserError(f"{where} learned from other prompts of {method} than the run's records.jsonl holds; "
                        "delete the method's records and its saved state to run it again")  # fmt: skip


def learns_online(decoder: Any) -> bool:
    """Whether a decoder's policy learns while it decodes (bandits and the like): its state is part of a run."""
    policy = getattr(decoder, "policy", None)
    return policy is not None and hasattr(policy, "update") and hasattr(policy, "save")


def resume_learners(decoders: dict[str, Any], state_dir: Path, rec_path: Path, records: list[Record]) -> None:
    """A resumed run's online policies continue from their state after the last prompt recorded (``state_dir/
    NAME.zip``, saved with that prompt's record in its meta before the record was appended; a kill in between
    leaves the record only in the state, and it is appended here), not from the file they started from."""
    from policies.base import load_policy

    done = {(r.method, r.prompt_id) for r in records}
    for m, dec in decoders.items():
        path = state_dir / f"{m.removeprefix('policy:')}.zip"
        if not (learns_online(dec) and path.is_file()):
            continue
        dec.policy = load_policy(path)
        row = dec.policy.meta.get(RUN_RECORD)
        try:
            rec = Record(**row) if isinstance(row, dict) else None
        except TypeError:  # a state whose record is not one: the prompt runs again
            rec = None
        check_learned(
            path, m, dec.policy.meta.get(RUN_LEARNED), None if rec is None else rec.prompt_id, records
        )
        if rec is not None and (rec.method, rec.prompt_id) not in done:
            with Appending(rec_path) as fh:
                fh.write(json.dumps(asdict(rec)) + "\n")
            records.append(rec)


def save_learner(decoder: Any, state_dir: Path, method: str, rec: Record, learned: list[str]) -> None:
    """After a prompt of an online policy: its state, with the prompt's record and the prompts it learned from
    (``learned``, this one last) in its meta (``resume_learners``)."""
    if learns_online(decoder):
        policy = decoder.policy
        policy.meta = {**policy.meta, RUN_RECORD: asdict(rec), RUN_LEARNED: list(learned)}
        state_dir.mkdir(parents=True, exist_ok=True)
        policy.save(state_dir / f"{method.removeprefix('policy:')}.zip")


def load_done(
    path: Path, repair: bool = True, strict: bool = False, unique: bool | None = None
) -> list[Record]:
    """Records of an earlier (possibly killed) run; a torn last line is dropped (and, with ``repair``, cut from
    the file so that the next append starts on a fresh line: ``repair=False`` for a reader beside a run that may
    still be appending, ``env.files.jsonl_lines``). A complete line that is no record is skipped (its prompt runs
    again); with ``strict`` (a reader that reports on the records) it is a ``UserError`` naming the line. With
    ``unique`` (default: ``strict``) so is a (method, prompt) recorded twice, which every table would count twice."""
    from experiments.errors import UserError

    out, seen = [], set()
    for i, line in enumerate(jsonl_lines(path, repair=repair), 1):
        try:
            rec = Record(**json.loads(line))
        except (ValueError, RecursionError, TypeError) as err:
            if strict:
                raise UserError(f"{path} line {i} is not a run record ({err})") from None
            continue
        if (strict if unique is None else unique) and (rec.method, rec.prompt_id) in seen:
            raise UserError(f"{path} line {i} records {rec.method} on {rec.prompt_id} a second time")
        seen.add((rec.method, rec.prompt_id))
        out.append(rec)
    return out


def run_identity(
    loaded: LoadedModel, max_new_tokens: int, drafter_options: dict | None = None
) -> dict[str, Any]:
    """The settings every decoding record depends on: model, dtype, device, weight format, forward, new tokens and
    the drafters' options."""
    model = loaded.model_id  # a folder given as typed: compared by where it is
    return {
        "model": str(Path(model).resolve()) if Path(model).is_dir() else model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "weights": loaded.weights,
        "forward": loaded.forward,
        "max_new_tokens": max_new_tokens,
        "drafter_options": drafter_options or {},
    }


def method_drafters(methods: Iterable[Any]) -> list[str]:
    """The drafters of ``methods`` (arm names, with or without a weight format, or ``Arm``s; the external and
    device-loop methods and plain decoding have none), sorted."""
    from env.engine import parse_arm, split_weights
    from experiments.config import EXTERNAL_METHODS, is_device_method

    names = set()
    for m in methods:
        if isinstance(m, str):
            if m in EXTERNAL_METHODS or is_device_method(m) or m.startswith("policy:"):
                continue
            m = parse_arm(split_weights(m)[0])
        if getattr(m, "drafter", None) is not None:
            names.add(m.drafter)
    return sorted(names)


def head_identity(
    drafters: Iterable[str], options: Mapping[str, Any] | None, model_id: str
) -> dict[str, str]:
    """``drafter_head.NAME``: sha256 of the head file each head drafter of ``drafters`` (eagle, eagle3,
    early_exit; a hybrid's parts as ``drafter_head.hybrid.PART``) loads for ``model_id`` with its ``options``
    (``drafters.heads.find_head``: the ``weights`` option, else the user's trained head, else the shipped one). In
    the settings of every command whose results a head decides (``run``, ``bench``, ``serve-bench``, live
    ``evaluate --serve``, a live ``sweep``): a head retrained or swapped under the same file name between a kill
    and a resume would mix two heads' results. A head not found is left out (its drafter says so when it loads)."""
    from drafters import DrafterError, make_drafter
    from drafters.heads import head_paths

    options = options or {}
    out = {}
    for n in sorted(set(drafters)):
        try:
            d = make_drafter(n, **dict(options.get(n, {})))
        except DrafterError:  # (an unknown drafter or bad options: refused where the drafter is built)
            continue
        out.update({f"drafter_head.{k}": file_digest(p) for k, p in head_paths(n, d, model_id).items()})
    return out


def trace_heads_note(
    header: Mapping[str, Any], options: Mapping[str, Any] | None, model_id: str
) -> str | None:
    """A note when live would serve other head files than a trace recorded (its header's ``heads``, by sha256):
    replay prices one head and live serves another, so the two do not compare. None when they agree or the trace
    names no heads (one recorded before it did, or without head drafters)."""
    had = header.get("heads")
    if not isinstance(had, dict) or not had:
        return None
    drafters = header.get("drafters")
    now = head_identity(list(drafters) if isinstance(drafters, dict) else [], options, model_id)
    other = sorted(k for k in had if now.get(f"drafter_head.{k}") != had[k])
    if not other:
        return None
    return (f"note: live serves other head files than the trace recorded ({', '.join(other)}): its replay and "
            "live figures are of two heads; record the trace again with the heads served")  # fmt: skip


def machine_identity(device: Any) -> dict[str, Any]:
    """The machine a run's timings depend on: the CPU (``env.machine.cpu_label``: model and bf16 flags) and, on
    CUDA, the GPU's name. In ``settings.json`` of every timed run (``bench``, ``run``, live ``evaluate``,
    ``serve-bench``, live ``evaluate --serve``), so that a run folder started on one machine and resumed on
    another is refused, not two machines' timings mixed in one table. With it, the C allocator's setting
    (``env.allocator.allocator_state``: freed memory kept or returned changed a forward's time by 1.16-1.37x by the medians)."""
    from env.allocator import allocator_state
    from env.machine import cpu_label

    out = {"cpu": cpu_label(), **allocator_state()}
    if str(device).startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def machine_label(s: dict[str, Any]) -> str:
    """The machine a result's timings were measured on, from its settings (``device``, and ``machine``: what
    ``machine_identity`` gave): the GPU's name when the device was CUDA, and the CPU with its bf16 flags; "" when
    the settings do not say (a result from before they did)."""
    m = s.get("machine")
    if not isinstance(m, dict):
        return ""
    cpu = f"CPU {m['cpu']}" if isinstance(m.get("cpu"), str) else ""
    if str(s.get("device", "")).startswith("cuda") and isinstance(m.get("gpu"), str):
        return f"GPU {m['gpu']} ({s['device']})" + (f", {cpu}" if cpu else "")
    return cpu


def workload_identity(workload: str | None) -> str:
    """A workload as a resume compares it: the built-in set, a ``code:`` source as named, or the file's absolute
    path."""
    if not workload or workload == "builtin":
        return "builtin"
    return workload if workload.startswith("code:") else str(Path(workload).resolve())


def workload_digest(workload: str | None) -> str | None:
    """sha256 of a workload file's bytes (None for the built-in set and a ``code:`` source): a resume on an edited
    file would mix the answers to two sets of prompts under the same ids."""
    if not workload or workload == "builtin" or workload.startswith("code:") or not Path(workload).is_file():
        return None
    return file_digest(workload)


def cost_identity(spec: str | None) -> str:
    """A batch cost model as a resume compares it: a file's digest, else its name (None: the shipped one)."""
    if spec and Path(spec).is_file():
        return file_digest(spec)
    return spec or "shipped"
