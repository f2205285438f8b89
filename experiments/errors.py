"""Errors the command line reports in one line (``draftgym CMD: error: ...``, exit code 2), never a traceback.

Each layer raises its own error type (``DrafterError``, ``ModelError``, ``PolicyError``, ...) whose message is
written for the user; ``USER_ERROR_TYPES`` names them once, by ``module:Class``, so that nothing has to be
imported (or appended to a list at import time) to recognise one. ``UserError`` is the command line's own.
"""

from __future__ import annotations

EXIT_USAGE = 2

# Exception types whose message is meant for the user, by layer (a subclass counts too).
USER_ERROR_TYPES: frozenset[str] = frozenset(
    {
        "experiments.errors:UserError",
        "env.cli:ProgramError",
        "kernels.packed:QuantError",
        "drafters.base:DrafterError",
        "env.model:ModelError",
        "env.target:PromptError",
        "env.workloads:WorkloadError",
        "env.features:FeatureSpecError",
        "env.cost:CostModelError",
        "env.trace:TraceError",
        "env.spec_env:EnvError",
        "env.serving:ServeError",
        "env.serve_obs:ServeEnvError",
        "env.folder_lock:FolderBusy",
        "env.decoder:PolicyMismatch",
        "policies.errors:PolicyError",
        "experiments.strict_toml:ConfigError",
        "experiments.methods:MethodError",
        "experiments.runner:RunDirError",
        "experiments.report_inputs:ReportError",
        "experiments.sweep:StorageError",
        "experiments.oracle_gap:OracleGapError",
    }
)


class UserError(Exception):
    """An error of the command line's own (a bad argument or path), reported in one line."""


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is one of ``USER_ERROR_TYPES`` (or a subclass of one)."""
    return any(f"{c.__module__}:{c.__qualname__}" in USER_ERROR_TYPES for c in type(err).__mro__)


def describe_os_error(err: OSError) -> str:
    """One line for a path problem: ``cannot write runs/x/bench.json: Permission denied``."""
    what = err.strerror or type(err).__name__
    name = err.filename if err.filename is not None else None
    if name is None:
        return f"{what}: {err}" if str(err) and str(err) != what else what
    if isinstance(name, str) and len(name) > 120:
        name = name[:60] + "..." + name[-40:]
    return f"{name}: {what}"


def one_line(message: object) -> str:
    """A message on one line (an error that quotes a multi-line value must not spill over)."""
    return " ".join(str(message).split())
