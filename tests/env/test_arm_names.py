"""The arm-name parser (``DRAFTER-dDEPTH[-kTOPK][-bBUDGET]`` or ``none``) on arbitrary text: it returns an arm
whose name parses back to the same arm, or refuses the text with a one-line ``DrafterError`` — nothing else."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafters import DRAFTERS, DrafterError, TreeShape
from env.engine import NO_DRAFT, Arm, parse_arm

PIECES = st.sampled_from(
    ["ngram", "recycling", "eagle", "early_exit", "bogus", "-", "d", "k", "b", "none", "ar"]
)
NAMES = st.one_of(
    st.text(max_size=24),
    st.lists(st.one_of(PIECES, st.integers(-3, 40).map(str), st.text(max_size=2)), max_size=8).map("".join),
)


@settings(max_examples=600, deadline=None)
@given(NAMES)
def test_any_text_parses_to_a_stable_arm_or_a_one_line_error(text):
    try:
        arm = parse_arm(text)
    except DrafterError as err:
        assert "\n" not in str(err)
        return
    again = parse_arm(arm.name)
    assert again.name == arm.name
    assert again.drafter == arm.drafter and again.shape.max_nodes == arm.shape.max_nodes
    assert arm is NO_DRAFT or arm.drafter in DRAFTERS


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(DRAFTERS)), st.integers(1, 64), st.integers(1, 8), st.integers(0, 600))
def test_every_arm_round_trips_through_its_name(drafter, depth, topk, budget):
    arm = Arm(drafter, TreeShape(depth=depth, topk=topk, budget=budget))
    back = parse_arm(arm.name)
    assert back.name == arm.name and back.shape.max_nodes == arm.shape.max_nodes


def test_named_refusals():
    for text, needle in [
        ("ngram-d3-d4", "cannot read arm"),
        ("ngram-d٣", "cannot read arm"),  # a non-ASCII digit
        ("ngram", "has no depth"),
        ("ngram-d0", "depth must be >= 1"),
        ("ngram-d2-k0", "topk must be >= 1"),
        ("bogus-d2", "unknown drafter 'bogus'"),
    ]:
        try:
            parse_arm(text)
        except DrafterError as err:
            assert needle in str(err), (text, err)
        else:
            raise AssertionError(f"{text!r} was accepted")


def test_a_method_names_its_target_variant_or_is_refused_in_one_line():
    import pytest
    import torch

    from env.engine import split_weights
    from env.model import LoadedModel, ModelError, with_weights

    assert split_weights("ngram-d3") == ("ngram-d3", None)
    assert split_weights("ar@int4") == ("ar", "int4")
    assert split_weights("ngram-d3@int4+compiled") == ("ngram-d3", "int4+compiled")
    assert split_weights("ar@compiled") == ("ar", "compiled")
    for bad in ("ar@int3", "ar@int4+fast", "ar@+compiled", "ar@", "ar@int4+"):
        with pytest.raises(DrafterError, match="unknown target variant") as err:
            split_weights(bad)
        assert "\n" not in str(err.value)
    from pathlib import Path

    loaded = LoadedModel(tokenizer=None, model_id="m", dtype=torch.float32, device=torch.device("cpu"),
                         folder=Path("unused"), config=object())  # fmt: skip
    assert with_weights(loaded, None) is loaded and with_weights(loaded, "dense") is loaded
    both = with_weights(loaded, "int4+compiled")
    assert (both.weights, both.forward) == ("int4", "compiled")
    assert with_weights(loaded, "int4+compiled") is both
    alone = with_weights(loaded, "compiled")
    assert (alone.weights, alone.forward) == ("dense", "compiled")
    with pytest.raises(ModelError, match="needs the lean forward"):
        with_weights(loaded.replace(forward="hf"), "int4")
    from experiments.bench import runs_compiled

    assert runs_compiled("ar@int4+compiled", loaded) and runs_compiled("ngram-d3@compiled", loaded)
    assert not runs_compiled("ar@int4", loaded) and not runs_compiled("ngram-d3", loaded)
    compiled = loaded.replace(forward="compiled")
    assert runs_compiled("ngram-d3", compiled)
    assert not runs_compiled("hf_greedy", compiled) and not runs_compiled("llama_cpp", compiled)
    with pytest.raises(ModelError, match="unknown target variant"):
        with_weights(loaded, "int4+hf")


@pytest.mark.parametrize(
    "fields, needle",
    [
        ((float("nan"),), "tree depth must be an integer, got nan"),  # passed every comparison
        ((2.5,), "tree depth must be an integer, got 2.5"),  # the suffix drafter drafted 3 deep
        ((3, True), "tree topk must be an integer, got True"),
        ((3, 2, 2.5), "tree budget must be an integer, got 2.5"),  # named 'ngram-d4-k2-b2.5', unparseable
        (("3",), "tree depth must be an integer, got '3'"),  # a bare TypeError
        ((None,), "tree depth must be an integer, got None"),
    ],
)
def test_a_tree_shape_takes_integers_only(fields, needle):
    with pytest.raises(DrafterError, match=re.escape(needle)):
        TreeShape(*fields)
    assert (
        TreeShape(np.int64(3), np.int32(2)) == TreeShape(3, 2) and type(TreeShape(np.int64(3)).depth) is int
    )


def test_an_arm_built_by_hand_gets_the_checks_of_its_name(tmp_path):
    """``Arm`` objects skipped the bounds arm names get (``ngram-d999`` refused, ``Arm("ngram", TreeShape(999))``
    taken by the menu, the serving simulator and the decoder, which drafted 600 nodes a step)."""
    from env.arms import make_arms
    from env.decoder import SpeculativeDecoder
    from env.engine import as_arm
    from env.model import load_model
    from env.serve_sim import ServeEnvError, ServeSim

    deep = Arm("ngram", TreeShape(999))
    with pytest.raises(DrafterError, match="arm ngram-d999: tree depth must be <= 256, got 999"):
        make_arms([deep])
    with pytest.raises(ServeEnvError, match="arm ngram-d999: tree depth must be <= 256"):
        ServeSim(1, arms=["none", deep], loads=["1"], requests=2)
    tiny = load_model("random:llama-tiny", dtype="fp32", device="cpu")
    with pytest.raises(DrafterError, match="arm ngram-d999: tree depth must be <= 256"):
        SpeculativeDecoder(tiny, [deep])
    for bad, needle in [(Arm("bogus", TreeShape(2)), "names an unknown drafter"), (5, "got int 5"),
                        (Arm("ngram", "d4"), "its shape is not a TreeShape")]:  # fmt: skip
        with pytest.raises(DrafterError, match=needle):
            as_arm(bad)
    assert SpeculativeDecoder(tiny, ["ngram-d2"]).arms == [parse_arm("ngram-d2")]  # a name: an AttributeError
    with pytest.raises(DrafterError, match="an arm name is a string"):
        parse_arm(None)


def test_the_serving_simulator_reads_strings_as_lists_not_characters():
    """``prompt_ids="12"`` served prompts '1' and '2'; ``arms="ngram-d4"`` said arm 'n' is unknown."""
    from env.serve_sim import ServeEnvError, ServeSim

    with pytest.raises(
        ServeEnvError, match="prompt_ids is a list of the trace's prompt ids, got the string '12'"
    ):
        ServeSim(1, prompt_ids="12", loads=["1"], requests=2)
    assert ServeSim(1, arms="none,ngram-d4", loads=["1"], requests=2).arm_names == ["none", "ngram-d4"]
    with pytest.raises(ServeEnvError, match="arms is a list of arms or a comma list of names, got 5"):
        ServeSim(1, arms=5, loads=["1"], requests=2)  # a bare TypeError
