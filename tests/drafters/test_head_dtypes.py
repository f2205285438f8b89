"""A head file's weights of the wrong dtype: a parameter must hold real floating-point values (not complex, integer
or bool; the int64 ``d2t`` map stays as it is), finite in the dtype the head computes in -- a float64 1e300 is finite
in the file and inf once converted to the module's fp32. Each is one DrafterError naming the tensor."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from drafters import DraftContext, DrafterError
from drafters.eagle import EagleDrafter, EagleHead
from drafters.heads import load_head, load_state
from tests.drafters.tiny import random_head, tiny_loaded


def _ctx(loaded):
    from env.batch import BatchTarget

    return DraftContext(
        tokens=[1, 2, 3], prompt_len=2, target=BatchTarget(loaded, max_rows=1), last_hidden=torch.zeros(32)
    )


def _forge(path, key: str, value: torch.Tensor) -> None:
    """Replace tensor ``key`` of a saved head and update the sha256 its description names (a forger can)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors[key] = value
    save_file(tensors, str(path))
    meta = json.loads(path.with_suffix(".json").read_text())
    meta["weights_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_suffix(".json").write_text(json.dumps(meta))


def _matrix(path) -> tuple[str, torch.Size]:
    from safetensors.torch import load_file

    key, t = next((k, t) for k, t in load_file(str(path)).items() if k != "d2t" and t.dim() == 2)
    return key, t.shape


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda s: torch.full(s, 1e300, dtype=torch.float64), "NaN or infinite in torch.float32"),
        (lambda s: torch.full(s, complex(float("nan"), 0.0), dtype=torch.complex64), "real floating-point"),
        (lambda s: torch.full(s, 0.01 + 0j, dtype=torch.complex64), "real floating-point"),
        (lambda s: torch.full(s, 2**40, dtype=torch.int64), "real floating-point"),
        (lambda s: torch.ones(s, dtype=torch.bool), "real floating-point"),
    ],
    ids=["f64-huge", "complex-nan", "complex-finite", "int64", "bool"],
)
def test_a_head_weight_of_the_wrong_dtype_is_refused(tmp_path, make, needle):
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h")
    key, shape = _matrix(path)
    _forge(path, key, make(shape))
    with pytest.raises(DrafterError, match=f"tensor {key} .*{needle}"):
        EagleDrafter(weights=str(path)).reset(_ctx(loaded))


def test_a_float64_head_of_ordinary_values_still_loads(tmp_path):
    """Any real floating dtype is accepted where its values fit the head's: float64 weights of a trained size."""
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h")
    key, shape = _matrix(path)
    _forge(path, key, torch.full(shape, 0.01, dtype=torch.float64))
    drafter = EagleDrafter(weights=str(path))
    drafter.reset(_ctx(loaded))
    got = dict(drafter.head.named_parameters())[key]
    assert got.dtype == torch.float32 and torch.all(got == torch.tensor(0.01, dtype=torch.float32))


def test_load_state_checks_the_dtype_the_head_will_compute_in(tmp_path):
    """fp32 weights of 1e5 are finite in the module (fp32) and inf in fp16: refused when fp16 is named."""
    loaded = tiny_loaded()
    path = random_head("eagle", loaded, tmp_path / "h")
    key, shape = _matrix(path)
    _forge(path, key, torch.full(shape, 1e5, dtype=torch.float32))
    cfg, tensors, _ = load_head(path, "eagle", loaded.model, loaded.model_id)
    load_state(EagleHead(cfg), tensors, str(path))  # fp32: fine
    with pytest.raises(
        DrafterError, match=f"tensor {key} holds values that are NaN or infinite in torch.float16"
    ):
        load_state(EagleHead(cfg), tensors, str(path), dtype=torch.float16)


@pytest.mark.parametrize("kind", ["eagle", "early_exit"])
def test_a_head_finite_in_its_file_but_not_in_an_fp16_targets_dtype_is_refused(tmp_path, kind):
    """The drafters check a head in the dtype they will run it in (``head_dtype``: the target's): fp32 weights of
    1e5 load for an fp32 target and are refused for an fp16 one, rather than drafting from inf."""
    from drafters.early_exit import EarlyExitDrafter
    from env.model import LoadedModel

    loaded = tiny_loaded()
    path = random_head(kind, loaded, tmp_path / "h")
    key, shape = _matrix(path)
    _forge(path, key, torch.full(shape, 1e5, dtype=torch.float32))
    make = EagleDrafter if kind == "eagle" else EarlyExitDrafter
    make(weights=str(path)).reset(_ctx(loaded))
    half = LoadedModel(model=loaded.model.half(), model_id=loaded.model_id, dtype=torch.float16, device="cpu")
    with pytest.raises(DrafterError, match=f"tensor {key} .*NaN or infinite in torch.float16"):
        make(weights=str(path)).reset(_ctx(half))
