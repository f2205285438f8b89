"""The training corpus of the draft heads (``draftgym train-drafter ... --corpus``): self-distillation on the
batch-native engine plus teacher-forced text, both offline.

- **Answers**: the target's own greedy answers (bf16 or fp32, as loaded), decoded by ``env.batch.BatchEngine`` in
  batches of ``--batch`` rows with continuous refill, to instruction prompts: Spec-Bench's non-MT-bench categories
  minus the prompts the benchmarks use, and code instructions written from the docstrings of the Python standard
  library's functions ("Write a Python function `name(args)` that ..."). The features are the ones the engine
  computed while decoding -- the prompt's from its prefill, each answer token's from the step that verified it --
  so a head trains on exactly what it sees at inference.
- **Text**: the Python standard library's own source files (PSF License 2.0), read teacher-forced in windows of
  ``--text-window`` tokens.

Kept out, as EAGLE's own training does: every MT-bench prompt (the mt_bench category), the benchmark prompts of
the other categories (the first ``--exclude-per-category``, the ones ``bench --per-category`` takes), HumanEval and
MBPP (not on these machines), and the held-out code prompts of ``code_prompts(source="numpy")`` (another source:
numpy's own docstrings).

Every part is a safetensors file in ``drafters.train_data``'s format (tokens, the final-norm feature ``final``, the
residual streams ``exitN`` at the target's aux layers), written atomically; a rerun skips the prompts and windows
already written (resume after a kill). An answer records its prompt's digest, and a prompt id the folder answered
for another text is refused (a file edited under the same ids would train on the old answers). CPU seconds are
added to ``info.json`` as each part is written, summed over resumed calls (a kill loses only the time since the
last part).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from drafters.base import reason
from drafters.train_data import add_info
from env.workloads import _source_files, _stdlib_root, code_prompts

TEXT_LICENCE = "Python standard library sources, PSF License 2.0"


# ---------------------------------------------------------------- prompt and text sources


def text_windows(tokenizer: Any, max_tokens: int, window: int = 512) -> Iterator[tuple[str, list[int]]]:
    """(id, token ids) windows of ``window`` tokens of the standard library's sources, up to ``max_tokens`` in
    all, in a fixed order (a file's tail shorter than a quarter window is dropped)."""
    root = _stdlib_root()
    total = 0
    for path in _source_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer(text)["input_ids"] if not hasattr(tokenizer, "encode") else tokenizer.encode(text)
        ids = [int(i) for i in ids]
        for at in range(0, len(ids), window):
            chunk = ids[at : at + window]
            if len(chunk) < window // 4:
                break
            yield f"text-{path.relative_to(root).as_posix()}@{at}", chunk
            total += len(chunk)
            if total >= max_tokens:
                return


# ---------------------------------------------------------------- writing parts


def same_parts(out_dir: Path, settings: dict[str, Any]) -> None:
    """A data folder is answered by id, and a rerun may add prompts, but the parts must come from one model, dtype
    and answer length (``parts.json``): parts of other settings are refused, not mixed in."""
    from env.files import settings_conflict
    from experiments.errors import UserError

    why = settings_conflict(out_dir, settings, any(out_dir.glob("part-*.safetensors")), name="parts.json")
    if why:
        raise UserError(f"{why}: use another --work folder, or the same settings to resume")


def prompt_digest(ids: list[int]) -> str:
    """What an answer's part records of its prompt (the chat token ids): answers are kept by prompt id, and a file
    whose text changed under the same id must not find its old answers as done."""
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def _part_digests(out_dir: Path) -> dict[str, str | None]:
    """Every id the parts hold, with its prompt's digest (None in a part from before digests were recorded); an
    id held twice counts from its first part, as ``load_data`` reads it."""
    from safetensors import safe_open

    from experiments.errors import UserError

    done: dict[str, str | None] = {}
    for part in sorted(out_dir.glob("part-*.safetensors")):
        try:
            with safe_open(str(part), framework="pt") as fh:
                for m in json.loads(fh.metadata()["meta"]):
                    done.setdefault(str(m["prompt_id"]), m.get("prompt_sha"))
        except (
            Exception
        ) as err:  # a torn or foreign part (safetensors' own error types, JSON's, a missing key)
            why = reason(err, kind=True)
            raise UserError(
                f"{part} is not a readable data part ({why}); delete it to make it again"
            ) from None
    return done


def _done_ids(out_dir: Path) -> set[str]:
    return set(_part_digests(out_dir))


def same_prompts(out_dir: Path, done: dict[str, str | None], prompts: list[tuple[str, list[int]]]) -> None:
    """Refuse a prompt whose id the folder answered for another text (a part without digests is taken as it is)."""
    from experiments.errors import UserError

    for pid, ids in prompts:
        was = done.get(str(pid))
        if was is not None and was != prompt_digest(ids):
            raise UserError(
                f"{out_dir} holds the answer to another text under prompt id {pid} (answers are kept by id): "
                "use another --work folder"
            )


def _write_part(out_dir: Path, seqs: list[dict[str, Any]], layers: tuple[int, ...]) -> None:
    """One part file of finished sequences (``tokens``, ``final`` [T, H], ``aux`` [T, k*H], ``answer_start``)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    meta = []
    for b, s in enumerate(seqs):
        tensors[f"{b}/tokens"] = torch.tensor(s["tokens"], dtype=torch.int32)
        tensors[f"{b}/final"] = s["final"].to(torch.float16).contiguous()
        for j, n in enumerate(layers):
            tensors[f"{b}/exit{n}"] = s["aux"].chunk(len(layers), dim=-1)[j].to(torch.float16).contiguous()
        meta.append({"prompt_id": s["id"], "answer_start": s["answer_start"], "answer_len": s["answer_len"]})
        if "sha" in s:  # the prompt's digest (``prompt_digest``): answers only
            meta[-1]["prompt_sha"] = s["sha"]
    tmp = out_dir / f".part.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})
    try:  # the next free number after the highest there (a part deleted to be made again leaves a gap)
        while True:
            taken = [int(p.stem[5:]) for p in out_dir.glob("part-*.safetensors") if p.stem[5:].isdigit()]
            final = out_dir / f"part-{max(taken, default=-1) + 1:05d}.safetensors"
            try:
                os.link(tmp, final)  # never replaces a part (another process may have taken the number)
                break
            except FileExistsError:
                continue
            except OSError:  # a file system without hard links: rename (a race may then replace a part)
                os.replace(tmp, final)
                break
    finally:
        tmp.unlink(missing_ok=True)


class _CpuLog:
    """This call's CPU seconds, added to ``out_dir/info.json`` with ``fields`` each time a part is written (a kill
    loses only the time since the last part), and once more at the end."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.at = out_dir, time.process_time()

    def __call__(self, **fields: Any) -> dict[str, Any]:
        now = time.process_time()
        out = add_info(self.out_dir, now - self.at, fields)
        self.at = now
        return out


def _features(final: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return final.detach().to(torch.float16).cpu(), aux.detach().to(torch.float16).cpu()


def distill_answers(
    loaded: Any,
    prompts: list[tuple[str, list[int]]],
    out_dir: Path,
    *,
    max_new_tokens: int = 160,
    batch: int = 16,
    part_size: int = 32,
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy answers to ``prompts`` ((id, chat token ids)) on the batch engine, with the features it computed.
    Rows that finish leave and the next prompt enters at once (closed loop at ``batch``)."""
    from tqdm import tqdm

    from env.batch import BatchEngine
    from env.engine import NO_DRAFT
    from experiments.errors import UserError

    if max_new_tokens < 1 or max_new_tokens + 3 > loaded.max_context:  # a prompt needs one token of room
        raise UserError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the target's "
            f"{loaded.max_context}-token context (at most {loaded.max_context - 3})"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    same_parts(out_dir, {"kind": "answers", "model": loaded.model_id, "weights": loaded.weights,
                         "dtype": str(loaded.dtype).removeprefix("torch."), "max_new_tokens": max_new_tokens})  # fmt: skip
    done = _part_digests(out_dir)
    same_prompts(out_dir, done, prompts)
    todo = [p for p in prompts if p[0] not in done]
    eng = BatchEngine(loaded, max_rows=batch)
    target = eng.target
    eos = target.eos_ids
    cpu = _CpuLog(out_dir)

    def fields() -> dict[str, Any]:
        return dict(prompts=len(prompts), max_new_tokens=max_new_tokens, capture_layers=list(target.aux_layers),
                    dtype=str(loaded.dtype).replace("torch.", ""), answer_tokens_this_call=n_answer)  # fmt: skip

    bar = tqdm(
        total=len(prompts), initial=len(prompts) - len(todo), desc="distill answers", disable=not progress
    )
    live: dict[int, dict[str, Any]] = {}  # id(row) -> its record
    finished: list[dict[str, Any]] = []
    queue = list(todo)
    n_answer = 0
    while queue or target.rows:
        while queue and len(target.rows) < batch:
            pid, ids = queue.pop(0)
            sha = prompt_digest(ids)  # of the prompt given, before any cut
            if len(ids) + max_new_tokens + 2 > target.max_context:
                ids = ids[-(target.max_context - max_new_tokens - 2) :]
            row, first = eng.admit(ids, {})
            f, a = _features(row.ctx.prompt_hidden, row.ctx.prompt_aux)
            row.ctx.prompt_hidden = row.ctx.prompt_aux = None
            live[id(row)] = {
                "id": pid,
                "sha": sha,
                "p": len(ids),
                "final": [f],
                "aux": [a],
                "new": 1,
                "end": first in eos,
            }
        for row in list(target.rows):
            rec = live[id(row)]
            if rec["end"] or rec["new"] >= max_new_tokens:
                rec["tokens"] = list(row.tokens)
                eng.retire(row)
                del live[id(row)]
                t = len(rec["tokens"])
                final, aux = torch.cat(rec["final"]), torch.cat(rec["aux"])
                pad = t - final.shape[0]  # the last token has no feature yet: zero rows, as in train_data
                rec["final"] = torch.cat([final, final.new_zeros(pad, final.shape[1])])
                rec["aux"] = torch.cat([aux, aux.new_zeros(pad, aux.shape[1])])
                rec["answer_start"], rec["answer_len"] = rec["p"], t - rec["p"]
                n_answer += t - rec["p"]
                finished.append(rec)
                bar.update(1)
                if len(finished) >= part_size:
                    _write_part(out_dir, finished, target.aux_layers)
                    finished = []
                    cpu(**fields())
        if not target.rows:
            continue
        results = eng.step([NO_DRAFT] * len(target.rows))
        for row, res in zip(target.rows, results):
            rec = live[id(row)]
            f, a = _features(row.last_hidden[None], row.last_aux[None])
            rec["final"].append(f)
            rec["aux"].append(a)
            rec["new"] += len(res.committed)
            rec["end"] = rec["end"] or any(t in eos for t in res.committed)
    if finished:
        _write_part(out_dir, finished, target.aux_layers)
    bar.close()
    return cpu(**fields())


def text_features(
    loaded: Any,
    windows: list[tuple[str, list[int]]],
    out_dir: Path,
    *,
    part_size: int = 64,
    progress: bool = True,
) -> dict[str, Any]:
    """Teacher-forced features of text windows: one prefill each on the engine's target (no row is admitted)."""
    from tqdm import tqdm

    from env.batch import BatchTarget

    out_dir.mkdir(parents=True, exist_ok=True)
    same_parts(out_dir, {"kind": "text", "model": loaded.model_id, "weights": loaded.weights,
                         "dtype": str(loaded.dtype).removeprefix("torch.")})  # fmt: skip
    done = _done_ids(out_dir)
    todo = [w for w in windows if w[0] not in done]
    target = BatchTarget(loaded, 1)
    cpu = _CpuLog(out_dir)
    fields = dict(windows=len(windows), tokens=sum(len(w[1]) for w in windows), capture_layers=list(target.aux_layers),
                  source=TEXT_LICENCE, dtype=str(loaded.dtype).replace("torch.", ""))  # fmt: skip
    bar = tqdm(
        total=sum(len(w[1]) for w in windows),
        initial=sum(len(w[1]) for w in windows if w[0] in done),
        desc="text features",
        unit="tok",
        unit_scale=True,
        disable=not progress,
    )
    seqs: list[dict[str, Any]] = []
    with torch.inference_mode():
        for wid, ids in todo:
            pf = target.begin_prefill(ids)
            target.prefill_chunk(pf)
            final, aux = _features(pf.hidden[0], pf.aux[0])
            final[-1] = 0  # the last token has no feature in the data
            aux[-1] = 0
            seqs.append(
                {
                    "id": wid,
                    "tokens": ids,
                    "final": final,
                    "aux": aux,
                    "answer_start": len(ids),
                    "answer_len": 0,
                }
            )
            bar.update(len(ids))
            if len(seqs) >= part_size:
                _write_part(out_dir, seqs, target.aux_layers)
                seqs = []
                cpu(**fields)
    if seqs:
        _write_part(out_dir, seqs, target.aux_layers)
    bar.close()
    return cpu(**fields)


TOPICS = (
    "a city park in autumn", "learning a second language", "saving money on groceries", "the history of the bicycle",
    "how vaccines work", "remote work", "a small bakery", "climate change", "the water cycle", "time management",
    "a first job interview", "the solar system", "healthy sleep habits", "electric cars", "a rainy day",
    "volunteering", "the printing press", "photosynthesis", "public libraries", "a mountain hike",
    "team sports", "social media and teenagers", "recycling plastic", "the Roman Empire", "a lost dog",
    "starting a vegetable garden", "the internet", "classical music", "a job promotion", "ocean tides",
    "online privacy", "a family reunion", "the human heart", "renewable energy", "moving to a new city",
    "a science fair", "coffee", "the Great Wall of China", "learning to cook", "artificial intelligence",
    "a birthday party", "earthquakes", "reading habits", "a train journey", "honeybees",
    "public speaking", "a museum visit", "the stock market", "friendship", "a snowstorm",
)  # fmt: skip
TEMPLATES = (
    "Write a short story about {t}.",
    "Explain {t} to a ten-year-old.",
    "Give me five practical tips about {t}.",
    "Write a blog post about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a polite email to a colleague about {t}.",
    "Write a short poem about {t}.",
    "Summarize the most important facts about {t} in a few paragraphs.",
    "Pretend you are a tour guide and talk about {t}.",
    "Write a persuasive paragraph about {t}.",
)


MORE_TEMPLATES = (
    "Write a dialogue between two friends who disagree about {t}.",
    "List three common misconceptions about {t} and correct each one.",
    "How has {t} changed over the last fifty years?",
    "Write a step-by-step guide for a beginner interested in {t}.",
    "Write a short news article about {t}, with a headline.",
    "You are a museum curator. Describe an exhibition about {t} to visitors.",
    "Write a diary entry of someone whose day was shaped by {t}.",
    "Give a detailed outline for an essay about {t}.",
    "Plan a 30-minute lesson about {t} for high-school students.",
    "Write four quiz questions about {t}, each with its answer.",
    "What would a journalist ask an expert about {t}? Give five questions and short answers.",
    "Describe {t} in the style of a nature documentary narrator.",
    "Write a product description for a new book about {t}.",
    "Explain the main ideas behind {t} in three paragraphs.",
    "Write a letter to a newspaper editor about {t}.",
    "What are some fun facts about {t}? Give at least five.",
    "Write a motivational speech that mentions {t}.",
    "Write a short scene for a play set around {t}.",
)


def general_prompts(limit: int = 1400) -> list[tuple[str, str]]:
    """(id, text) general instructions written for this project: ``TEMPLATES`` x ``TOPICS`` in a fixed order that
    spreads the first ``limit`` over both (none is an MT-bench question), then ``MORE_TEMPLATES`` x ``TOPICS`` in
    the same kind of order (added later: the first 500 ids and texts stay what they were, so a corpus answered
    before keeps its answers and a rerun only answers the new ones)."""
    out = []
    for first, templates in ((0, TEMPLATES), (len(TEMPLATES), MORE_TEMPLATES)):
        for i in range(len(templates) * len(TOPICS)):
            t = i % len(TOPICS)
            k = (t + i // len(TOPICS)) % len(templates)  # (for TEMPLATES: the order it always had)
            out.append((f"general-{first + k:02d}-{t:02d}", templates[k].format(t=TOPICS[t])))
    return out[:limit]


def instruction_prompts(
    workload: Any, exclude_per_category: int, code_limit: int, general_limit: int = 0
) -> list[tuple[str, str]]:
    """(id, text) of the self-distillation prompts: the workload's non-MT-bench prompts minus its benchmark
    prompts, then ``code_limit`` standard-library code instructions, then ``general_limit`` general ones."""
    from env.workloads import load_workload

    bench = (
        {p.prompt_id for p in load_workload(workload, per_category=exclude_per_category)}
        if exclude_per_category
        else set()
    )
    spec = [
        (p.prompt_id, p.text)
        for p in load_workload(workload)
        if p.category != "mt_bench" and p.prompt_id not in bench
    ]
    code = code_prompts("stdlib", limit=code_limit) if code_limit else []  # 0: the stdlib is not parsed
    return spec + code + general_prompts(general_limit)
