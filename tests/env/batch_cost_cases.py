"""A fitted batch cost model on a small grid, for the batch cost model's tests (``test_batch_cost.py``,
``test_batch_cost_files.py``)."""

from __future__ import annotations

import numpy as np

from env.batch_cost import FittedBatchCost
from env.cost import Curve

ROWS, NODES, REF = (1, 2, 4), (1, 3, 9), 128
# increasing in both axes, not bilinear itself (the interpolation is what is tested)
BASE = np.array([[0.010, 0.012, 0.020], [0.011, 0.014, 0.025], [0.013, 0.018, 0.040]])
SLOPE = np.array([[1e-6, 2e-6, 3e-6], [2e-6, 3e-6, 5e-6], [3e-6, 5e-6, 9e-6]])


def fitted(**kw) -> FittedBatchCost:
    args = dict(model_id="m", dtype="float32", weights="dense", rows=ROWS, nodes=NODES, context_ref=REF,
                base=BASE.copy(), slope=SLOPE.copy(), prefill=Curve((16, 64, 256), (0.01, 0.03, 0.1)),
                drafters={"ngram": 2e-4}, meta={"machine": {"cpu": "test cpu"}})  # fmt: skip
    args.update(kw)
    return FittedBatchCost(**args)
