"""Hostile and damaged files for the loaders' tests: pickles that would create a marker file when unpickled.

``payload(marker)`` is a pickle whose ``__reduce__`` calls ``open(marker, "w")``: unpickling it creates the file,
so a test that loads a file carrying it and then finds no marker shows the loader never unpickled it
(``test_payload_is_live`` shows the payload does create the file when it is unpickled).
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np


class Creates:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payload(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when loaded."""
    return pickle.dumps({"weights": Creates(marker)})


def torch_payload(marker: Path) -> bytes:
    """``torch.save`` of a dict holding the hostile object (a torch checkpoint that runs code with
    ``weights_only=False``)."""
    import torch

    buf = io.BytesIO()
    torch.save({"head": Creates(marker), "opt": {}, "step": 0, "cpu_s": 0.0, "epoch": 0}, buf)
    return buf.getvalue()


def npz_payload(marker: Path, **arrays: np.ndarray) -> bytes:
    """An ``.npz`` archive with an object array holding the hostile object (next to ``arrays``)."""
    buf = io.BytesIO()
    obj = np.empty(1, dtype=object)
    obj[0] = Creates(marker)
    np.savez(buf, header=np.array('{"format": "draftgym-trace", "version": 1}'), evil=obj, **arrays)
    return buf.getvalue()


def replace_members(src: Path, dst: Path, members: dict[str, bytes]) -> Path:
    """A copy of the zip ``src`` with ``members`` replaced or added."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            if name not in members:
                zout.writestr(name, zin.read(name))
        for name, data in members.items():
            zout.writestr(name, data)
    return dst
