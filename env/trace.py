"""Recorded traces for replay (DESIGN.md "Traces and replay"): per prompt, the greedy trajectory, the position
features of every root (``env.features``) and, for every drafter, its largest proposal tree at every position.

One ``.npz`` file (compressed numpy arrays, no pickles):

| array                   | shape / dtype      | what                                                            |
|-------------------------|--------------------|-----------------------------------------------------------------|
| ``header``              | 0-d str (JSON)     | format, model fingerprint (id, tokenizer sha256, vocab size,     |
|                         |                    | dtype), max_new_tokens, feature spec, drafters (exact?, shape,   |
|                         |                    | options), prompt ids and categories, provenance                  |
| ``prompt_tokens``       | int32 [sum Lp]     | the prompts' token ids, concatenated                             |
| ``prompt_off``          | int64 [P + 1]      | offsets into ``prompt_tokens``                                   |
| ``traj``                | int32 [T]          | the generated tokens (greedy), concatenated; position t of a    |
|                         |                    | prompt is the root after t + 1 generated tokens                  |
| ``traj_off``            | int64 [P + 1]      | offsets into ``traj`` (global position g = traj_off[p] + t)      |
| ``feat``                | float32 [T, 4 + P] | position features of each root                                  |
| ``tree/NAME/off``       | int64 [T + 1]      | node offsets of drafter NAME's tree at each position             |
| ``tree/NAME/tokens``    | int32 [M]          | its nodes' tokens (node 0 = the root)                            |
| ``tree/NAME/parents``   | int16 [M]          | their parents (local indices, -1 for the root)                   |

``draftgym record`` writes one part per prompt under ``OUT.parts/`` as it goes (so a killed run resumes where it
stopped) and assembles ``OUT`` at the end.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import shutil
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from drafters import Carries, Drafter, DrafterError, DraftTree, TreeShape, make_drafter, tree_problem
from drafters.base import carried_state, restore_state
from env.features import (
    FeatureSpec,
    FeatureSpecError,
    position_feature_names,
    position_features,
    projection,
)
from env.file_checks import Bad, check_trace_arrays, check_trace_header, check_trace_values, one_line
from env.files import atomic_write_text, file_digest
from env.safe_zip import ArchiveProblem, member_names, parse_json, read_npz
from env.step import Stepper, largest_shape

FORMAT = "draftgym-trace"
VERSION = 1
# What a trace may unpack to is derived from its header (``trace_bytes``): its prompts, max_new_tokens, feature
# columns and each drafter's recorded shape bound every array but the prompts' tokens, which get PROMPT_TOKENS each;
# TRACE_BYTES caps that (and a recording's parts). Spec-Bench's 480 prompts x 128 tokens: ~60 MB on disk.
TRACE_BYTES = 4 << 30
HEADER_BYTES = 64 << 20  # the JSON header array (4 bytes a character)
PROMPT_TOKENS = 1 << 17  # a 128k-token context
# the arrays of the format (the table above); a trace holding anything else is refused unread
TRACE_MEMBER = re.compile(
    r"(header|prompt_tokens|prompt_off|traj|traj_off|feat|tree/[^/]+/(off|tokens|parents))\.npy"
)
# parents are int16: a node's parent is at most 32767, so a tree holds at most this many nodes
TREE_NODES = (1 << 15) + 1


class TraceError(ValueError):
    """A trace that cannot be used (missing, malformed, or recorded for another model); meant for the user."""


@dataclass(frozen=True)
class TreeArrays:
    off: np.ndarray  # int64 [T + 1]
    tokens: np.ndarray  # int32 [M]
    parents: np.ndarray  # int16 [M]

    def at(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.off[g]), int(self.off[g + 1])
        return self.tokens[a:b], self.parents[a:b]


@dataclass
class Trace:
    header: dict[str, Any]
    prompt_tokens: np.ndarray
    prompt_off: np.ndarray
    traj: np.ndarray
    traj_off: np.ndarray
    feat: np.ndarray
    trees: dict[str, TreeArrays]
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)  # derived arrays (env.replay)

    # ---- reading ----
    @property
    def num_prompts(self) -> int:
        return int(self.traj_off.shape[0] - 1)

    @property
    def prompt_ids(self) -> list[str]:
        return list(self.header["prompts"]["ids"])

    @property
    def max_new_tokens(self) -> int:
        return int(self.header["max_new_tokens"])

    @property
    def spec(self) -> FeatureSpec:
        return FeatureSpec.from_dict(self.header["features"]["spec"])

    @property
    def drafters(self) -> dict[str, dict[str, Any]]:
        return dict(self.header["drafters"])

    @property
    def prompt_len(self) -> np.ndarray:
        return np.diff(self.prompt_off)

    def prompt(self, p: int) -> list[int]:
        return self.prompt_tokens[self.prompt_off[p] : self.prompt_off[p + 1]].tolist()

    def trajectory(self, p: int) -> list[int]:
        return self.traj[self.traj_off[p] : self.traj_off[p + 1]].tolist()

    def check_model(self, fingerprint: dict[str, Any], what: str = "this model") -> None:
        """Refuse a trace recorded for another model or tokenizer."""
        mine = self.header["model"]
        for key in ("model_id", "vocab_size", "tokenizer_sha256"):
            if mine.get(key) != fingerprint.get(key):
                raise TraceError(
                    f"the trace was recorded for model {mine.get('model_id')} (vocab {mine.get('vocab_size')}, "
                    f"tokenizer {str(mine.get('tokenizer_sha256'))[:12]}), not for {what} "
                    f"{fingerprint.get('model_id')} (vocab {fingerprint.get('vocab_size')}, tokenizer "
                    f"{str(fingerprint.get('tokenizer_sha256'))[:12]}): {key} differs; record one with "
                    f"draftgym record --model ..."
                )

    # ---- writing ----
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        arrays = {
            "header": np.array(json.dumps(self.header)),
            "prompt_tokens": self.prompt_tokens.astype(np.int32),
            "prompt_off": self.prompt_off.astype(np.int64),
            "traj": self.traj.astype(np.int32),
            "traj_off": self.traj_off.astype(np.int64),
            "feat": self.feat.astype(np.float32),
        }
        for name, t in self.trees.items():
            arrays[f"tree/{name}/off"] = t.off.astype(np.int64)
            arrays[f"tree/{name}/tokens"] = t.tokens.astype(np.int32)
            arrays[f"tree/{name}/parents"] = t.parents.astype(np.int16)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        return path


def default_trace_path() -> Path:
    return Path(str(resources.files("env") / "data" / "builtin_trace.npz"))


def load_trace(path: str | Path | None = None) -> Trace:
    """Read a trace (``None``: the one shipped with the package, recorded from the embedded model)."""
    file = default_trace_path() if path is None else Path(path)
    if not file.is_file():
        raise TraceError(f"trace file {file} does not exist (record one with: draftgym record --out FILE)")
    if not zipfile.is_zipfile(file):
        raise TraceError(f"{file} is not a draftgym trace (not an .npz archive)")
    try:  # arrays only (an object array, a pickle, is refused), the header first, each the size it declares
        odd = [n for n in member_names(file, max_members=4096) if not TRACE_MEMBER.fullmatch(n)]
        if odd:
            raise ArchiveProblem(f"member {odd[0]!r} is not an array of the trace format")
        data = read_npz(file, max_bytes=HEADER_BYTES, only={"header"})
        if "header" not in data or data["header"].shape != () or data["header"].dtype.kind != "U":
            raise ArchiveProblem("no header string")
        header = parse_json(str(data["header"]))
    except ArchiveProblem as err:
        raise TraceError(one_line(f"{file} is not a readable trace ({err})")) from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise TraceError(f"{file} is not a draftgym trace (format {got!r})")
    if header.get("version") != VERSION:
        raise TraceError(
            f"{file} is trace version {header.get('version')}; this draftgym reads version {VERSION}"
        )
    try:
        check_trace_header(header)
    except Bad as bad:
        raise TraceError(
            one_line(f"{file} is not a valid trace: header {bad.args[0]} {bad.args[1]}")
        ) from None
    except FeatureSpecError as err:
        raise TraceError(one_line(f"{file} is not a valid trace: header {err}")) from None
    names = ["prompt_tokens", "prompt_off", "traj", "traj_off", "feat"]
    names += [f"tree/{n}/{a}" for n in header["drafters"] for a in ("off", "tokens", "parents")]
    bound = trace_bytes(header)
    try:  # the arrays the header's drafters name (no other drafter's trees), within what the header allows
        data = read_npz(file, max_bytes=bound, only=names)
    except ArchiveProblem as err:
        raise TraceError(
            one_line(
                f"{file} is not a readable trace ({err}; its header's {len(header['prompts']['ids'])} prompts, "
                f"max_new_tokens {header['max_new_tokens']} and drafter shapes allow {bound} bytes)"
            )
        ) from None
    try:
        trees = {
            name: TreeArrays(
                data[f"tree/{name}/off"], data[f"tree/{name}/tokens"], data[f"tree/{name}/parents"]
            )
            for name in header["drafters"]
        }
        trace = Trace(
            header,
            data["prompt_tokens"],
            data["prompt_off"],
            data["traj"],
            data["traj_off"],
            data["feat"],
            trees,
        )
    except KeyError as err:
        raise TraceError(f"{file} is not a complete trace (no {err} in it)") from err
    try:
        check_trace_arrays(trace)
        _check_offsets(file, trace)
        check_trace_values(trace)
    except Bad as bad:
        raise TraceError(one_line(f"{file} is not a valid trace: {bad.args[0]} {bad.args[1]}")) from None
    return trace


def tree_nodes(shape: Sequence[int]) -> int:
    """The most nodes a recorded tree of drafter shape ``[depth, topk, budget]`` holds: its draft nodes and the
    root, within what int16 parents index."""
    return min(TreeShape(*(int(x) for x in shape)).max_nodes + 1, TREE_NODES)


def trace_bytes(header: dict[str, Any]) -> int:
    """What a trace of this (checked) header may unpack to at most: every array at 8 bytes an element (a wider
    dtype than the format's is read too), T = prompts x max_new_tokens positions, each drafter's trees at
    ``tree_nodes`` each, PROMPT_TOKENS per prompt; within TRACE_BYTES."""
    p = len(header["prompts"]["ids"])
    t = p * int(header["max_new_tokens"])
    cols = 4 + FeatureSpec.from_dict(header["features"]["spec"]).proj_dim
    elements = p * PROMPT_TOKENS + 2 * (p + 1) + t + t * cols
    elements += sum(t + 1 + 2 * t * tree_nodes(d["shape"]) for d in header["drafters"].values())
    arrays = 5 + 3 * len(header["drafters"])
    return min(8 * elements + 4096 * arrays, TRACE_BYTES)  # (4096: room for each .npy header)


def _check_offsets(file: Path, t: Trace) -> None:
    """Offsets that index the arrays they belong to (a hand-edited or mixed-up file fails here, not in replay)."""
    npos = t.traj.shape[0]
    checks = [
        ("prompt_off", t.prompt_off, t.prompt_tokens.shape[0]),
        ("traj_off", t.traj_off, npos),
        *((f"tree/{n}/off", a.off, a.tokens.shape[0]) for n, a in t.trees.items()),
    ]
    for name, off, end in checks:
        if off.ndim != 1 or off.size < 1 or off[0] != 0 or off[-1] != end or (off[1:] < off[:-1]).any():
            raise TraceError(f"{file} is not a consistent trace ({name} does not index its array)")
    if t.prompt_off.size != t.traj_off.size or t.feat.shape[0] != npos:
        raise TraceError(f"{file} is not a consistent trace (prompt, trajectory and feature counts differ)")
    for n, a in t.trees.items():
        if a.off.size != npos + 1 or a.parents.shape != a.tokens.shape:
            raise TraceError(f"{file} is not a consistent trace (tree/{n} does not cover every position)")
        shape, most = t.header["drafters"][n]["shape"], tree_nodes(t.header["drafters"][n]["shape"])
        sizes = np.diff(a.off)
        if sizes.size and sizes.max() > most:
            g = int(np.argmax(sizes))
            raise TraceError(
                f"{file} holds an invalid tree/{n}: the tree at position {g} has {int(sizes[g])} nodes, "
                f"past the {most} that drafter shape {shape} allows"
            )
        problem = tree_problem(a.off, a.tokens, a.parents, t.header.get("model", {}).get("vocab_size"))
        if problem:
            raise TraceError(f"{file} holds an invalid tree/{n}: {problem}")


# ---- recording ----------------------------------------------------------------------------------------------------


def model_fingerprint(loaded: Any) -> dict[str, Any]:
    """What a trace must match: model id, vocabulary size, a hash of the tokenizer's vocabulary, eos ids, dtype."""
    tok = loaded.tokenizer
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    sha = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    eos = loaded.eos_token_ids
    eos = [eos] if isinstance(eos, int) else list(eos or [tok.eos_token_id])
    return {
        "model_id": loaded.model_id,
        "vocab_size": int(loaded.config.vocab_size),
        "tokenizer_sha256": sha,
        "eos_ids": [int(e) for e in eos],
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "hidden_size": int(loaded.config.hidden_size),
    }


def _drafter_header(name: str, d: Drafter, options: dict[str, Any]) -> dict[str, Any]:
    s = largest_shape(d)
    exact = bool(getattr(d, "exact_replay", False)) and hasattr(d, "max_shape")
    return {"exact": exact, "shape": [s.depth, s.topk, s.budget], "options": options}


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
    from tqdm import tqdm

    from env.batch import BatchEngine
    from env.decoder import chat_prompt
    from env.engine import NO_DRAFT
    from env.target import check_prompt

    out = Path(out)
    spec = spec or FeatureSpec()
    if max_new_tokens < 2:
        raise TraceError(f"max_new_tokens must be >= 2, got {max_new_tokens}")
    names = [n for n in dict.fromkeys(drafter_names) if n != "none"]
    if not names:
        raise TraceError("record needs at least one drafter (e.g. --drafters ngram)")
    options = drafter_options or {}
    probes = {n: make_drafter(n, **options.get(n, {})) for n in names}
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
        # the device the target ran on: greedy outputs may differ between a GPU's kernels and the CPU's, so a
        # recording is not resumed on another
        "device": str(loaded.device),
    }
    parts_dir = out.with_name(out.name + ".parts")
    head_file = parts_dir / "header.json"
    if out.exists() and not overwrite:
        old = load_trace(out)
        want = json.loads(json.dumps(header))
        diff = sorted(k for k in want if _differs(old.header, want, k))
        if diff:
            raise TraceError(
                f"{out} already holds a trace of other settings ({', '.join(diff)} differ); delete it, "
                f"pass --overwrite or choose another --out"
            )
        _remove_parts(parts_dir)
        return old
    if parts_dir.is_dir() and head_file.is_file():
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
                f"{parts_dir} holds a partial recording with other settings ({', '.join(diff)} differ); "
                f"delete it or choose another --out"
            )
    else:
        parts_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(head_file, json.dumps(header))  # torn, it would stop every later resume
    carriers = {n: d for n, d in probes.items() if isinstance(d, Carries)}
    if carriers:
        _resume_carriers(parts_dir, len(prompts), carriers)
    stepper = Stepper(engine, [NO_DRAFT])
    proj = projection(int(loaded.config.hidden_size), spec)
    parts = []
    bar = tqdm(prompts, desc="record", unit="prompt", disable=not progress)
    for i, p in enumerate(bar):
        part_file = parts_dir / f"{i:05d}.npz"
        if not part_file.is_file():
            arrays = record_prompt(
                stepper, probes, chat_prompt(loaded.tokenizer, p.text), max_new_tokens, spec, proj
            )
            tmp = parts_dir / f"{i:05d}.tmp.npz"
            np.savez(tmp, **arrays)
            tmp.replace(part_file)
            if (
                carriers
            ):  # after the part: a kill in between leaves the state one part behind (that part redone)
                state = carried_state(carriers)
                np.savez(parts_dir / "probes.tmp.npz", part=np.int64(i + 1), **state)
                (parts_dir / "probes.tmp.npz").replace(parts_dir / PROBES_FILE)
        try:
            parts.append(read_npz(part_file, max_bytes=TRACE_BYTES))
        except ArchiveProblem as err:
            raise TraceError(
                f"{part_file} is a corrupted part of this recording ({err}); delete it to record again"
            ) from None
    header = dict(header)
    header["created"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    header["provenance"] = _provenance()  # where it was recorded (not compared on a resume)
    try:
        trace = _assemble(header, parts)
    except (KeyError, ValueError) as err:
        raise TraceError(
            f"{parts_dir} holds a part of another recording ({one_line(str(err))}); delete it"
        ) from None
    trace.save(out)
    _remove_parts(parts_dir)
    return trace


# header keys a recording from before they existed does not have: not compared then (it is taken as it is)
LATER_KEYS = ("engine", "workload_sha256", "device")


def _provenance() -> dict[str, Any]:
    """The machine, library versions and command line of a recording (DESIGN's provenance of a result file)."""
    import sys

    from env.machine import library_versions, machine_info

    return {"machine": machine_info(), "versions": library_versions(),
            "command": " ".join(["draftgym", *sys.argv[1:]])}  # fmt: skip


def _differs(old: dict[str, Any], new: dict[str, Any], key: str) -> bool:
    if key in LATER_KEYS and key not in old:
        return False
    return old.get(key) != new.get(key)


PROBES_FILE = "probes.npz"  # the probes' carried state after the parts before ``part``


def _resume_carriers(parts_dir: Path, n_prompts: int, carriers: dict[str, Any]) -> None:
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
        restore_state(carriers, arrays)
    except DrafterError as err:
        raise TraceError(f"{state_file}: {err}; delete it to record again") from None


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


__all__ = ["Trace", "TraceError", "default_trace_path", "load_trace", "model_fingerprint", "record"]
