"""Bad drafter options and damaged head descriptions: each is one ``DrafterError`` line naming the option or the
file and field, raised by the constructor or by ``load_head`` before any module is built -- never a TypeError,
a traceback mid-run, or a NaN that quietly turns a check off."""

from __future__ import annotations

import json
import math

import pytest

from drafters import DRAFTERS, DrafterError, make_drafter
from drafters.heads import HeadConfig, load_head
from tests.drafters.tiny import random_head, tiny_loaded

NAN, INF = float("nan"), float("inf")

BAD_OPTIONS = [
    ("ngram", {"max_ngram": 2.5}, "max_ngram must be an integer"),
    ("ngram", {"max_ngram": True}, "max_ngram must be an integer"),
    ("ngram", {"max_ngram": "3"}, "max_ngram must be an integer"),
    ("ngram", {"max_ngram": 0}, "max_ngram must be an integer in \\[1, "),
    ("ngram", {"max_ngram": 10**9}, "max_ngram must be an integer in \\[1, "),
    ("ngram", {"min_ngram": 3, "max_ngram": 2}, "min_ngram <= max_ngram"),
    ("ngram", {"max_matches": NAN}, "max_matches must be an integer"),
    ("ngram", {"max_depth": -1}, "max_depth must be an integer"),
    ("suffix", {"depth_limit": 1.5}, "depth_limit must be an integer"),
    ("suffix", {"max_match": None}, "max_match must be an integer"),
    ("suffix", {"cache_requests": -1}, "cache_requests must be an integer"),
    ("suffix", {"depth_limit": 4, "max_match": 4}, "1 <= max_match < depth_limit"),
    ("suffix", {"choose": 3}, "choose must be one of match, score, merge"),
    ("suffix", {"choose": "best"}, "choose must be one of"),
    ("recycling", {"width": 0}, "width must be an integer"),
    ("recycling", {"width": 8.0}, "width must be an integer"),
    ("recycling", {"width": 10**9}, "width must be an integer in \\[1, "),
    ("recycling", {"tree": ["dynamic"]}, "unknown tree builder"),
    ("recycling", {"prompt_prior": NAN}, "prompt_prior must be a number"),
    ("recycling", {"prompt_prior": 0.5}, "prompt_prior must be a number in \\[-10000, 0\\]"),
    ("eagle", {"min_prob": "abc"}, "eagle option min_prob must be a number in \\[0, 1\\]"),
    ("eagle", {"min_prob": NAN}, "min_prob must be a number"),
    ("eagle", {"min_prob": 1.5}, "min_prob must be a number"),
    ("eagle", {"tree": 3}, "unknown tree builder 3"),
    ("eagle", {"weights": 7}, "weights must be a file path"),
    ("eagle", {"vocab": 2.5}, "vocab must be an integer"),
    ("eagle3", {"min_prob": INF}, "eagle3 option min_prob"),
    ("eagle3", {"vocab": True}, "vocab must be an integer"),
    ("eagle3", {"weights": ["a"]}, "weights must be a file path"),
    ("early_exit", {"min_prob": -0.1}, "early_exit option min_prob"),
    ("early_exit", {"tree": "sideways"}, "unknown tree builder 'sideways'"),
    ("early_exit", {"weights": 1.0}, "weights must be a file path"),
    ("hybrid", {"parts": 5}, "parts must be two drafter names"),
    ("hybrid", {"parts": ["suffix", 3]}, "parts must be two drafter names"),
    ("hybrid", {"skip_at": NAN}, "skip_at must be a number"),
    ("hybrid", {"skip_at": "2"}, "skip_at must be a number"),
    ("hybrid", {"skip_match": 1.5}, "skip_match must be an integer"),
    ("hybrid", {"unscored": 0.0}, "unscored must be a number in \\(0, 1\\]"),
    ("hybrid", {"unscored": NAN}, "unscored must be a number"),
    ("hybrid", {"options": "x"}, "options must be a table of tables"),
    ("hybrid", {"options": {"bogus": {}}}, "options.bogus: 'bogus' is not a drafter"),
    ("hybrid", {"options": {"eagle3": {"vocab": -1}}}, "hybrid part eagle3: eagle3 option vocab"),
    (
        "hybrid",
        {"options": {"suffix": {"bogus": 1}}},
        "options.suffix.bogus: 'bogus' is not an option of suffix; valid: ",
    ),
    (
        "hybrid",
        {"options": {"eagle3": {"vocb": 8}}},
        "options.eagle3.vocb: 'vocb' is not an option of eagle3; valid: ",
    ),
    # an option the drafter does not take (the Python API: make_drafter, drafter_options): named, not a TypeError
    ("ngram", {"max_ngarm": 3}, "ngram has no option 'max_ngarm'; its options: .*max_ngram"),
    ("suffix", {"bogus": 1}, "suffix has no option 'bogus'"),
    # an integer too large for a float is no finite number (was an OverflowError naming no option)
    ("hybrid", {"skip_at": 10**400}, "skip_at must be a number"),
    ("recycling", {"prompt_prior": -(10**400)}, "prompt_prior must be a number"),
]


@pytest.mark.parametrize(("name", "opts", "needle"), BAD_OPTIONS, ids=lambda v: str(v)[:30])
def test_a_bad_option_is_one_drafter_error_line(name, opts, needle):
    with pytest.raises(DrafterError, match=needle) as info:
        make_drafter(name, **opts)
    assert "\n" not in str(info.value)


def test_the_no_draft_name_is_no_drafter_and_not_listed_as_one():
    with pytest.raises(DrafterError, match="unknown drafter 'none' \\(no drafter") as info:
        make_drafter("none")
    assert ", none" not in str(info.value) and "known drafters: eagle" in str(info.value)


def test_every_drafter_is_covered_and_its_defaults_build():
    assert {name for name, _, _ in BAD_OPTIONS} == set(DRAFTERS)
    for name in DRAFTERS:
        make_drafter(name)
    # good values of every type still build (an int where a float is asked, a list of parts)
    make_drafter("ngram", max_ngram=3, min_ngram=2, max_matches=4, max_depth=9)
    make_drafter("suffix", depth_limit=2, max_match=1, cache_requests=0, choose="match")
    make_drafter("recycling", width=3, tree="kary", prompt_prior=-2)
    make_drafter("eagle", weights="x.safetensors", tree="chain", min_prob=1, vocab=8)
    make_drafter("early_exit", weights=None, min_prob=0.6)
    make_drafter("hybrid", parts=["suffix", "ngram"], skip_at=0, skip_match=0, unscored=1,
                 options={"ngram": {"max_ngram": 3}})  # fmt: skip


def test_recycling_wider_than_the_vocabulary():
    """A table wider than the vocabulary keeps every token once; its other columns stay empty."""
    import torch

    d = make_drafter("recycling", width=8)
    d.update(torch.tensor([1]), torch.randn(1, 5))
    assert d.ids.shape == (5, 8) and sorted(d.ids[1, :5].tolist()) == [0, 1, 2, 3, 4]
    assert (d.ids[1, 5:] == -1).all() and math.isinf(float(d.logp[1, 7]))


# ---- head descriptions ----


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    loaded = tiny_loaded()
    folder = tmp_path_factory.mktemp("heads")
    return loaded, {k: random_head(k, loaded, folder / k) for k in ("eagle", "eagle3", "early_exit")}


def _with(path, tmp_path, edit):
    """A copy of head ``path`` whose description was changed by ``edit(meta)`` (the weights unchanged, so their
    sha256 still matches)."""
    import shutil

    out = tmp_path / path.name
    shutil.copy(path, out)
    meta = json.loads(path.with_suffix(".json").read_text())
    edit(meta)
    out.with_suffix(".json").write_text(json.dumps(meta))
    return out


def _set(*keys_value):
    *keys, value = keys_value

    def edit(meta):
        node = meta
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value

    edit.label = f"{'.'.join(keys)}={value!r}"  # the test id (a function's repr names its address)
    return edit


BAD_HEADS = [
    ("eagle", _set("config", "hidden", "32"), "config.hidden must be an integer >= 1, got '32'"),
    ("eagle", _set("config", "hidden", True), "config.hidden must be an integer"),
    ("eagle", _set("config", "head_dim", "8"), "config.head_dim must be an integer"),
    ("eagle", _set("config", "heads", -9), "config.heads must be an integer >= 1, got -9"),
    ("eagle", _set("config", "kv_heads", 0), "config.kv_heads must be an integer >= 1"),
    ("eagle", _set("config", "heads", 3), "config.heads \\(3\\) must be a multiple of config.kv_heads"),
    ("eagle", _set("config", "head_dim", 7), "config.head_dim must be even"),
    ("eagle", _set("config", "hidden", 48), "config.hidden is 48, this target's hidden size is 32"),
    ("eagle", _set("config", "head_dim", 10**6), "config.heads x config.head_dim .* too wide"),
    ("eagle", _set("config", "intermediate", 10**12), "config.intermediate \\(1000000000000\\) is too wide"),
    ("eagle", _set("config", "intermediate", 10**7), "config.intermediate .* too wide"),
    ("eagle", _set("config", "intermediate", 2.5), "config.intermediate must be an integer"),
    ("eagle", _set("config", "draft_vocab", 10**6), "config.draft_vocab .* exceeds this target's vocabulary"),
    ("eagle", _set("config", "rope_theta", NAN), "config.rope_theta must be a finite number > 0, got nan"),
    ("eagle", _set("config", "rope_theta", "1e4"), "config.rope_theta must be a finite number"),
    ("eagle", _set("config", "rms_eps", -1), "config.rms_eps must be a finite number > 0, got -1"),
    ("eagle", _set("config", "rms_eps", INF), "config.rms_eps must be a finite number"),
    ("eagle", _set("config", "kind", 5), "config.kind must be a string"),
    ("eagle", _set("config", "exit_layer", -1), "config.exit_layer must be an integer >= 0"),
    ("early_exit", _set("config", "exit_layer", 99), "config.exit_layer \\(99\\) must be below"),
    ("eagle3", _set("config", "fuse_layers", ["a"]), "config.fuse_layers must be a list"),
    ("eagle3", _set("config", "fuse_layers", 2), "config.fuse_layers must be a list"),
    ("eagle3", _set("config", "fuse_layers", [1, 99]), "config.fuse_layers \\[1, 99\\] must be layer counts"),
    ("eagle", _set("config", "bogus", 1), "not a draftgym head description"),
    ("eagle", _set("config", "abc"), "not a draftgym head description"),
    ("eagle", _set("target", "abc"), "target fingerprint must be a table, got 'abc'"),
    ("eagle", _set("target", None), "target fingerprint must be a table"),
    ("eagle", _set("target", "embed_checksum", "abc"), "embed_checksum must be a finite number, got 'abc'"),
    ("eagle", _set("target", "embed_checksum", None), "embed_checksum must be a finite number, got None"),
    ("eagle", _set("target", "embed_checksum", NAN), "embed_checksum must be a finite number, got nan"),
    ("eagle", _set("target", "embed_checksum", True), "embed_checksum must be a finite number"),
    ("eagle", _set("target", "hidden_size", "32"), "another target \\(hidden_size '32'"),
    ("eagle", _set("weights_sha256", 5), "weights_sha256 must be a hex string"),
]


@pytest.mark.parametrize(
    ("kind", "edit", "needle"), BAD_HEADS, ids=lambda v: getattr(v, "label", str(v))[:40]
)
def test_a_damaged_head_description_is_one_line_naming_the_file(kind, edit, needle, tiny_head, tmp_path):
    loaded, heads = tiny_head
    path = _with(heads[kind], tmp_path, edit)
    with pytest.raises(DrafterError, match=needle) as info:
        load_head(path, kind, loaded.model, loaded.model_id)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path) in msg


def test_a_drafter_refuses_a_huge_head_before_building_it(tiny_head, tmp_path):
    """``intermediate: 10**12`` would ask for terabytes: the drafter's first sequence fails in one line instead."""
    import torch

    from drafters import DraftContext
    from env.batch import BatchTarget

    loaded, heads = tiny_head
    path = _with(heads["eagle"], tmp_path, _set("config", "intermediate", 10**12))
    ctx = DraftContext(tokens=[1, 2, 3], prompt_len=2, target=BatchTarget(loaded, max_rows=1),
                       last_hidden=torch.zeros(32))  # fmt: skip
    with pytest.raises(DrafterError, match="config.intermediate .* too wide"):
        make_drafter("eagle", weights=str(path)).reset(ctx)


def test_head_config_checks_its_own_fields():
    good = dict(kind="eagle", hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, rope_theta=1e4,
                rms_eps=1e-6, draft_vocab=90)  # fmt: skip
    assert HeadConfig(**good, fuse_layers=[1, 2]).fuse_layers == (1, 2)
    for field, value in [("hidden", 0), ("rope_theta", NAN), ("rms_eps", 1.0), ("draft_vocab", "90")]:
        with pytest.raises(DrafterError, match=f"config.{field}"):
            HeadConfig(**{**good, field: value})


@pytest.mark.parametrize("kind", ["float", "uint8", "uint32"])
def test_a_d2t_of_other_than_signed_integer_ids_is_refused(tiny_head, tmp_path, kind):
    """Floats are no ids; unsigned ids had no min() (a traceback) and uint8 ones indexed as a boolean mask."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    loaded, heads = tiny_head
    path = _with(heads["eagle"], tmp_path, lambda meta: None)
    tensors = load_file(str(path))
    d2t = tensors["d2t"]
    tensors["d2t"] = d2t.float() + 0.5 if kind == "float" else d2t.to(getattr(torch, kind))
    save_file(tensors, str(path))
    meta = json.loads(path.with_suffix(".json").read_text())
    meta["weights_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match="'d2t' must hold int32/int64 ids"):
        load_head(path, "eagle", loaded.model, loaded.model_id)
