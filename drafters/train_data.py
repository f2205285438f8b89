"""Training data for the trained draft heads (``eagle``, ``early_exit``), by self-distillation: the target answers
prompts greedily (``generate_data``) or reads prompts teacher-forced (``prefill_data``), and forward hooks capture,
for every position, the final-norm hidden state f_t (EAGLE's feature and the teacher) and the residual stream after
the first ``l`` layers for each capture layer (early exit). The last ``window`` positions of each sequence are kept,
as fp16, one file per batch, so a killed run resumes at the next batch. ``load_data`` (checked: a NaN feature or a
wrong dtype is refused, not trained on), ``split``, ``windows``, ``repeat_answers`` and ``draft_vocab`` read them
back for ``drafters.train``.

Costs are counted in CPU seconds of this process (``time.process_time``), added to ``info.json`` as each part is
written, so that they sum over resumed sessions, killed ones included.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafters.base import DrafterError, reason, shown
from drafters.hf_greedy import greedy_generate


@dataclass(frozen=True)
class Sequence:
    tokens: torch.Tensor  # [T] int64, the last `window` tokens of prompt + answer
    feats: torch.Tensor  # [T, H] fp16, f_t (final-norm hidden); the last row is zero (no feature yet)
    exits: dict[int, torch.Tensor]  # layer l -> [T, H] fp16 residual stream after l layers
    answer_start: int  # index in `tokens` of the first generated token (0 if the prompt was cut away)
    prompt_id: str


# ---------------------------------------------------------------- data generation


def generate_data(
    model: Any,
    prompts: list[tuple[str, list[int]]],
    out_dir: Path,
    *,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    capture_layers: tuple[int, ...] = (4, 8),
    window: int = 384,
    pad_id: int = 2,
    progress: bool = True,
    model_id: str | None = None,
) -> dict[str, Any]:
    """Greedy answers and captured features for ``prompts`` ((id, token ids)); one safetensors file per batch in
    ``out_dir`` (existing ones are kept: resume). ``model_id``: the target's name in its fingerprint (default: the
    model's ``name_or_path``). Returns ``info.json``: the summary, CPU seconds summed over resumed calls."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])

    def part(batch: list[tuple[str, list[int]]], captured: dict[str, list[torch.Tensor]]):
        lens = [len(ids) for _, ids in batch]
        width = max(lens)
        inp = torch.tensor([[pad_id] * (width - n) + ids for (_, ids), n in zip(batch, lens)])
        att = torch.tensor([[0] * (width - n) + [1] * n for n in lens])
        with torch.inference_mode():
            out = greedy_generate(model, inp, max_new_tokens, attention_mask=att, pad_token_id=pad_id)
        cat = {k: torch.cat(v, dim=1) for k, v in captured.items()}  # [B, width + steps - 1, H]
        tensors: dict[str, torch.Tensor] = {}
        meta = []
        for b, ((pid, ids), n) in enumerate(zip(batch, lens)):
            answer = out[b, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(answer) if t in eos_ids), len(answer))
            seq = ids + answer[:cut]
            start = max(0, len(seq) - window)
            pad = width - n
            t = len(seq) - start
            tensors[f"{b}/tokens"] = torch.tensor(seq[start:], dtype=torch.int32)
            for name, x in cat.items():
                f = torch.zeros(t, x.shape[-1], dtype=torch.float16)
                avail = x[b, pad + start : pad + len(seq) - 1].to(
                    torch.float16
                )  # features of all but the last
                f[: avail.shape[0]] = avail
                tensors[f"{b}/{name}"] = f
            meta.append({"prompt_id": pid, "answer_start": max(0, len(ids) - start), "answer_len": cut})
        return tensors, meta

    order = sorted(prompts, key=lambda p: len(p[1]))  # similar lengths batch together: little padding
    settings = {"kind": "distill", "max_new_tokens": max_new_tokens, "window": window, "pad_id": pad_id}
    info = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "window": window}
    return _write_parts(model, model_id, order, out_dir, batch_size, capture_layers, "distill data", progress, part,
                        settings, info)  # fmt: skip


def _write_parts(
    model,
    model_id: str | None,
    order,
    out_dir: Path,
    batch_size: int,
    capture_layers,
    desc: str,
    progress: bool,
    part,
    settings: dict,
    info: dict,
) -> dict[str, Any]:
    """Run ``part(batch, captured)`` -> (tensors, meta) over the batches of ``order`` with the capture hooks on,
    writing ``out_dir/part-NNNN.safetensors`` atomically and skipping the parts already there (resume after a
    kill). The folder remembers what its parts were made from (``parts.json``: the kind of data, its settings,
    the model's dtype, the target's fingerprint, a digest of the prompts in order): parts of other settings are
    refused (``DrafterError``), not mixed in. ``info`` and the CPU seconds spent go to ``info.json`` as each part
    is written (``add_info``: a kill loses only the CPU time of the part it interrupted); returns it."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from drafters.heads import target_fingerprint

    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = hashlib.sha256(json.dumps(order).encode()).hexdigest()
    dtype = str(getattr(model, "dtype", "")).removeprefix("torch.")
    name = model_id if model_id is not None else str(getattr(model, "name_or_path", ""))
    settings = {**settings, "batch_size": batch_size, "capture_layers": list(capture_layers), "dtype": dtype,
                "prompts": prompts, "target": target_fingerprint(model, name)}  # fmt: skip
    _same_parts(out_dir, settings)
    read_info(out_dir)  # a damaged info.json is refused before the work, not after it
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    info = {**info, "capture_layers": list(capture_layers)}
    cpu = time.process_time()

    def log() -> dict[str, Any]:  # this call's CPU seconds since the last entry, added to info.json
        nonlocal cpu
        now = time.process_time()
        out = add_info(out_dir, now - cpu, info)
        cpu = now
        return out

    captured, handles = _hooks(model, capture_layers)
    todo = [(i, b) for i, b in enumerate(batches) if not (out_dir / f"part-{i:04d}.safetensors").is_file()]
    bar = tqdm(total=len(batches), initial=len(batches) - len(todo), desc=desc, disable=not progress)
    try:
        for i, batch in todo:
            captured.clear()
            tensors, meta = part(batch, captured)
            tmp = out_dir / f"part-{i:04d}.tmp"
            save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})
            os.replace(tmp, out_dir / f"part-{i:04d}.safetensors")
            log()
            bar.update(1)
    finally:
        for h in handles:
            h.remove()
        bar.close()
    return log()


def _same_parts(out_dir: Path, settings: dict[str, Any]) -> None:
    """Refuse (``DrafterError``) a folder whose parts were made with other settings; else record ``settings`` in
    ``parts.json``. A ``parts.json`` from before the target's fingerprint was kept cannot say which model made its
    parts (another model with the same tokenizer, dtype and prompts would pass every other check): it is refused
    too, rather than resumed on features that may be another model's."""
    kept = out_dir / "parts.json"
    try:
        before = json.loads(kept.read_text(encoding="utf-8")) if kept.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        before = "unreadable"
    if before is not None and before != settings and any(out_dir.glob("part-*.safetensors")):
        if not isinstance(before, dict):  # damaged: what its parts were made from is unknown
            raise DrafterError(
                f"{kept} is not a readable settings object, so its folder's data parts cannot be matched to this "
                "run: delete the folder to make them again, or use another work folder"
            )
        if "target" not in before:
            raise DrafterError(
                f"{out_dir} holds data parts that do not say which target made them ({kept.name} predates the "
                "target's fingerprint): use another work folder, or delete this one to make them again"
            )
        keys = sorted(k for k in {*before, *settings} if before.get(k) != settings.get(k))
        raise DrafterError(
            f"{out_dir} holds data parts of other settings ({', '.join(keys)} differ): use another work folder, "
            "or the same settings to resume"
        )
    if before != settings:
        tmp = kept.with_name(kept.name + ".tmp")
        tmp.write_text(json.dumps(settings, indent=1))
        os.replace(tmp, kept)


def _hooks(model: Any, capture_layers: tuple[int, ...]):
    """Forward hooks that append, per forward call, the final-norm output ("final") and the residual stream after
    each capture layer ("exitL") to lists; returns (the lists by name, the hook handles)."""
    captured: dict[str, list[torch.Tensor]] = {}

    def hook(name: str):
        def fn(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            captured.setdefault(name, []).append(out.detach())

        return fn

    inner = model.model
    handles = [inner.norm.register_forward_hook(hook("final"))]
    handles += [inner.layers[n - 1].register_forward_hook(hook(f"exit{n}")) for n in capture_layers]
    return captured, handles


def prefill_data(
    model: Any,
    prompts: list[tuple[str, list[int]]],
    out_dir: Path,
    *,
    max_len: int = 448,
    batch_size: int = 8,
    capture_layers: tuple[int, ...] = (2, 4, 8),
    pad_id: int = 2,
    progress: bool = True,
    model_id: str | None = None,
) -> dict[str, Any]:
    """Teacher-forced data, several times cheaper per position than generation: one forward over the first
    ``max_len`` tokens of each prompt (a cut text is still text; its features are what the target computes for that
    prefix). EAGLE trains on fixed text as well as on self-generated text (EAGLE, section 5.3). Same file format as
    ``generate_data``, with no answer (``answer_start`` = length)."""

    def part(batch: list[tuple[str, list[int]]], captured: dict[str, list[torch.Tensor]]):
        width = max(len(ids) for _, ids in batch)
        inp = torch.tensor([ids + [pad_id] * (width - len(ids)) for _, ids in batch])  # right padding
        att = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for _, ids in batch])
        with torch.inference_mode():
            model.model(input_ids=inp, attention_mask=att)
        tensors: dict[str, torch.Tensor] = {}
        for b, (_, ids) in enumerate(batch):
            n = len(ids)
            tensors[f"{b}/tokens"] = torch.tensor(ids, dtype=torch.int32)
            for name, x in captured.items():
                f = x[0][b, :n].to(torch.float16).clone()
                f[-1] = 0  # as in generate_data: the last token has no feature in the data
                tensors[f"{b}/{name}"] = f
        return tensors, [{"prompt_id": pid, "answer_start": len(ids), "answer_len": 0} for pid, ids in batch]

    order = sorted(((pid, ids[:max_len]) for pid, ids in prompts), key=lambda p: len(p[1]))
    settings = {"kind": "prefill", "max_len": max_len, "pad_id": pad_id}
    info = {"prompts": len(prompts), "max_new_tokens": 0, "window": max_len}
    return _write_parts(model, model_id, order, out_dir, batch_size, capture_layers, "prefill data", progress, part,
                        settings, info)  # fmt: skip


def read_info(out_dir: Path) -> dict[str, Any]:
    """``out_dir/info.json`` (a fresh one when there is none); a damaged one (not JSON, not an object, no finite
    ``cpu_s`` number) is a one-line ``DrafterError`` telling to delete it."""
    info_path = out_dir / "info.json"
    if not info_path.is_file():
        return {"cpu_s": 0.0}
    try:
        info: Any = json.loads(info_path.read_bytes())
    except (OSError, ValueError, RecursionError):
        info = None
    cpu = info.get("cpu_s", 0.0) if isinstance(info, dict) else None
    if isinstance(cpu, bool) or not isinstance(cpu, int | float) or not math.isfinite(cpu):
        raise DrafterError(
            f"{info_path} is not this data's info (readable JSON with a cpu_s number); delete it"
        )
    return info


def add_info(out_dir: Path, cpu: float, fields: dict[str, Any]) -> dict[str, Any]:
    """Add ``cpu`` seconds to ``out_dir/info.json`` (summed over parts and resumed calls), set ``fields``, and
    return it (a data folder's, and ``experiments.corpus``'s)."""
    info_path = out_dir / "info.json"
    info = read_info(out_dir)
    info.update(fields, cpu_s=float(info.get("cpu_s", 0.0)) + cpu)
    tmp = info_path.with_name(info_path.name + ".tmp")  # atomic: a torn file would stop every later resume
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, info_path)
    return info


def load_data(*dirs: Path, keep: set[str] | None = None) -> list[Sequence]:
    """The sequences of every part in ``dirs``; with ``keep``, only those of these prompt (or window) ids -- a
    work folder answered by id keeps what earlier runs asked for too, which this run may hold out. An id a folder
    holds twice (two runs answering into it at once) is read once, from its first part: a second copy would
    train on what the split holds out."""
    from safetensors import safe_open

    seqs = []
    seen: set[tuple[Path, str]] = set()
    for part in sorted(p for d in dirs for p in d.glob("part-*.safetensors")):
        try:
            for s in _read_part(part, safe_open, keep):
                if (part.parent, s.prompt_id) not in seen:
                    seen.add((part.parent, s.prompt_id))
                    seqs.append(s)
        except Exception as err:  # a torn or foreign part: safetensors', JSON's and our own errors alike
            if isinstance(err, DrafterError):
                raise
            why = reason(err, kind=True)
            raise DrafterError(
                f"{part} is not a readable data part ({why}); delete it to make it again"
            ) from None
    if not seqs:
        raise DrafterError(f"no distillation data in {', '.join(map(str, dirs))}")
    return seqs


def _read_part(part: Path, safe_open: Any, keep: set[str] | None) -> list[Sequence]:
    seqs = []
    with safe_open(str(part), framework="pt") as fh:
        meta = json.loads(fh.metadata()["meta"])
        for b, m in enumerate(meta):
            if keep is not None and str(m["prompt_id"]) not in keep:
                continue
            names = [k for k in fh.keys() if k.startswith(f"{b}/exit")]  # noqa: SIM118
            exits = {int(k.split("/exit")[1]): fh.get_tensor(k) for k in names}
            tokens, feats = fh.get_tensor(f"{b}/tokens"), fh.get_tensor(f"{b}/final")
            problem = _bad_sequence(tokens, feats, exits, m["answer_start"])
            if problem:
                raise DrafterError(f"{part}: sequence {b} {problem}; delete it to make it again")
            seqs.append(Sequence(tokens=tokens.long(), feats=feats, exits=exits,
                                 answer_start=m["answer_start"], prompt_id=str(m["prompt_id"])))  # fmt: skip
    return seqs


def _bad_sequence(
    tokens: torch.Tensor, feats: torch.Tensor, exits: dict[int, torch.Tensor], answer_start: Any
) -> str | None:
    """What is wrong with a sequence of a data part, or None. Checked here because training casts what it reads
    (int16 features, float token ids) and a NaN feature trains a NaN head that is saved all the same."""
    from drafters.heads import _finite

    n = tokens.shape[0] if tokens.dim() else -1
    same = feats.dim() == 2 and feats.shape[0] == n and all(x.shape == feats.shape for x in exits.values())
    if tokens.dim() != 1 or not same:
        return "has tokens and features of different lengths or widths"
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        return f"holds token ids of type {tokens.dtype}, not integers"
    if n and int(tokens.min()) < 0:
        return "holds a negative token id"
    for name, x in [
        ("features", feats),
        *((f"residual stream after layer {k}", v) for k, v in exits.items()),
    ]:
        if not x.is_floating_point():
            return f"holds its {name} as {x.dtype}, not a floating-point type"
        if not _finite(x):
            return f"holds NaN or infinite values in its {name}"
    if isinstance(answer_start, bool) or not isinstance(answer_start, int) or not 0 <= answer_start <= n:
        return f"has answer_start {shown(answer_start)}, not a position in its {n} tokens"
    return None


def windows(seqs: list[Sequence], size: int, min_len: int = 16) -> list[Sequence]:
    """Sequences longer than ``size`` cut into consecutive pieces of ``size`` positions, so that training sees every
    position and not only each sequence's last window. A last piece shorter than ``min_len`` is instead the last
    ``size`` positions, overlapping the piece before: it holds the answer's end, which must not be dropped."""
    out = []
    for s in seqs:
        n = int(s.tokens.shape[0])
        starts = list(range(0, n, size))
        if len(starts) > 1 and n - starts[-1] < min_len:
            starts[-1] = n - size  # (n > size here)
        for a in starts:
            b = min(n, a + size)
            out.append(
                Sequence(
                    tokens=s.tokens[a:b],
                    feats=s.feats[a:b],
                    exits={k: v[a:b] for k, v in s.exits.items()},
                    answer_start=min(max(0, s.answer_start - a), b - a),
                    prompt_id=s.prompt_id,
                )
            )
    return out


def repeat_answers(seqs: list[Sequence], times: int) -> list[Sequence]:
    """``seqs`` with every sequence that holds answer positions (what the target emits, and what drafting is
    scored on) ``times`` times in all; the teacher-forced text once. Weighs the answers up without new data."""
    if times < 1:
        raise DrafterError(f"answer_repeat must be at least 1, got {times}")
    answered = [s for s in seqs if s.answer_start < s.tokens.shape[0]]
    return seqs + answered * (times - 1)


def split(seqs: list[Sequence], heldout_every: int = 10) -> tuple[list[Sequence], list[Sequence]]:
    """Held-out split by prompt: every ``heldout_every``-th generated sequence (in prompt-id order); the
    teacher-forced prompt sequences (no answer) all train."""
    answered = sorted((s for s in seqs if s.answer_start < s.tokens.shape[0]), key=lambda s: s.prompt_id)
    held = [s for i, s in enumerate(answered) if i % heldout_every == heldout_every - 1]
    held_ids = {id(s) for s in held}
    return [s for s in seqs if id(s) not in held_ids], held


def draft_vocab(seqs: list[Sequence], size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The draft vocabulary (EAGLE-3's reduced LM head): ``always``, then the tokens of the data by frequency
    (answers count 4x: they are what the target emits), then -- a few thousand distinct tokens is all a small data
    set holds -- the lowest unused ids: BPE ids follow merge order, a frequency prior of the tokenizer's corpus.
    On the 108-prompt SmolLM2 data, 8192 tokens cover 86% of held-out answer tokens (data alone: 82%)."""
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(s.tokens[: s.answer_start].tolist())
        for _ in range(4):
            counts.update(s.tokens[s.answer_start :].tolist())
    chosen = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common(size))]))[:size]
    taken, i = set(chosen), 0
    while len(chosen) < size:
        if i not in taken:
            chosen.append(i)
        i += 1
    return torch.tensor(sorted(chosen), dtype=torch.int64)
