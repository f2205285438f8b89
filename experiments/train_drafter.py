"""``draftgym train-drafter eagle|eagle3|early_exit``: self-distillation data from the target, then a trained head.

    draftgym train-drafter eagle --workload question.jsonl --cpu-minutes 8
    draftgym train-drafter eagle3 --workload question.jsonl --cpu-minutes 60

``eagle3`` trains on the corpus of ``experiments.corpus`` (the target's answers decoded on the batch engine to
non-MT-bench instruction prompts and standard-library code instructions, plus teacher-forced standard-library
source; every MT-bench prompt and the benchmark prompts stay out) with the low/middle/high fused features and a
deeper training-time test (``--levels``, default 4 for it). Its corpus is cached under ``--work`` (default: the
draftgym cache, keyed by model, weights, dtype and answer length only), answered by prompt id (an id it answered
for another text is refused): a rerun with more prompts answers only the new ones and keeps the text features, and
each run trains on its own prompts (its held-out ones stay out, whoever answered them), from a training state of
its own. The others keep their smaller data set:

The prompts are the workload minus its benchmark prompts (the first ``--exclude-per-category`` of each category,
the ones ``draftgym bench --per-category`` uses), then the first ``--per-category`` of each category. Data are
cached under ``--work`` (default: the draftgym cache, keyed by model, dtype and prompt set), so a second head
trains on the same data and a killed run resumes. The head is saved where the drafters look for it (``--out``
overrides), with a JSON file of its target, training data, costs and held-out metric.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from env.cli import seed_int

KINDS = ("eagle", "eagle3", "early_exit")
MAX_THREADS = 1024  # far above any CPU's cores; --threads 100000 crashed torch (exit 139)
# flags only some heads read: given for another head they were ignored silently, now they are refused
KIND_FLAGS = {
    **dict.fromkeys(("code_prompts", "general_prompts", "text_tokens", "batch"), ("eagle3",)),
    **dict.fromkeys(
        ("per_category", "prefill_per_category", "prefill_len", "window", "capture_layers"),
        ("eagle", "early_exit"),
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    from drafters.train import MAX_LEVELS, MAX_STEPS
    from experiments.args import float_in, int_at_least, new_tokens, nonnegative_int, positive_int

    p = sub.add_parser(
        "train-drafter", help="train an eagle, eagle3 or early_exit draft head by self-distillation"
    )
    p.add_argument("kind", choices=KINDS, help="which head")
    p.add_argument("--workload", default=None, help="Spec-Bench JSONL prompts (default: the built-in set)")
    p.add_argument("--per-category", type=positive_int, default=18, help="training prompts per category")
    p.add_argument(
        "--exclude-per-category",
        type=nonnegative_int,
        default=5,
        help="benchmark prompts left out per category",
    )
    p.add_argument(
        "--prefill-per-category",
        type=nonnegative_int,
        default=48,
        help="further prompts per category used as teacher-forced text (no generation, cheaper)",
    )
    p.add_argument(
        "--prefill-len", type=positive_int, default=448, help="tokens of each teacher-forced prompt"
    )
    p.add_argument(
        "--max-new-tokens", type=new_tokens, default=128, help="answer length of the generated data"
    )
    p.add_argument(
        "--window", type=positive_int, default=320, help="positions kept per sequence (prompt tail + answer)"
    )
    p.add_argument(
        "--train-window", type=positive_int, default=192, help="positions per sequence the head trains on"
    )
    p.add_argument("--capture-layers", default="2,4,8", help="early-exit layers whose states the data keep")
    p.add_argument(
        "--exit-layer", type=positive_int, default=4, help="early_exit: target layers before the adapter"
    )
    p.add_argument(
        "--draft-vocab", type=positive_int, default=6144, help="size of the reduced draft vocabulary"
    )
    p.add_argument(
        "--levels",
        type=int_at_least(1, MAX_LEVELS),
        default=None,
        help="eagle: training-time-test unroll depth (2; eagle3: 4)",
    )
    p.add_argument(
        "--code-prompts", type=nonnegative_int, default=600, help="eagle3: standard-library code instructions"
    )
    p.add_argument(
        "--general-prompts",
        type=nonnegative_int,
        default=1400,
        help="eagle3: general instructions (28 templates x 50 topics; the first 500 from the first 10 templates)",
    )
    p.add_argument(
        "--text-tokens",
        type=nonnegative_int,
        default=720_000,
        help="eagle3: teacher-forced tokens of standard-library source",
    )
    p.add_argument("--batch", type=positive_int, default=16, help="eagle3: rows of the distillation engine")
    p.add_argument(
        "--cpu-minutes",
        type=float_in(0.0, 1e6, low_open=True),
        default=10.0,
        help="training budget in CPU minutes (data excluded)",
    )
    p.add_argument("--lr", type=float_in(0.0, 10.0, low_open=True), default=3e-3)
    p.add_argument(
        "--train-batch", type=positive_int, default=8, help="sequences (windows) per optimizer step"
    )
    p.add_argument(
        "--train-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="the head's products while training (bf16: autocast, fp32 weights; pays on a CPU with native bf16)",
    )
    p.add_argument(
        "--prompt-frac", type=float_in(0.0, 1.0), default=1.0, help="share of prompt positions in the loss"
    )
    p.add_argument(
        "--answer-repeat",
        type=int_at_least(1, 1000),
        default=1,
        help="each training window holding answer tokens appears this many times an epoch (weighs the target's "
        "own answers up against the teacher-forced text)",
    )
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument(
        "--steps",
        type=int_at_least(0, MAX_STEPS),
        default=0,
        help="training budget in optimizer steps instead of --cpu-minutes (0: CPU minutes); the same steps give "
        "the same head, also after a kill and a rerun",
    )
    p.add_argument(
        "--save-every-s",
        type=float_in(0.0, 1e6),
        default=60.0,
        help="seconds between checkpoints of the training state (a rerun after a kill resumes from the last)",
    )
    p.add_argument(
        "--threads",
        type=int_at_least(0, MAX_THREADS),
        default=0,
        help=f"torch threads, at most {MAX_THREADS} (0: torch's default)",
    )
    p.add_argument(
        "--work", type=_given, default=None, help="folder for the data and the resumable training state"
    )
    p.add_argument(
        "--out",
        type=_given,
        default=None,
        help="head file to write (default: where the drafter looks for it)",
    )
    p.add_argument(
        "--model",
        type=_given,
        default=None,
        help="local Hugging Face model folder (default: embedded SmolLM2-135M)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "bf16", "fp32"],
        help="target dtype for the data (fp32; eagle3: bf16 answers, the dtype it drafts for; its text is fp32)",
    )
    p.add_argument("--json", action="store_true", help="print the head's metadata as JSON")
    p.set_defaults(func=cmd_train_drafter, kind_flag_defaults={d: p.get_default(d) for d in KIND_FLAGS})


def _given(text: str) -> str:
    """An argparse type for --work, --out and --model: an empty value is far more often a shell variable that was
    not set than a wish for the default (which leaving the flag out gives), so it is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "is empty (a shell variable not set?); leave the flag out for the default"
        )
    return text


def cmd_train_drafter(args: argparse.Namespace) -> int:

    from drafters.heads import cache_heads_dir, head_name
    from drafters.train import TrainSettings, train_head
    from drafters.train_data import generate_data, prefill_data
    from env.decoder import chat_prompt
    from env.machine import cache_dir
    from env.model import load_model
    from env.workloads import load_workload
    from experiments.args import output_dir
    from experiments.errors import UserError

    if args.per_category < 1 or args.max_new_tokens < 1 or args.cpu_minutes <= 0:
        raise UserError("--per-category, --max-new-tokens and --cpu-minutes must be positive")
    defaults = getattr(args, "kind_flag_defaults", {})
    for dest, kinds in KIND_FLAGS.items():
        if args.kind not in kinds and dest in defaults and getattr(args, dest) != defaults[dest]:
            raise UserError(
                f"--{dest.replace('_', '-')} is for {' and '.join(kinds)} heads; {args.kind} does not read it"
            )
    if args.kind == "eagle3":
        return _train_eagle3(args)
    args.dtype = args.dtype or "fp32"
    args.levels = args.levels or 2
    try:
        layers = tuple(sorted({int(x) for x in args.capture_layers.split(",") if x.strip()}))
    except ValueError as err:
        raise UserError(
            f"--capture-layers must be a comma list of layer counts, got {args.capture_layers!r}"
        ) from err
    if args.kind == "early_exit" and args.exit_layer not in layers:
        layers = tuple(sorted({*layers, args.exit_layer}))
    _check_layers(layers, args.exit_layer, _layers_in_folder(args.model))  # before any folder is made
    # the prompts before any folder is made or the model loads: a bad --workload writes nothing
    bench = (  # the benchmark's prompts stay out of training
        {p.prompt_id for p in load_workload(args.workload, per_category=args.exclude_per_category)}
        if args.exclude_per_category > 0
        else set()
    )
    by_cat: dict[str, list] = {}
    for p in load_workload(args.workload):
        if p.prompt_id not in bench:
            by_cat.setdefault(p.category, []).append(p)
    prompts = [p for rows in by_cat.values() for p in rows[: args.per_category]]
    more = [
        p
        for rows in by_cat.values()
        for p in rows[args.per_category : args.per_category + args.prefill_per_category]
    ]
    if not prompts:
        hint = (
            " (the built-in set holds 2 prompts per category: pass --workload, e.g. Spec-Bench's question.jsonl)"
            if args.workload is None
            else ""
        )
        raise UserError(
            f"no training prompts are left once --exclude-per-category {args.exclude_per_category} benchmark "
            f"prompts per category are excluded{hint}"
        )
    _outputs_and_threads(args)
    loaded = load_model(args.model, dtype=args.dtype, device="cpu")
    if (
        args.max_new_tokens + 3 > loaded.max_context
    ):  # (as eagle3's corpus checks it: generation ran on for ever)
        raise UserError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the target's "
            f"{loaded.max_context}-token context (at most {loaded.max_context - 3})"
        )
    _check_layers(layers, args.exit_layer, int(loaded.model.config.num_hidden_layers))

    ids = [(p.prompt_id, chat_prompt(loaded.tokenizer, p.text)) for p in prompts]
    key = hashlib.sha256(
        json.dumps([loaded.model_id, args.dtype, args.max_new_tokens, args.window, layers, ids]).encode()
    ).hexdigest()[:12]
    work = Path(args.work) if args.work else cache_dir() / "distill" / f"{Path(loaded.model_id).name}-{key}"
    output_dir(work, flag="--work" if args.work else "the work folder", exclusive=True)  # the default one too
    out = Path(args.out) if args.out else cache_heads_dir() / head_name(args.kind, loaded.model_id)
    _out_outside_work(out, work)
    progress = not args.json
    if progress:
        print(f"{len(prompts)} training prompts ({len(by_cat)} categories); data in {work}", file=sys.stderr)
    info = generate_data(
        loaded.model,
        ids,
        work,
        max_new_tokens=args.max_new_tokens,
        capture_layers=layers,
        window=args.window,
        pad_id=int(loaded.tokenizer.pad_token_id or 0),
        progress=progress,
        model_id=loaded.model_id,
    )
    dirs = [work]
    if more:
        more_ids = [(p.prompt_id, chat_prompt(loaded.tokenizer, p.text)) for p in more]
        more_key = hashlib.sha256(json.dumps(more_ids).encode()).hexdigest()[:8]
        pre_dir = work / f"prefill-{args.prefill_len}-{more_key}"  # keyed by its prompts as well
        pre = prefill_data(
            loaded.model,
            more_ids,
            pre_dir,
            max_len=args.prefill_len,
            capture_layers=layers,
            pad_id=int(loaded.tokenizer.pad_token_id or 0),
            progress=progress,
            model_id=loaded.model_id,
        )
        dirs.append(pre_dir)
        info = {
            **info,
            "cpu_s": info["cpu_s"] + pre["cpu_s"],
            "prefill_prompts": len(more),
            "prefill_len": args.prefill_len,
        }
    info.update(workload=str(args.workload or "builtin"), target_dtype=args.dtype, prompt_ids_sha=key)
    settings = TrainSettings(
        kind=args.kind,
        draft_vocab=args.draft_vocab,
        exit_layer=args.exit_layer,
        levels=args.levels,
        lr=args.lr,
        batch_size=args.train_batch,
        compute={"fp32": "float32", "bf16": "bfloat16"}[args.train_dtype],
        prompt_frac=args.prompt_frac,
        answer_repeat=args.answer_repeat,
        cpu_minutes=args.cpu_minutes,
        steps=args.steps,
        save_every_s=args.save_every_s,
        seed=args.seed,
        window=min(args.train_window, args.window),
    )
    meta = train_head(
        loaded.model, loaded.model_id, dirs, out, settings, work_dir=work, data_info=info, progress=progress
    )
    return _report(args, meta, out)


def _report(args: argparse.Namespace, meta: dict, out: Path) -> int:
    if args.json:
        print(json.dumps(meta))
    else:
        t = meta["training"]
        print(
            f"saved {out.with_suffix('.safetensors')}: held-out {meta['metric']}; "
            f"data {t['data_cpu_minutes']} CPU-min, training {t['train_cpu_minutes']} CPU-min, "
            f"{t['train_positions']} positions ({t['train_answer_tokens']} answer tokens)"
        )
    return 0


def corpus_folder(cache: Path, loaded: Any, max_new_tokens: int, workload: str | None = None) -> Path:
    """The eagle3 corpus's default work folder, named from what its parts must share (``corpus.same_parts``: the
    model, its weights and dtype, the answer length) and the workload file (where it is and its bytes: answers
    are kept by prompt id, and another file's ids may name other prompts), and from nothing else: a rerun with
    more or other prompts finds the answers and text features already computed, answers only the new prompts,
    and trains on its own selection (``train_head``'s ``keep_ids``). A model folder counts as typed and by where
    it is."""
    from experiments.records import workload_digest, workload_identity

    model = str(loaded.model_id)
    where = str(Path(model).resolve()) if Path(model).is_dir() else None
    dtype = str(loaded.dtype).removeprefix("torch.")
    wl = [workload_identity(workload), workload_digest(workload)]
    key = hashlib.sha256(
        json.dumps([model, where, loaded.weights, dtype, max_new_tokens, *wl]).encode()
    ).hexdigest()
    return cache / "corpus" / f"{Path(model).name}-{key[:12]}"


def _train_eagle3(args: argparse.Namespace) -> int:
    """The corpus (answers on the batch engine + standard-library text), then the fused head."""

    from drafters.heads import cache_heads_dir, head_name
    from drafters.train import TrainSettings, train_head
    from env.decoder import chat_prompt
    from env.machine import cache_dir
    from env.model import load_model
    from experiments import corpus
    from experiments.args import output_dir

    # the prompts before any folder is made or the model loads: a bad --workload writes nothing
    texts = corpus.instruction_prompts(
        args.workload, args.exclude_per_category, args.code_prompts, args.general_prompts
    )
    _outputs_and_threads(args)
    dtype = args.dtype or "bf16"
    loaded = load_model(args.model, dtype=dtype, device="cpu")
    ids = [(pid, chat_prompt(loaded.tokenizer, t)) for pid, t in texts]
    key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]  # this run's prompts (and their tokens)
    work = (
        Path(args.work)
        if args.work
        else corpus_folder(cache_dir(), loaded, args.max_new_tokens, args.workload)
    )
    output_dir(work, flag="--work" if args.work else "the work folder", exclusive=True)  # the default one too
    out = Path(args.out) if args.out else cache_heads_dir() / head_name("eagle3", loaded.model_id)
    _out_outside_work(out, work)
    progress = not args.json
    if progress:
        print(
            f"{len(ids)} instruction prompts, {args.text_tokens} text tokens; data in {work}", file=sys.stderr
        )
    answers = corpus.distill_answers(
        loaded, ids, work / "answers", max_new_tokens=args.max_new_tokens, batch=args.batch, progress=progress
    )
    dirs = [work / "answers"]
    info = {"answers": answers, "cpu_s": answers["cpu_s"]}
    if args.text_tokens:
        text_model = load_model(args.model, dtype="fp32", device="cpu")
        windows = list(corpus.text_windows(text_model.tokenizer, args.text_tokens, 512))
        text = corpus.text_features(text_model, windows, work / "text", progress=progress)
        dirs.append(work / "text")
        info.update(text=text, cpu_s=answers["cpu_s"] + text["cpu_s"])
    info.update(
        workload=str(args.workload or "builtin"),
        excluded="mt_bench (all), the first --exclude-per-category of every other category",
        target_dtype=dtype,
        prompt_ids_sha=key,
    )
    settings = TrainSettings(
        kind="eagle3",
        draft_vocab=args.draft_vocab,
        levels=args.levels or 4,
        lr=args.lr,
        batch_size=args.train_batch,
        compute={"fp32": "float32", "bf16": "bfloat16"}[args.train_dtype],
        feat_noise=0.0,
        reg_weight=0.0,
        prompt_frac=args.prompt_frac,
        answer_repeat=args.answer_repeat,
        cpu_minutes=args.cpu_minutes,
        steps=args.steps,
        save_every_s=args.save_every_s,
        seed=args.seed,
        window=args.train_window,
    )
    # the folder holds the answers of every run before this one: this run trains on its own prompts and windows only
    # (its held-out prompts stay out even when an earlier run answered them), from a training state of its own,
    # named by its ids and their texts (another text under the same ids never resumes this run's state)
    chosen = [*ids, *(windows if args.text_tokens else [])]
    keep = {str(pid) for pid, _ in chosen}
    named = sorted({(str(pid), corpus.prompt_digest(toks)) for pid, toks in chosen})
    selection = hashlib.sha256(json.dumps(named).encode()).hexdigest()[:12]
    train_dir = work / f"train-{selection}"
    train_dir.mkdir(parents=True, exist_ok=True)
    meta = train_head(
        loaded.model, loaded.model_id, dirs, out, settings, work_dir=train_dir, data_info=info,
        progress=progress, keep_ids=keep,
    )  # fmt: skip
    return _report(args, meta, out)


def _layers_in_folder(model: str | None) -> int | None:
    """The target's layer count from its folder's ``config.json`` where that is readable before the model loads
    (the embedded model's once converted); None where it is not (the loaded model's count is checked then)."""
    from env.model import model_folder

    folder = model_folder(model)
    try:
        n = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError, TypeError):  # no folder or file yet, or not a config
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 2 else None


def _check_layers(layers: tuple[int, ...], exit_layer: int, n_layers: int | None) -> None:
    """Exit and capture layers in 1..n_layers - 1 (only >= 1 while ``n_layers`` is unknown)."""
    from experiments.errors import UserError

    top = n_layers - 1 if n_layers is not None else None
    if any(x < 1 or (top is not None and x > top) for x in (*layers, exit_layer)):
        room = f"1..{top}" if top is not None else ">= 1"
        raise UserError(f"exit and capture layers must be in {room}, got {list(layers)}, {exit_layer}")


def _outputs_and_threads(args: argparse.Namespace) -> None:
    """--out and --work checked (their folders made) and torch's threads set, once the inputs are known good."""
    import torch

    from experiments.args import output_dir, output_file
    from experiments.errors import UserError

    if args.out and args.work:  # again once the default folders are known; now before the model loads
        _out_outside_work(Path(args.out), Path(args.work))
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise UserError(
                f"--out {out} is a directory: give the head's file name (its .safetensors and .json)"
            )
        # a head's two files replace only a head's (a misplaced --out must not destroy someone's file)
        head = (_is_head, "a draftgym head (a .safetensors whose .json beside it describes a head)")
        output_file(out.with_suffix(".safetensors"), flag="--out", earlier=head)
        output_file(out.with_suffix(".json"), flag="--out", earlier=head)
    if args.work:
        output_dir(args.work, flag="--work", exclusive=True)
    if args.threads:
        torch.set_num_threads(args.threads)


def _is_head(path: Path) -> bool:
    """Whether ``path`` (X.safetensors or X.json) is a file of a draftgym head: X.json, beside it, describes one."""
    from drafters.heads import FORMAT
    from env.safe_zip import ArchiveProblem, parse_json

    desc = path.with_suffix(".json")
    if not desc.is_file() or desc.stat().st_size > 16 << 20:
        return False
    try:
        d = parse_json(desc.read_bytes())  # hostile text (nesting past the recursion limit too): not a head
    except (OSError, ArchiveProblem):
        return False
    return isinstance(d, dict) and d.get("format") == FORMAT


def _out_outside_work(out: Path, work: Path) -> None:
    """The head (its .safetensors and .json) is written outside the work folder: inside, it could replace a data
    part or a training state (``--out W/answers/part-00000`` did, and every later run then failed)."""
    from experiments.errors import UserError

    inside = work.resolve()
    for f in (out.with_suffix(".safetensors"), out.with_suffix(".json")):
        if f.resolve().is_relative_to(inside):
            raise UserError(
                f"the head {f} would be written inside the work folder {work}, whose data and training state it "
                "could replace: give an --out outside it"
            )
