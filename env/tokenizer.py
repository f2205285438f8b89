"""A tokenizer that starts in milliseconds: the model folder's ``tokenizer.json`` through the ``tokenizers`` library
and its chat template through jinja2, as transformers renders it — without importing transformers (seconds of a
fresh process). It has the part of the transformers tokenizer API draftgym uses: ``__call__(text)["input_ids"]``,
``apply_chat_template``, ``decode``, ``get_vocab``, ``chat_template``, ``eos_token_id``, ``pad_token_id``.

``tests/env/test_tokenizer.py`` checks it gives the transformers tokenizer's ids, chat prompts, decoded text and
vocabulary on the workloads. Used for the embedded model; other folders keep ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _token(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        return value.get("content")
    return value


class FastTokenizer:
    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.name_or_path = str(folder)  # as transformers' tokenizers name their folder
        conf_path = folder / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text() if template.is_file() else conf.get("chat_template")
        )
        self.special = {
            k: _token(conf.get(k))
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if conf.get(k)
        }
        self._template = None

    def __deepcopy__(self, memo: dict) -> FastTokenizer:
        return self  # read-only

    def _id(self, name: str) -> int | None:
        tok = self.special.get(name)
        return None if tok is None else self._tok.token_to_id(tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text).ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kw: Any,
    ) -> Any:
        """Rendered as transformers renders it (a sandboxed jinja2 environment, trim_blocks and lstrip_blocks,
        the special tokens as variables), then tokenized without adding special tokens."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        text = self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **kw
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


# ---- a model folder's tokenizer (``env.model.load_model``) ----
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def folder_tokenizer(folder: Path) -> Any:
    """A model folder's tokenizer (transformers' ``AutoTokenizer``); any failure to build it — a file missing,
    damaged or of another format, a config transformers refuses — is one ``ModelError`` naming the folder."""
    from drafters.base import reason
    from env.model import ModelError

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"model folder {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")

    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)  # (never code from a file)
    except Exception as err:  # noqa: BLE001  (a damaged tokenizer fails in many ways, a KeyError among them: one line)
        raise ModelError(f"cannot load the tokenizer of {folder} ({reason(err, kind=True)})") from None


def tokenizer_of(folder: Path, model_id: str) -> Any:
    """The tokenizer ``load_model`` builds: the embedded model's fast one, or the folder's (refused in one line
    when damaged); None for a folder without tokenizer files (``LoadedModel.tokenizer`` refuses it at first use)."""
    from env.model import DEFAULT_MODEL, ModelError

    if model_id == DEFAULT_MODEL and (folder / "tokenizer.json").is_file():
        from drafters.base import reason

        try:
            return FastTokenizer(folder)
        except Exception as err:  # noqa: BLE001  (a damaged cached tokenizer: one line)
            raise ModelError(f"cannot load the tokenizer of {folder} ({reason(err, kind=True)})") from None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return folder_tokenizer(folder)
