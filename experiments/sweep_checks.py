"""What a sweep checks before it runs a trial: that the config's trials can run (``check_inputs``, before any folder
or study is made), and that a resumed study is the one this worker would have created (``check_resumed``): the
same config, the same input files, and, for live tokens per second, the same machine. Each problem is one
``ConfigError`` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drafters.base import shown
from experiments.config import Config, ConfigError, diff_configs, load_config, parse_set
from experiments.objective import ANALYTIC_OBJECTIVE_ERROR, ANALYTIC_OBJECTIVES
from experiments.space import default_params, swept_keys, tuned_method

# how to start a study afresh: the folder's own SQLite file holds one study (its config's name: a new study_name is
# refused there as another config), a shared --storage many
ANEW = "another --out (with --storage, and another sweep.study_name)"


def check_inputs(cfg: Config, sets: list[str] | tuple[str, ...] = ()) -> None:
    """The config as written lies in the sweep space (it runs as trial 0), the backend can score the tuned method,
    no ``--set`` overrides what each trial sets (``check_sets``), and what the backend's trials will read (the
    replay trace and a cost model calibrated for its model; the live workload) reads: a bad file is one line, not a
    failed trial."""
    if cfg.sweep.backend == "analytic" and tuned_method(cfg).startswith("policy:"):
        raise ConfigError(
            f"sweep.backend = 'analytic' evaluates tree shapes only, and the sweep tunes {tuned_method(cfg)!r}; "
            "use sweep.backend = 'live' or 'replay' for a policy"
        )
    if cfg.sweep.backend == "analytic" and cfg.sweep.objective not in ANALYTIC_OBJECTIVES:
        raise ConfigError(ANALYTIC_OBJECTIVE_ERROR)
    default_params(cfg)
    check_sets(cfg, sets)
    if cfg.sweep.backend == "replay":
        from env.cost import load_cost_model
        from env.trace import load_trace
        from experiments.objective import replay_prompts

        trace = load_trace(cfg.sweep.trace or None)
        replay_prompts(cfg, trace, list(trace.prompt_ids))  # the workload's selection of its prompts
        model = trace.header["model"]
        # as the replay env checks it (``SpecDecodeEnv``): a cost model of another model fails here, not in trial 0
        load_cost_model(cfg.sweep.cost_model or None).check_model(model["model_id"], model["dtype"])
    elif cfg.sweep.backend == "live":
        from experiments.runner import select_prompts

        select_prompts(cfg)


def check_sets(cfg: Config, sets: list[str] | tuple[str, ...]) -> None:
    """Refuse a ``--set`` of a key each trial sets (or of a table above one): it is applied after the trial's
    values (file < trial < --set), so every trial would run the same method while their parameters differ."""
    swept = [tuple(k.split(".")) for k in swept_keys(cfg)]
    for item in sets:
        keys, _ = parse_set(item)
        hit = next((s for s in swept if s[: len(keys)] == keys or keys[: len(s)] == s), None)
        if hit is not None:
            shown = item if item.isprintable() else repr(item)
            raise ConfigError(
                f"--set {shown}: each trial of this sweep sets {'.'.join(hit)} (it tunes {tuned_method(cfg)!r}), "
                "and a --set would override every trial; change it in the config file instead"
            )


def check_resumed(study: Any, cfg: Config, where: str) -> None:
    """Refuse to join ``study`` (named ``where`` in messages) with a config, input files or a machine other than
    those it was created with."""
    # n_trials may grow (extend the study); seeds differ per machine (distinct samples from each)
    diff = diff_configs(
        stored_config(study.user_attrs.get("config"), where), cfg, ignore=("sweep.n_trials", "sweep.seed")
    )
    if diff:
        raise ConfigError(
            f"{where} was created from another config (differs in {', '.join(diff[:5])}); use the same config or "
            f"start the study anew: {ANEW}"
        )
    inputs = input_digests(cfg)
    had = study.user_attrs.get("inputs")  # (a study from before it was recorded: none)
    # only the digests the study recorded (one created before the cost model was recorded resumes)
    changed = sorted(k for k in had if had[k] != inputs.get(k)) if isinstance(had, dict) else []
    if changed:
        raise ConfigError(
            f"{where} was run on other input files ({', '.join(changed)} changed since); "
            f"its trials would not compare: restore the files or start the study anew: {ANEW}"
        )
    # live tokens/s are absolute timings: the creator's CPU and C allocator setting, which a worker must share (a
    # study created before one of them was recorded has none, and any worker joins)
    machine, alloc = timing_machine(cfg), timing_allocator(cfg)
    had_machine, had_alloc = study.user_attrs.get("machine"), study.user_attrs.get("allocator")
    why = None
    if machine and isinstance(had_machine, str) and had_machine != machine:
        why = (f"measured on {had_machine}; this worker runs on {machine}: tokens/s of two machines do not compare "
               "(the objective speedup is normalized per worker) — run it there")  # fmt: skip
    elif alloc and isinstance(had_alloc, str) and had_alloc != alloc:
        why = (f"measured with the C allocator {shown(had_alloc)}; this worker runs with {shown(alloc)} "
               "(DRAFTGYM_MALLOC and the allocator's environment variables): a forward's time differs between them "
               "— run it with the creator's setting")  # fmt: skip
    if why:
        raise ConfigError(f"{where} scores live tokens/s {why}, or start the study anew: {ANEW}")


def stored_config(stored: Any, where: str) -> Config:
    """The config a study was created from (its ``config`` attribute): a damaged one (not TOML text, or not a
    config this version reads) is one line, not a traceback."""
    if not isinstance(stored, str):
        raise ConfigError(
            f"{where} holds a damaged config attribute ({type(stored).__name__}, not TOML text); "
            f"start the study anew: {ANEW}"
        )
    try:
        return load_config(None, text=stored)
    except ConfigError as err:
        raise ConfigError(
            f"{where} holds a config that cannot be read ({err}); start the study anew: {ANEW}"
        ) from None


def timing_machine(cfg: Config) -> str | None:
    """The CPU a study's values depend on: that of its creator when they are live tokens per second (absolute
    timings); None for objectives that do not compare timings across workers (speedup is each worker's own
    ratio to its own autoregressive loop; tau and replay are deterministic)."""
    if cfg.sweep.backend != "live" or cfg.sweep.objective != "tokens_per_s":
        return None
    from env.machine import cpu_label

    return cpu_label()


def timing_allocator(cfg: Config) -> str | None:
    """The C allocator's setting a study's live tokens per second run under (``env.allocator.allocator_intent``:
    freed memory kept or returned changed a forward's time by 1.16-1.37x by the medians), where ``timing_machine``
    compares machines; None elsewhere. A bad ``DRAFTGYM_MALLOC`` is a ``ConfigError``."""
    if timing_machine(cfg) is None:
        return None
    from env.allocator import AllocatorError, allocator_intent

    try:
        return allocator_intent()
    except AllocatorError as err:
        raise ConfigError(str(err)) from None


def input_digests(cfg: Config) -> dict[str, str | None]:
    """The files a sweep's trials are scored on, by sha256: the workload and the drafters' head files (live:
    ``drafter_head.NAME``, ``experiments.records.head_identity``), the trace and the cost model (replay: the given
    file or the shipped one); an edited, re-recorded or retrained file under the same path would put trials of two
    data sets (or two cost models, or two heads) in one study."""
    from env.files import file_digest
    from experiments.records import workload_digest

    def digest(path: str | Path) -> str | None:
        return file_digest(path) if Path(path).is_file() else None

    trace, cost = cfg.sweep.trace, None
    if cfg.sweep.backend == "replay":
        from env.cost import default_cost_model_path

        cost = digest(cfg.sweep.cost_model or default_cost_model_path())
    heads = {}
    if cfg.sweep.backend == "live":
        from env.model import model_id_of
        from experiments.records import head_identity
        from experiments.runner import head_digests

        model_id = model_id_of(cfg.model.name)
        heads = {**head_digests(cfg, model_id), **head_identity(cfg.sweep.drafters, cfg.drafters, model_id)}
    return {
        "workload_sha256": workload_digest(cfg.workload.path),
        "trace_sha256": digest(trace) if trace else None,
        "cost_model_sha256": cost,
        **heads,
    }
