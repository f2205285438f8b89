"""``draftgym bench``: methods side by side on the same prompts, interleaved, in one run.

Methods: the Hugging Face ``generate`` baselines of ``experiments.hf_baselines`` (``hf_greedy``, ``hf_pld``,
``hf_static``, ``hf_compile``), ``llama_cpp`` (llama-cpp-python on the same GGUF, greedy, in a worker process:
``experiments.llama_cpp``; the extra ``pip install 'draftgym[llama]'``), ``ar`` (our autoregressive loop) and
any arm name of ours (``ngram-d8``, ``ngram-d12-k3-b24``, ...). For each prompt every method runs once, in an
order rotated from prompt to prompt so that slow drifts of the machine spread evenly. Records are appended to
``records.jsonl`` as they finish; a re-run with the same ``--out`` skips what is done. A llama_cpp worker that
dies (or cannot start) fails that method only: its remaining prompts are not run (and not recorded, so a
re-run retries them), the table says why in one line, and every other method finishes. Each record names the
session (this call) that timed it; the summary (``experiments.bench_summary``) marks ratios across sessions and
counts, per greedy method, the prompts whose tokens equal the AR loop's.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from env.decoder import chat_prompt
from env.engine import Sampling, parse_arm, split_weights
from env.files import Appending, atomic_write_text, file_digest
from env.model import LoadedModel
from env.target import check_prompt
from env.workloads import Prompt
from experiments.bench_summary import best_by_category, drafts, format_table, summarize, summary_notes
from experiments.config import EXTERNAL_METHODS, device_depth, is_device_method
from experiments.drafter_state import commit_drafters, restore_drafters, resume_drafters, save_drafters
from experiments.hf_baselines import (
    HF_METHODS,
    STATIC_CACHE_METHODS,
    HFRunner,
    bucket_warmup_lengths,
    device_problem,
)
from experiments.llama_cpp import METHOD as LLAMA_CPP
from experiments.llama_cpp import LlamaCppError, LlamaCppRunner, runner_for
from experiments.methods import MethodError, arm_decoder, device_loop, prepare_decoders
from experiments.provenance import provenance
from experiments.records import (
    Record,
    head_identity,
    load_done,
    machine_identity,
    machine_label,
    method_drafters,
    new_session,
    resume_learners,
    run_identity,
    save_learner,
    workload_digest,
    workload_identity,
)

__all__ = ["best_by_category", "drafts", "format_table", "run_bench", "run_method", "summarize", "warm_up"]

DEFAULT_METHODS = ("hf_greedy", "hf_pld", "ar", "ngram-d8", "ngram-d12-k4-b24")


def run_method(
    method: str,
    loaded: LoadedModel,
    decoders: dict[str, Any],
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    seed: int = 0,
) -> tuple[list[int], float, int, float | None, list[str]]:
    """Generate with one method; returns (token_ids, wall_s, steps, tau, arm of each step).

    ``decoders`` caches a decoder per method; put a ``SpeculativeDecoder`` with a policy there to run a policy."""
    if is_device_method(method):
        if sampling.temperature > 0:
            raise MethodError(f"{method} decodes greedily only; set the temperature to 0 or drop it")
        loop = decoders.get(method)
        if loop is None:
            loop = decoders[method] = device_loop(loaded, method)
        t0 = time.perf_counter()
        run = loop.generate([prompt_ids], max_new_tokens)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        return run.tokens[0], time.perf_counter() - t0, run.row_steps[0], run.tau, []
    if method in HF_METHODS:
        runner = decoders.get(method)
        if runner is None:
            runner = decoders[method] = HFRunner(loaded, method)
        ids, wall = runner.run(prompt_ids, max_new_tokens)
        steps, tau = (0, None) if method == "hf_pld" else (len(ids), 1.0)
        return ids, wall, steps, tau, []
    if method == LLAMA_CPP:  # raises LlamaCppError when its worker cannot run
        if method not in decoders:
            decoders[method] = runner_for(loaded)
        ids, wall = decoders[method].run(prompt_ids, max_new_tokens)
        return ids, wall, len(ids), 1.0, []
    dec = decoders.get(method)
    if dec is None:
        dec = decoders[method] = arm_decoder(loaded, method)
    g = dec.generate(prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
    return g.token_ids, g.stats.wall_s, g.stats.steps, g.stats.tau, list(g.arms)


def check_method(method: str) -> None:
    """Raise a user error for a method name that names nothing (before any work)."""
    if method in EXTERNAL_METHODS:
        return
    if is_device_method(method):
        device_depth(method)
        return
    parse_arm(split_weights(method)[0])


def interleaved(todo: list[tuple[int, Prompt]], methods: list[str], done: set[tuple[str, str]]):
    """Per prompt ``(i, p)`` of ``todo``: ``(i, p, the methods not done for it)``, rotated by ``i`` so that slow drifts
    of the machine spread evenly over the methods (what ``bench`` and ``run`` both do)."""
    for i, p in todo:
        k = i % len(methods)
        yield i, p, [m for m in methods[k:] + methods[:k] if (m, p.prompt_id) not in done]


# a compiled target compiles one graph per kind of step — decoding (at its first call, then with the context length
# dynamic) and, once drafts come, verifying — so its warm-up also runs a prompt the n-gram drafter follows
DRAFTING_PROMPT = "Repeat: one two three four, one two three four, one two three"


def runs_compiled(method: str, loaded: LoadedModel) -> bool:
    """Whether ``method`` decodes with the compiled lean forward (``+compiled``, or a target loaded compiled)."""
    if method in HF_METHODS or method in EXTERNAL_METHODS or is_device_method(method):
        return False
    variant = split_weights(method)[1] or ""
    return variant.endswith("compiled") or loaded.forward == "compiled"


def warm_up(
    method: str,
    loaded: LoadedModel,
    decoders: dict[str, Any],
    prompt_ids: list[int],
    *,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    lengths: Collection[int] = (),
    max_new_tokens: int = 0,
) -> None:
    """One short untimed generation with the decoder that is then timed (what ``bench`` and ``run`` both do). An
    online policy learns from every step, so it warms up on a copy and is put back as it was: what is timed starts
    from the policy as loaded. ``hf_static``/``hf_compile`` also build each static-cache size (and compiled graph)
    that prompts of ``lengths`` tokens with ``max_new_tokens`` new ones will use: one per ``HF_CACHE_BUCKET``."""
    dec = decoders.get(method)
    policy = getattr(dec, "policy", None)
    saved = copy.deepcopy(policy) if hasattr(policy, "update") else None
    run_method(method, loaded, decoders, prompt_ids, 4, sampling=sampling, seed=seed)
    if runs_compiled(method, loaded):
        drafting = chat_prompt(loaded.tokenizer, DRAFTING_PROMPT)
        run_method(method, loaded, decoders, drafting, 24, sampling=sampling, seed=seed)
    if method in STATIC_CACHE_METHODS:
        for n in bucket_warmup_lengths(set(lengths), max_new_tokens, len(prompt_ids)):
            if n + 4 <= loaded.max_context:
                run_method(method, loaded, decoders, (prompt_ids * (n // len(prompt_ids) + 1))[:n], 4)
    if saved is not None:
        dec.policy = saved


def run_bench(
    loaded: LoadedModel,
    prompts: list[Prompt],
    methods: list[str],
    *,
    max_new_tokens: int,
    out_dir: Path,
    settings: dict[str, Any],
    progress: bool = True,
    decoders: dict[str, Any] | None = None,
    llama_cpp_gguf: Path | None = None,
    drafter_options: dict[str, dict[str, Any]] | None = None,
    identity: dict[str, Any] | None = None,
    start_note: str | None = None,
    command: str = "bench",
) -> dict[str, Any]:
    """``decoders``: ready decoders by method name (e.g. ``policy:NAME`` -> a decoder driven by a policy).
    ``start_note``: one line for stderr once the inputs are checked, before any work (where the results go, how to
    resume them).
    ``identity``: what else the records depend on (the workload, the policy files' digests), checked with the
    model, dtype, weights, forward, new tokens and drafter options against the folder's ``settings.json``
    (``experiments.args.same_settings``): a resume with other settings is refused, not mixed in.
    ``drafter_options``: constructor options per drafter for the arm methods (``--drafter-option``).
    ``llama_cpp_gguf``: the GGUF the llama_cpp method runs (default: the embedded model's); its worker starts
    here, once, and ends with the run. A llama_cpp worker that cannot start or dies ends that method only: the
    result's ``failures`` says why, and every other method runs to the end."""
    from experiments.args import same_settings

    decoders = dict(decoders or {})
    session = new_session()  # stamped on each record timed here (a later resume: another session)
    for m in methods:
        if m not in decoders:
            check_method(m)  # fail before any work on a bad method name
    longest, lengths = 0, set()
    for p in prompts:  # and on a prompt that does not fit the context
        ids = chat_prompt(loaded.tokenizer, p.text)
        check_prompt(ids, loaded.max_context, f"prompt {p.prompt_id}")
        longest = max(longest, len(ids))
        lengths.add(len(ids))
    out_dir.mkdir(parents=True, exist_ok=True)
    rec_path = out_dir / "records.jsonl"
    records = load_done(rec_path, unique=True)  # a record twice would count its prompt twice in every table
    machine = machine_identity(loaded.device)
    # the heads the methods' drafters load, by their contents (a head swapped under its file name: refused)
    used = [*methods, *(a for d in decoders.values() for a in getattr(d, "arms", ()))]
    heads = head_identity(method_drafters(used), drafter_options, loaded.model_id)
    same_settings(out_dir, {**run_identity(loaded, max_new_tokens, drafter_options), **machine, **heads,
                            **(identity or {})}, started=bool(records), command=command)  # fmt: skip
    settings = {**settings, "machine": machine}
    if start_note:
        import sys

        print(start_note, file=sys.stderr, flush=True)
    state_dir = out_dir / "policies"
    resume_learners(decoders, state_dir, rec_path, records)
    for m in methods:  # device loops sized by this workload (their static cache, their graphs' spans)
        if is_device_method(m) and m not in decoders:
            decoders[m] = device_loop(loaded, m, longest + max_new_tokens)
        elif m not in decoders and m not in EXTERNAL_METHODS:  # arms, with their drafters' options
            decoders[m] = arm_decoder(loaded, m, drafter_options)
    vocab = int(loaded.config.vocab_size)
    carried = resume_drafters(decoders, state_dir, rec_path, records, vocab)  # restored after the warm-up
    done = {(r.method, r.prompt_id) for r in records}
    todo = [(i, p) for i, p in enumerate(prompts) if any((m, p.prompt_id) not in done for m in methods)]
    failures: dict[str, str] = {}  # method -> why it stopped (the llama_cpp worker's death)
    started: list[LlamaCppRunner] = []
    if (
        LLAMA_CPP in methods
        and LLAMA_CPP not in decoders
        and any((LLAMA_CPP, p.prompt_id) not in done for _, p in todo)
    ):
        try:  # loads the GGUF and warms up in its own process
            runner = runner_for(
                loaded, llama_cpp_gguf, n_ctx=min(loaded.max_context, longest + max_new_tokens)
            )
        except LlamaCppError as err:
            failures[LLAMA_CPP] = str(err)
        else:
            decoders[LLAMA_CPP] = runner
            started.append(runner)
            settings = {**settings, LLAMA_CPP: runner.info}
    if todo:  # warm-up: the first call of each method pays for lazy initialisation; untimed
        warm_ids = chat_prompt(loaded.tokenizer, "Say hello.")
        for m in methods:
            if m != LLAMA_CPP:  # its worker warmed up when it started
                warm_up(m, loaded, decoders, warm_ids, lengths=lengths, max_new_tokens=max_new_tokens)
    restore_drafters(decoders, carried, state_dir, vocab)
    finished = sum((m, p.prompt_id) in done for p in prompts for m in methods)  # of this run's selection only
    bar = tqdm(total=len(prompts) * len(methods), initial=finished, desc="bench", disable=not progress)
    try:
        with Appending(rec_path) as fh:
            for _, p, order in interleaved(todo, methods, done):
                prompt_ids = chat_prompt(loaded.tokenizer, p.text)
                for m in order:
                    if m in failures:
                        bar.update(1)
                        continue
                    try:
                        ids, wall, steps, tau, arms = run_method(
                            m, loaded, decoders, prompt_ids, max_new_tokens
                        )
                    except LlamaCppError as err:  # its worker died: that method stops, the run goes on
                        failures[m] = f"{err} on prompt {p.prompt_id}"
                        bar.update(1)
                        continue
                    rec = Record(m, p.prompt_id, p.category, len(prompt_ids), len(ids), wall, steps, tau, ids,
                                 arms, session)  # fmt: skip
                    # the drafters' state aside, then the policy's, then the drafters' in place, then the record
                    learned = [r.prompt_id for r in records if r.method == m] + [p.prompt_id]
                    save_drafters(decoders.get(m), state_dir, m, rec, learned)
                    save_learner(
                        decoders.get(m), state_dir, m, rec, learned
                    )  # before the record: resume_learners
                    commit_drafters(state_dir, m)
                    fh.write(json.dumps(asdict(rec)) + "\n")
                    fh.flush()
                    records.append(rec)
                    bar.update(1)
    finally:
        for runner in started:
            runner.close()
    bar.close()
    keep = {p.prompt_id for p in prompts}
    records = [r for r in records if r.prompt_id in keep and r.method in methods]
    have = {(r.method, r.prompt_id) for r in records}
    for m, why in failures.items():
        missing = sum((m, p.prompt_id) not in have for p in prompts)
        failures[m] = (
            f"{why}; {missing} of {len(prompts)} prompts not run (a re-run with the same --out retries them)"
        )
    summary = summarize(records, methods)  # greedy: bench decodes at temperature 0
    notes = summary_notes(records, summary, str(loaded.dtype))
    result = {"settings": settings, "provenance": provenance(), "summary": summary, "failures": failures,
              "notes": notes}  # fmt: skip
    atomic_write_text(out_dir / "bench.json", json.dumps(result, indent=2))
    return result


# ------------------------------------------------------------------------------------------------ command line


def cmd_bench(args: Any) -> int:
    import datetime as dt
    import sys

    from env.model import load_model
    from env.workloads import load_workload, prompts_digest
    from experiments.args import drafter_options, output_dir, run_folder_outputs, same_drafter_options
    from experiments.errors import UserError

    given = ",".join(DEFAULT_METHODS) if args.methods is None else args.methods
    methods = [m.strip() for m in given.split(",") if m.strip()]
    if not methods:
        raise UserError("--methods names no method")
    if len(set(methods)) != len(methods):
        raise UserError(f"--methods lists a method twice: {methods}")
    for m in methods:
        check_method(m)  # a bad method name fails before the model loads
    from env.model import resolve_device

    device = resolve_device(args.device).type
    for m in methods:
        problem = device_problem(m, device)
        if problem:
            raise UserError(f"{m}: {problem}")
    options = drafter_options(args.drafter_option)
    gguf = None
    if LLAMA_CPP in methods:  # a folder model without --llama-cpp-gguf fails here, before the model loads
        from experiments.llama_cpp import gguf_of

        gguf = gguf_of(args.model, args.llama_cpp_gguf)
    elif args.llama_cpp_gguf is not None:
        raise UserError("--llama-cpp-gguf is for the llama_cpp method, which --methods does not list")
    prompts = load_workload(args.workload, per_category=args.per_category)
    if args.limit:
        prompts = prompts[: args.limit]
    policies = []
    if args.policy:  # a bad policy file fails here, before a folder is made or the model loads
        from policies import load_policy

        stems = [f"policy:{Path(p).stem}" for p in args.policy]
        twice = sorted({s for s in stems if stems.count(s) > 1} | (set(stems) & set(methods)))
        if twice:  # each file is the method named by its stem: two of one name would be one method
            raise UserError(f"--policy: two methods would be named {twice[0]}; rename one of the files")

        policies = [load_policy(path) for path in args.policy]
    out = Path(args.out or f"runs/bench-{dt.datetime.now():%Y%m%d-%H%M%S}")
    output_dir(out, exclusive=True)
    run_folder_outputs(
        out, ("records.jsonl", "bench.json", "settings.json", "drafter_options.json"), ("policies",)
    )
    started = bool(load_done(out / "records.jsonl"))
    same_drafter_options(
        out, options, started=started, write=False
    )  # other options: refused before the model
    loaded = load_model(
        args.model, dtype=args.dtype, device=args.device, weights=args.weights, forward=args.forward
    )
    arms = {
        m: arm_decoder(loaded, m, options)
        for m in methods
        if m not in EXTERNAL_METHODS and not is_device_method(m)
    }
    decoders = {}
    for path, policy in zip(
        args.policy or [], policies
    ):  # each saved policy is one more method, "policy:<stem>"
        from experiments.policy_commands import policy_decoder

        decoders[f"policy:{Path(path).stem}"] = policy_decoder(loaded, policy)
    prepare_decoders(
        [*arms.values(), *decoders.values()]
    )  # a bad head file: before the folder holds anything
    same_drafter_options(out, options, started=started)
    methods += [m for m in decoders if m not in methods]
    settings = {
        "model": loaded.model_id,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "workload": args.workload or "builtin",
        "per_category": args.per_category,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "methods": methods,
        "drafter_options": options,
        "command": " ".join(["draftgym", *sys.argv[1:]]),
    }
    result = run_bench(
        loaded,
        prompts,
        methods,
        max_new_tokens=args.max_new_tokens,
        out_dir=out,
        settings=settings,
        progress=not args.json,
        decoders={**arms, **decoders},
        llama_cpp_gguf=gguf,
        drafter_options=options,
        identity={
            "workload": workload_identity(args.workload),
            "workload_sha256": workload_digest(args.workload),
            "workload_prompts_sha256": prompts_digest(args.workload),  # built-in, code: (no file)
            "policies": {m: file_digest(p) for m, p in zip(decoders, args.policy or [])},
            "llama_cpp_gguf": None if gguf is None else str(Path(gguf).resolve()),
        },
        start_note=resume_note("bench", out),
    )
    warnings = [n for n in result["notes"] if n.startswith("WARNING")]
    if args.json:
        print(json.dumps(result))
        for line in warnings:  # loud in JSON mode too
            print(line, file=sys.stderr)
    else:
        s = result["settings"]
        print(f"{s['model']} ({s['dtype']}) on {machine_label(s) or s['device']}")
        print(format_table(result["summary"], result["failures"]))
        print("".join(f"\n{n}" for n in result["notes"]))
        print(
            f"speedups are ratios of aggregate tokens/s on the prompts both methods finished; results in {out}/"
        )
    return 0


def resume_note(command: str, out: Path) -> str:
    """The line a long run prints before its work: where its results go, and how to resume it after a kill (the
    folder quoted for the shell where it needs to be: ``--out with space`` pasted back named another folder)."""
    import shlex

    return f"draftgym {command}: results in {out}/ (if it stops, rerun with --out {shlex.quote(str(out))} to resume)"


def register(sub: Any) -> None:
    from experiments.args import drafter_option_args, model_args, new_tokens, positive_int

    b = sub.add_parser("bench", help="benchmark methods side by side against Hugging Face generate")
    b.add_argument(
        "--workload",
        default=None,
        help="Spec-Bench JSONL file, e.g. data/spec_bench/question.jsonl of a Spec-Bench clone "
        "(default: the built-in set)",
    )
    b.add_argument("--per-category", type=positive_int, default=None, help="first N prompts of each category")
    b.add_argument("--limit", type=positive_int, default=None, help="first N prompts in all (smoke runs)")
    b.add_argument(
        "--methods",
        default=None,
        help="comma list: hf_greedy,hf_pld,hf_static,hf_compile,llama_cpp,ar,ngram-d8,ngram-d12-k4-b24,...; ARM@VARIANT decodes in "
        "another target variant: a weight format (ar@int4), optionally compiled (ar@int4+compiled); device:none and "
        "device:lookup-dD run the device-resident loop (env.device_loop; CUDA graphs on a GPU) (llama_cpp "
        "needs the extra draftgym[llama])",
    )
    b.add_argument(
        "--llama-cpp-gguf",
        default=None,
        metavar="PATH",
        help="the GGUF the llama_cpp method runs (default: the embedded model's; required with --model FOLDER)",
    )
    b.add_argument("--max-new-tokens", type=new_tokens, default=128)
    b.add_argument("--out", default=None, help="run directory (re-use it to resume a killed run)")
    model_args(b)
    drafter_option_args(b)
    b.add_argument("--json", action="store_true")
    b.add_argument(
        "--policy", action="append", default=None, help="a saved policy file as a method (repeatable)"
    )
    b.set_defaults(func=cmd_bench)
