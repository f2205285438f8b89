"""Arguments that several ``draftgym`` commands share, and argparse types that refuse out-of-range values.

A value argparse refuses ends as one line (``draftgym generate: error: argument --top-p: ...``) with exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from env.cli import int_at_least, seed_int
from env.cli import output_file as output_file  # the commands read it here
from env.cli import positive_int as positive_int  # the commands read it here
from env.cli import same_file as same_file  # experiments.report reads it here


def float_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """A finite float in the interval given (``low_open``/``high_open``: the bound itself is excluded)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad_low = value <= low if low_open else value < low
        bad_high = value >= high if high_open else value > high
        if not math.isfinite(value) or bad_low or bad_high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"must be in {interval}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


MIN_TEMPERATURE = 1e-3  # below it 1/T overflows float32 logits to infinity: use 0 (greedy) instead


def temperature(text: str) -> float:
    """``--temperature``: 0 (greedy) or in [1e-3, 1e4]."""
    value = float_in(0.0, 1e4)(text)
    if 0 < value < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {text}")
    return value


nonnegative_int = int_at_least(0)
MAX_TOP_K = (1 << 31) - 1  # far above any vocabulary; env.engine.Sampling refuses more
MAX_NEW_TOKENS = 1 << 20


new_tokens = int_at_least(1, most=MAX_NEW_TOKENS)
"""``--max-new-tokens``: 1 .. 2**20 (the context bounds it further, checked against the model)."""


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="local Hugging Face model folder (default: embedded SmolLM2-135M)"
    )
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 where supported"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--weights", default="dense", choices=["dense", "bf16", "fp32", "int8", "int4", "auto"],
        help="the target's weight format (lean forward): dense (in --dtype; bf16/fp32 say the same), int8 per "
        "channel, int4 per 32 weights (the GGUF's own Q4_1 blocks for the embedded model); auto: int4 on a CPU "
        "with bf16 activations",
    )  # fmt: skip
    p.add_argument(
        "--forward", default="lean", choices=["lean", "compiled", "hf"],
        help="lean: draftgym's Llama-family forward (default); compiled: the same through torch.compile "
        "(inductor, cached on disk; see the README for when it pays); hf: the transformers model's forward",
    )  # fmt: skip


def arm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter", default=None, help="a drafter name or none (autoregressive); default: the project's best"
    )
    p.add_argument("--depth", type=positive_int, default=None, help="draft tree depth (>= 1)")
    p.add_argument("--topk", type=positive_int, default=1, help="branches per node (1: a chain)")
    p.add_argument("--budget", type=nonnegative_int, default=0, help="draft nodes at most (0: depth * topk)")


def drafter_option_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter-option",
        action="append",
        default=None,
        metavar="NAME.OPTION=VALUE",
        help="a constructor option of a drafter, as [drafters.NAME] of a config sets it (repeatable; the value is "
        "read as TOML): --drafter-option eagle3.vocab=8192",
    )


def drafter_options(items: list[str] | None) -> dict[str, dict[str, object]]:
    """``--drafter-option`` items as ``{drafter: {option: value}}``, checked as a config's ``[drafters.*]`` is, and
    each drafter built once with them: an unknown drafter or option, or a value it refuses, is a ``UserError``
    naming it, before the model loads."""
    from drafters import DRAFTERS
    from experiments.config import keywords_of
    from experiments.errors import UserError
    from experiments.strict_toml import int64_problem, parse_set

    out: dict[str, dict[str, object]] = {}
    for item in items or []:
        shown = item if item.isprintable() else repr(item)
        key, sep, _ = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise UserError(f"--drafter-option {shown}: expected NAME.OPTION=VALUE, e.g. eagle3.vocab=8192")
        (name, opt), value = parse_set(item, "--drafter-option")
        why = int64_problem(value)
        if why:
            raise UserError(f"--drafter-option {shown}: the value {why}")
        if name not in DRAFTERS:
            raise UserError(
                f"--drafter-option {shown}: {name!r} is not a drafter; known: {', '.join(sorted(DRAFTERS))}"
            )
        valid = keywords_of(DRAFTERS[name])
        if opt not in valid:
            raise UserError(
                f"--drafter-option {shown}: {opt!r} is not an option of {name}; valid: {', '.join(valid)}"
            )
        out.setdefault(name, {})[opt] = value
    from drafters import DrafterError, make_drafter

    for name, opts in out.items():  # a value the drafter refuses fails here too, not mid-run
        try:
            make_drafter(name, **opts)
        except (DrafterError, TypeError, ValueError, ArithmeticError) as err:
            raise UserError(f"--drafter-option {name}: {err}") from err
    return out


def same_drafter_options(
    out: Path, options: dict[str, dict[str, object]], started: bool, write: bool = True
) -> None:
    """A run folder remembers its drafter options (``drafter_options.json``, written only when there are some): a
    resumed run (``started``: results on disk) with other options would mix two configurations in one table, and
    is refused naming both. ``write=False``: the check only (before the model loads; the file is written once
    the drafters' files have loaded)."""
    import json

    from env.files import atomic_write_text
    from experiments.errors import UserError

    path = Path(out) / "drafter_options.json"
    before: object = {}
    if path.is_file():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:
            raise UserError(f"{path} is not readable JSON ({err}); delete it or use another --out") from err
    if started and before != options:
        raise UserError(
            f"{out} holds results run with --drafter-option {json.dumps(before)}; this command gives "
            f"{json.dumps(options)}: use another --out (or the same options to resume)"
        )
    if before == options or not write:
        return
    if options:
        atomic_write_text(path, json.dumps(options, sort_keys=True))
    else:  # no file means no options: a run without them leaves nothing behind
        path.unlink()


def served_drafter_options(
    policies: dict[str, Any], given: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The drafter options a run serves, one set for all its methods (its cells compare one configuration).

    Each serving policy was trained with its trace's options (``meta["drafter_options"]``, by ``serve-train``): for
    each drafter of its menu, a table (absent: the drafter's defaults; a policy file from before the key: not known,
    not checked). The policies must agree, drafter by drafter, on the whole table, or the run is refused (a
    ``UserError``: serve them in separate runs). ``given`` (``--drafter-option``) sets options over theirs, with a
    note on stderr for each policy whose table that changes."""
    from env.engine import parse_arm
    from env.trace_record import drafter_options_problem
    from experiments.errors import UserError

    def table(t: Any) -> str:
        import json

        text = json.dumps(t, sort_keys=True, default=str)
        return text if len(text) <= 120 else text[:117] + "..."

    # method -> drafter of its menu -> its options as trained
    known: dict[str, dict[str, dict[str, Any]]] = {}
    for method, pol in policies.items():
        opts = pol.meta.get("drafter_options")
        if opts is not None:
            menu = sorted({parse_arm(a).drafter for a in pol.arm_names} - {None})
            known[method] = {d: dict(opts.get(d) or {}) for d in menu}
    out: dict[str, dict[str, Any]] = {}
    whose: dict[str, str] = {}
    for method, tables in known.items():
        for name, opts in tables.items():
            if name in whose and out.get(name, {}) != opts:
                raise UserError(
                    f"{method} was trained with {name} options {table(opts)} and {whose[name]} with "
                    f"{table(out.get(name, {}))} ({{}}: the defaults): serve them in separate runs"
                )
            whose.setdefault(name, method)
            if opts:
                out[name] = opts
    for name, opts in given.items():
        out[name] = {**out.get(name, {}), **opts}
    for method, tables in known.items():
        for name, opts in tables.items():
            if out.get(name, {}) != opts:
                print(f"note: {method} was trained with {name} options {table(opts)}; with --drafter-option this "
                      f"run serves {table(out.get(name, {}))}", file=sys.stderr)  # fmt: skip
    for name, opts in out.items():  # the policies' and the command's options together: a drafter that builds
        why = drafter_options_problem(name, opts)
        if why:
            raise UserError(f"the drafter options served for {name} ({table(opts)}): {why}")
    return out


def path_arg(text: str) -> str:
    """A path given as an argument, refused when empty (``Path("")`` is the current folder: an empty shell
    variable was reported as the folder ``.``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name a file or folder")
    return text


def same_settings(out: Path, settings: dict[str, object], started: bool, command: str) -> None:
    """A run folder remembers the settings its results depend on (``settings.json``: model, dtype, new tokens,
    workload, ... -- not the list of methods or levels, which a resume may extend): a resumed run (``started``:
    results on disk) with other settings would mix two runs in one table, and is refused naming what differs
    (``env.files.settings_conflict``); so is a folder another ``command`` wrote."""
    from env.files import settings_conflict
    from experiments.errors import UserError

    why = settings_conflict(out, settings, started, command=command)
    if why:
        raise UserError(
            f"{why}: use another --out, or the same settings to resume" if "holds" in why else why
        )


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=temperature, default=0.0, help="0: greedy; else in [1e-3, 1e4]")
    p.add_argument(
        "--top-k",
        type=int_at_least(0, most=MAX_TOP_K),
        default=0,
        help=f"0: no top-k filter; at most {MAX_TOP_K}",
    )
    p.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=1.0, help="in (0, 1]")
    p.add_argument("--seed", type=seed_int, default=0)


def output_dir(path: str | Path, flag: str = "--out", exclusive: bool = False) -> Path:
    """Make the run directory (or find it) and check that files can be created in it, before any work, so that
    a bad path fails in one line instead of after the results were computed. ``exclusive``: a folder the command
    writes and resumes from, held for it (``env.folder_lock``: another process writing it is one line)."""
    from env.files import make_folder
    from env.folder_lock import claim_folder
    from experiments.errors import UserError

    if not str(path).strip():  # (Path("") is the current folder: a shell variable left empty wrote there)
        raise UserError(f"{flag} is given an empty value; name a folder")
    out = Path(path)
    if out.is_symlink() and not out.exists():  # (mkdir said "File exists")
        raise UserError(f"{flag} {out} is a symbolic link to {os.readlink(out)}, which does not exist")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a directory")
    try:
        make_folder(out)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UserError(f"{flag} {out}: cannot write there ({err.strerror or err})") from err
    if exclusive:
        claim_folder(out, f"{flag} {out}")
    return out


def run_folder_outputs(out: Path, files: tuple[str, ...], folders: tuple[str, ...] = ()) -> None:
    """Check, before any work, that what a command writes in its run folder ``out`` can be written there: each of
    ``files`` absent or a regular file, each of ``folders`` absent or a folder (a directory named ``bench.json``
    failed the command after every prompt was decoded)."""
    from experiments.errors import UserError

    for name in files:
        p = out / name
        if p.exists() and not p.is_file():
            raise UserError(f"{p} is not a regular file, and the run writes its {name} there: move it away")
    for name in folders:
        p = out / name
        if p.exists() and not p.is_dir():
            raise UserError(f"{p} is not a folder, and the run writes its {name} there: move it away")
