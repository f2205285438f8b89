"""Recorded traces for replay (DESIGN.md "Traces and replay"): per prompt, the greedy trajectory, the position
features of every root (``env.features``) and, for every drafter, its largest proposal tree at every position.

One ``.npz`` file (compressed numpy arrays, no pickles):

| array                   | shape / dtype      | what                                                            |
|-------------------------|--------------------|-----------------------------------------------------------------|
| ``header``              | 0-d str (JSON)     | format, model fingerprint (id, tokenizer sha256, vocab size,     |
|                         |                    | dtype), max_new_tokens, max_context, feature spec, drafters      |
|                         |                    | (exact?, shape, options), prompt ids and categories, provenance  |
| ``prompt_tokens``       | int32 [sum Lp]     | the prompts' token ids, concatenated                             |
| ``prompt_off``          | int64 [P + 1]      | offsets into ``prompt_tokens``                                   |
| ``traj``                | int32 [T]          | the generated tokens (greedy), concatenated; position t of a    |
|                         |                    | prompt is the root after t + 1 generated tokens                  |
| ``traj_off``            | int64 [P + 1]      | offsets into ``traj`` (global position g = traj_off[p] + t)      |
| ``feat``                | float32 [T, 4 + P] | position features of each root                                  |
| ``tree/NAME/off``       | int64 [T + 1]      | node offsets of drafter NAME's tree at each position             |
| ``tree/NAME/tokens``    | int32 [M]          | its nodes' tokens (node 0 = the root)                            |
| ``tree/NAME/parents``   | int16 [M]          | their parents (local indices, -1 for the root)                   |

``max_context`` is the target's context (positions) the trace was recorded in: replay applies the live engine's
rule near its end (``env.replay.build_tables``). Traces recorded before the header held it replay with an unlimited
context (``Trace.max_context`` is None), which is exact wherever no tree outgrew the room left (the bundled traces:
a few hundred to ~1,300 positions of the embedded model's 8,192).

Recording (``draftgym record``, resumable part by part) is ``env.trace_record``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from drafters import TreeShape, tree_problem
from env.features import FeatureSpec, FeatureSpecError
from env.file_checks import (
    MAX_COUNT,
    Bad,
    check_trace_arrays,
    check_trace_header,
    check_trace_values,
    count,
    not_a_file,
    one_line,
)
from env.safe_zip import ArchiveProblem, member_names, parse_json, read_npz

FORMAT = "draftgym-trace"
VERSION = 1
# What a trace may unpack to is derived from its header (``trace_bytes``): its prompts, max_new_tokens, feature
# columns and each drafter's recorded shape bound every array but the prompts' tokens, which get PROMPT_TOKENS each;
# TRACE_BYTES caps that (and a recording's parts). Spec-Bench's 480 prompts x 128 tokens: ~60 MB on disk.
TRACE_BYTES = 8 << 30  # as before the header-derived bound: no trace that loaded then is refused now
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
    def max_context(self) -> int | None:
        """The target's context (positions) the trace was recorded in; None for a trace recorded before the header
        held it (replayed as unlimited)."""
        v = self.header.get("max_context")
        return None if v is None else int(v)

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
        from env.files import writing_temporary

        with writing_temporary(path, path.with_name(path.name + ".tmp.npz")) as tmp:
            np.savez_compressed(tmp, **arrays)
            tmp.replace(path)
        return path


def default_trace_path() -> Path:
    return Path(str(resources.files("env") / "data" / "builtin_trace.npz"))


def load_trace(path: str | Path | None = None) -> Trace:
    """Read a trace (``None``: the one shipped with the package, recorded from the embedded model)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TraceError(f"a trace is named by a path, got {type(path).__name__} {path!r:.60}")
    file = default_trace_path() if path is None else Path(path)
    if not file.is_file():
        raise TraceError(
            f"trace file {file} {not_a_file(file)} (record one with: draftgym record --out FILE)"
        )
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
        count(header, "max_context", 1, MAX_COUNT, optional=True)  # absent: recorded before it was kept
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
    check_trace(file, trace)
    return trace


def check_trace(file: str | Path, trace: Trace) -> None:
    """The checks ``load_trace`` runs on a trace's arrays (ranks and kinds, offsets, trees, token ids, features),
    against its (checked) header; a failure is a one-line ``TraceError`` naming ``file``."""
    try:
        check_trace_arrays(trace)
        _check_offsets(Path(file), trace)
        check_trace_values(trace)
    except Bad as bad:
        raise TraceError(one_line(f"{file} is not a valid trace: {bad.args[0]} {bad.args[1]}")) from None


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
    if t.max_context is not None and npos:  # the last root of a prompt sits at most at the context's end
        past = t.prompt_len + np.maximum(np.diff(t.traj_off) - 1, 0)
        if past.max() > t.max_context:
            p = int(np.argmax(past))
            raise TraceError(
                f"{file} is not a consistent trace (prompt {p} reaches past length {int(past[p])}, past the "
                f"max_context {t.max_context} its header records)"
            )
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


# ---- what a trace must match ----------------------------------------------------------------------------------------------------


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


__all__ = ["Trace", "TraceError", "check_trace", "default_trace_path", "load_trace", "model_fingerprint"]
