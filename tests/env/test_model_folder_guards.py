"""A model folder's tokenizer, weights files and end-of-sequence ids, and the prompts the decoder takes: a broken
tokenizer or chat template, an odd head size, pickle-based or sharded weights, a config asking for far more than
its weights hold, and prompts of lone surrogates or float ids are each one line (``ModelError`` / ``PromptError``,
exit code 2 on the command line), never a traceback; both forwards stop at the same end-of-sequence ids, before
and after the transformers model is built."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from env.decoder import SpeculativeDecoder, chat_prompt
from env.engine import NO_DRAFT
from env.model import ModelError, load_model
from env.target import PromptError
from experiments.cli import main
from tests.env.test_bad_inputs import _one_line

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=64, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)  # fmt: skip
WORDS = ["<unk>", "<s>", "</s>", "hello", "there", "user", ":", "hi"]
TEMPLATE = "{% for m in messages %}user : {{ m['content'] }}{% endfor %}"
FORWARDS = ["lean", "hf"]


def _tokenizer_files(out: Path) -> None:
    """A word-level tokenizer of a few words (ids below the model's vocabulary) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(conf))
    (out / "chat_template.jinja").write_text(TEMPLATE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama-tok")
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(out)
    _tokenizer_files(out)
    return out


def _copy(folder: Path, tmp_path: Path, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    out = tmp_path / "m"
    shutil.copytree(folder, out)
    for name in drop:
        (out / name).unlink()
    if config:
        values = json.loads((out / "config.json").read_text())
        values.update(config)
        (out / "config.json").write_text(json.dumps(values))
    return out


def _cli_refuses(args: list[str], capsys, *needles: str) -> None:
    capsys.readouterr()  # what the test printed before (transformers' progress bars)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"draftgym {args[0]}: error:") and "\n" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def _generate(path: Path, forward: str, *extra: str) -> list[str]:
    return ["generate", "--model", str(path), "--dtype", "fp32", "--device", "cpu", "--forward", forward,
            "--max-new-tokens", "3", *extra]  # fmt: skip


# ---- the tokenizer ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("forward", FORWARDS)
def test_the_folder_with_its_tokenizer_generates_on_both_forwards(folder, capsys, forward):
    assert main([*_generate(folder, forward), "hello there"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_damaged_tokenizer_is_refused_at_load_in_one_line(folder, tmp_path, capsys, forward):
    path = _copy(folder, tmp_path)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')  # a KeyError inside transformers
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu", forward=forward)
    _one_line(err, f"cannot load the tokenizer of {path}")
    _cli_refuses([*_generate(path, forward), "hello"], capsys, "cannot load the tokenizer of")


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_folder_without_a_tokenizer_is_one_line_at_first_use(folder, tmp_path, capsys, forward):
    path = _copy(folder, tmp_path, drop=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"))
    loaded = load_model(str(path), dtype="fp32", device="cpu", forward=forward)  # weights alone load
    with pytest.raises(ModelError) as err:
        _ = loaded.tokenizer
    _one_line(err, f"model folder {path} has no tokenizer")
    _cli_refuses([*_generate(path, forward), "hello"], capsys, "has no tokenizer")


@pytest.mark.parametrize("forward", FORWARDS)
def test_an_odd_head_size_is_refused_by_the_config_check(folder, tmp_path, capsys, forward):
    """transformers' rope refuses an odd rotary dimension with a validation error from inside its config class."""
    path = _copy(folder, tmp_path, config={"head_dim": 7})
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu", forward=forward)
    _one_line(err, "config.json: heads of 7 dimensions", "must be even")
    _cli_refuses([*_generate(path, forward), "hello"], capsys, "heads of 7 dimensions")


def test_the_lean_model_types_are_those_the_head_size_check_knows():
    from env.lean import LEAN_TYPES
    from env.model_checks import ROPE_PAIRS

    assert set(ROPE_PAIRS) == set(LEAN_TYPES)


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{% for m in messages %}{{ m['content'] }{% endfor %}", "TemplateSyntaxError: unexpected '}'"),
        (
            "{{ messages.__class__.__mro__[1].__subclasses__() }}",
            "SecurityError: access to attribute '__class__'",
        ),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ],
    ids=["syntax", "sandbox", "raise"],
)
@pytest.mark.parametrize("forward", FORWARDS)
def test_a_chat_template_that_does_not_render_is_one_line(
    folder, tmp_path, capsys, template, needle, forward
):
    from env.tokenizer import FastTokenizer

    path = _copy(folder, tmp_path)
    (path / "chat_template.jinja").write_text(template)
    loaded = load_model(str(path), dtype="fp32", device="cpu", forward=forward)
    for tok in (loaded.tokenizer, FastTokenizer(path)):  # transformers' and the embedded model's tokenizer
        with pytest.raises(ModelError) as err:
            chat_prompt(tok, "hello there")
        _one_line(err, f"the chat template of {path} does not render", needle)
    _cli_refuses([*_generate(path, forward), "hello"], capsys, "chat template", needle)
    assert main([*_generate(path, forward), "--raw", "hello"]) == 0  # no template: the folder still decodes
    capsys.readouterr()


# ---- the weights files ------------------------------------------------------------------------------------------


def _sharded(folder: Path, tmp_path: Path, config: dict | None = None) -> Path:
    """The folder's weights as a sharded checkpoint (several files and model.safetensors.index.json)."""
    from transformers import AutoModelForCausalLM

    out = _copy(folder, tmp_path)
    (out / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, max_shard_size="20KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    if config:
        values = json.loads((out / "config.json").read_text())
        values.update(config)
        (out / "config.json").write_text(json.dumps(values))
    return out


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_sharded_checkpoint_loads_as_the_single_file_does(folder, tmp_path, forward):
    path = _sharded(folder, tmp_path)
    one = load_model(str(folder), dtype="fp32", device="cpu", forward="hf").model.state_dict()
    many = load_model(str(path), dtype="fp32", device="cpu", forward=forward).model.state_dict()
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (
            {"vocab_size": 1 << 24, "hidden_size": 1 << 14},
            "embeddings of shape [64, 32], but config.json says",
        ),
        (
            {"num_key_value_heads": 4},
            "self_attn.k_proj.weight has shape [16, 32], config.json gives [32, 32]",
        ),
        ({"num_hidden_layers": 3}, "has no model.layers.2.input_layernorm.weight"),
    ],
    ids=["bomb", "kv-heads", "layers"],
)
def test_each_shard_is_checked_against_config_json_before_any_load(
    folder, tmp_path, capsys, forward, config, needle
):
    """A config asking for vocab 2^24 and hidden 2^14 made transformers attempt a 1 TB allocation; a shape that
    does not match was a RuntimeError traceback from inside transformers."""
    path = _sharded(folder, tmp_path, config)
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu", forward=forward)
    _one_line(err, "model.safetensors.index.json", needle)
    _cli_refuses([*_generate(path, forward), "hello"], capsys, needle)


@pytest.mark.parametrize("forward", FORWARDS)
def test_a_config_of_far_more_parameters_than_the_weights_hold_is_refused(folder, tmp_path, forward):
    """Whatever the model type (here one the lean checks do not know): transformers would allocate the rest."""
    path = _copy(
        folder, tmp_path, config={"model_type": "qwen3", "vocab_size": 1 << 24, "hidden_size": 1 << 14}
    )
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu", forward=forward)
    _one_line(err, "config.json gives a model of about", "but model.safetensors holds")


@pytest.mark.parametrize("forward", FORWARDS)
def test_an_error_inside_transformers_is_one_line(folder, tmp_path, forward):
    """A model type the lean checks do not know, with a tensor of another shape: transformers raises a RuntimeError."""
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 4}
    path = _copy(folder, tmp_path, config=config)
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu", forward=forward)
    _one_line(err, f"cannot load model from {path}")


class _Plant:
    """Unpickling this creates a file: the test checks no such file appears."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("content", ["pickle", "junk"])
def test_pickle_based_weights_are_refused_unread(folder, tmp_path, capsys, forward, content):
    path = _copy(folder, tmp_path, drop=("model.safetensors",))
    planted = tmp_path / "PLANTED"
    data = (
        pickle.dumps({"model.embed_tokens.weight": _Plant(planted)})
        if content == "pickle"
        else b"\x00junk" * 20
    )
    (path / "pytorch_model.bin").write_bytes(data)
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu", forward=forward)
    _one_line(err, "holds pytorch_model.bin (a PyTorch pickle)", "safetensors weights only")
    _cli_refuses([*_generate(path, forward), "hello"], capsys, "pytorch_model.bin")
    assert not planted.exists()


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        (
            {"weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}},
            "is not the name of a .safetensors",
        ),
        (
            {"weight_map": {"model.embed_tokens.weight": "absent.safetensors"}},
            "names absent.safetensors, which",
        ),
        (
            {"weight_map": {"model.embed_tokens.weight": "pytorch_model.bin"}},
            "is not the name of a .safetensors",
        ),
        ({"weight_map": []}, "weight_map is not an object"),
        ([1, 2], "weight_map is not an object"),
        ("{", "cannot read"),
    ],
    ids=["outside", "absent", "pickle", "list", "not-object", "not-json"],
)
def test_a_damaged_shard_index_is_one_line(folder, tmp_path, index, needle):
    path = _copy(folder, tmp_path, drop=("model.safetensors",))
    (path / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu")
    _one_line(err, "model.safetensors.index.json", needle)


def test_a_folder_without_weights_is_one_line(folder, tmp_path):
    path = _copy(folder, tmp_path, drop=("model.safetensors",))
    with pytest.raises(ModelError) as err:
        load_model(str(path), dtype="fp32", device="cpu")
    _one_line(err, "has no weights: no model.safetensors")


# ---- end of sequence --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generation", "want", "baseline"),
    [
        (None, [2, 5], [2, 5]),
        ({"eos_token_id": 7}, [7], [7]),
        ({"eos_token_id": [3, 4]}, [3, 4], [3, 4]),
        ({"bos_token_id": 1}, [2], []),  # a generation config without eos: the tokenizer's end token
    ],
    ids=["config.json", "generation-int", "generation-list", "generation-without-eos"],
)
def test_both_forwards_stop_at_the_same_ids_before_and_after_the_model_is_built(
    folder, tmp_path, generation, want, baseline
):
    """Without generation_config.json, transformers takes config.json's eos_token_id (a list here): the lean
    forward took the tokenizer's end token, and switched once ``model`` was built. The Hugging Face baselines
    stop at the same ids (``special_ids``), but for a generation config that gives none."""
    from drafters.hf_greedy import special_ids

    path = _copy(folder, tmp_path, config={"eos_token_id": [2, 5]}, drop=("generation_config.json",))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    lean = load_model(str(path), dtype="fp32", device="cpu")
    assert not lean.has_model and lean.eos_token_ids == want
    _ = lean.model
    assert lean.eos_token_ids == want
    hf = load_model(str(path), dtype="fp32", device="cpu", forward="hf")
    assert hf.eos_token_ids == want
    eos, _pad = special_ids(hf.model.generation_config)
    assert ([eos] if isinstance(eos, int) else list(eos or [])) == baseline


@pytest.mark.parametrize("bad", [True, [2, False], "2", [2.0]])
def test_an_eos_id_that_is_no_token_id_is_one_line(folder, tmp_path, bad):
    path = _copy(folder, tmp_path, config={"eos_token_id": bad}, drop=("generation_config.json",))
    with pytest.raises(ModelError) as err:
        _ = load_model(str(path), dtype="fp32", device="cpu").eos_token_ids
    _one_line(err, "config.json: eos_token_id must be a token id or a list of them")


# ---- prompts ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(folder) -> SpeculativeDecoder:
    return SpeculativeDecoder(load_model(str(folder), dtype="fp32", device="cpu"), [NO_DRAFT])


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize(
    ("text", "needle"), [("ab\udcffcd", "character 2 is a lone surrogate"), (" \n", "empty")]
)
def test_a_text_prompt_is_checked_with_or_without_the_chat_template(decoder, chat, text, needle):
    with pytest.raises(PromptError, match=needle):
        decoder.generate(text, max_new_tokens=2, chat=chat)


def test_raw_prompt_bytes_the_command_line_could_not_decode_are_one_line(folder, capsys):
    _cli_refuses([*_generate(folder, "lean"), "--raw", "ab\udcffcd"], capsys, "lone surrogate")


@pytest.mark.parametrize(
    "ids",
    [[5.9, 6.2, 7.7], [True, 5, 6], np.array([5.5, 6.5]), [5, 6.0]],
    ids=["floats", "bool", "np-float", "mix"],
)
def test_token_ids_that_are_not_integers_are_refused_not_truncated(decoder, ids):
    with pytest.raises(PromptError, match="token ids are integers"):
        decoder.generate(ids, max_new_tokens=2)


def test_integer_token_ids_of_any_integer_type_decode(decoder):
    want = decoder.generate([3, 4, 5], max_new_tokens=3)
    got = decoder.generate(np.array([3, 4, 5], dtype=np.int32), max_new_tokens=3)
    assert got.token_ids == want.token_ids and got.prompt_ids == [3, 4, 5]
    assert all(type(i) is int for i in got.prompt_ids)
    with pytest.raises(PromptError, match="not text or token ids"):
        decoder.generate(5, max_new_tokens=2)  # type: ignore[arg-type]
