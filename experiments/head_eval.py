"""Held-out agreement of trained heads on the same data: ``python -m experiments.head_eval --data DIR ...`` loads
the distillation data, takes its held-out split (``drafters.train_data.split``: every 10th answered sequence, in
windows as eagle3 trains), and scores each head -- the shipped ``eagle`` (final-norm features) and ``eagle3`` (fused
features), or files given with ``--weights`` -- with ``drafters.train.evaluate``: top-1 agreement with the target
per draft depth on answer tokens, and the mean accepted length of a greedy chain of ``--levels`` drafts. A hit is
the drafted token equal to the target's greedy one (``--agreement full``, the default); ``--agreement draft`` scores
the argmax over the head's own draft vocabulary instead, as the first reports did.

    python -m experiments.head_eval --data ~/.cache/draftgym/corpus/smollm2-135m-instruct-KEY/answers --levels 4
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROG = "python -m experiments.head_eval"


def main(argv: list[str] | None = None) -> int:
    from env.cli import run_program
    from experiments.errors import USER_ERROR_TYPES

    return run_program(PROG, _main, argv, USER_ERROR_TYPES)


def _main(argv: list[str] | None) -> int:
    import torch

    from drafters import DrafterError
    from drafters.eagle import EagleHead
    from drafters.heads import DATA_DIR, cache_heads_dir, find_head, load_head, load_state
    from drafters.train import MAX_LEVELS, TrainSettings, check_data_fits, evaluate, windows
    from drafters.train_data import load_data, split
    from env.cli import Parser, int_at_least, output_file, positive_int, write_json
    from env.model import DEFAULT_MODEL, load_model, model_folder

    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", required=True, help="distillation data folders")
    p.add_argument("--heads", default="eagle,eagle3", help="head kinds to score")
    p.add_argument("--weights", nargs="*", default=[], help="head files, in the order of --heads")
    p.add_argument("--levels", type=int_at_least(1, MAX_LEVELS), default=4)
    p.add_argument("--window", type=positive_int, default=512)
    p.add_argument(
        "--agreement",
        default="full",
        choices=["full", "draft"],
        help="a hit: the target's argmax over its whole vocabulary (full; comparable across draft vocabularies) "
        "or over the head's draft vocabulary (draft; what earlier reports used)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dirs = [Path(d) for d in args.data]
    kinds = [k.strip() for k in args.heads.split(",") if k.strip()]
    if not kinds or len(args.weights) > len(kinds):
        raise DrafterError(f"--heads names {len(kinds)} head(s), --weights {len(args.weights)} file(s)")
    paths = []  # every head file found before the model loads
    for i, kind in enumerate(kinds):
        if kind not in ("eagle", "eagle3"):
            raise DrafterError(f"--heads: {kind!r} is not a head this evaluation scores (eagle, eagle3)")
        # ("" keeps a kind's default head while a later kind is given a file: --weights "" NEW.safetensors)
        path = find_head(kind, DEFAULT_MODEL, (args.weights[i] if i < len(args.weights) else None) or None)
        if not path.is_file():
            raise DrafterError(f"no head file {path}")
        paths.append(path)
    heads = tuple(p for path in paths for p in (path, path.with_suffix(".json")))  # weights, description
    # (every head description is JSON: none is overwritten, nor anything in the folders heads or data come from)
    read = (*dirs, model_folder(DEFAULT_MODEL), DATA_DIR, cache_heads_dir())
    json_out = output_file(args.json, flag="--json", inputs=heads, folders=read)
    recorded = [_heldout_ids(p) for p in paths]
    if recorded and all(r is not None for r in recorded):  # the prompts none of the heads trained on
        keep = set.intersection(*recorded)  # type: ignore[arg-type]
        held = [s for s in load_data(*dirs, keep=keep) if s.answer_start < s.tokens.shape[0]] if keep else []
        if not held:
            raise DrafterError(f"the heads' recorded held-out prompts share none in {', '.join(args.data)}")
        source = f"held out by every head ({len(keep)} prompts recorded)"
    else:  # heads from before the ids were recorded: the folder's own split (a grown folder may hold their
        # training prompts among it)
        _, held = split(load_data(*dirs))  # before the model: a bad folder is one line
        source = "the folder's split (a head here records no held-out prompts)"
    print(f"held-out sequences: {len(held)}, {source}", file=sys.stderr, flush=True)
    held = windows(held, args.window)
    loaded = load_model(None, dtype="fp32", device="cpu")
    model = loaded.model
    check_data_fits(held, model, args.data)
    out = []
    for kind, path in zip(kinds, paths):
        cfg, tensors, meta = load_head(path, kind, model, loaded.model_id)
        fuse = tuple(cfg.fuse_layers)
        captured = sorted(set.intersection(*(set(s.exits) for s in held))) if held else []
        if fuse and not set(fuse) <= set(captured):  # other streams: wrong numbers, or a shape error
            raise DrafterError(
                f"the {kind} head {path} fuses the target's streams after layers {list(fuse)}; the data in "
                f"{', '.join(args.data)} captured layers {captured}"
            )
        head = EagleHead(cfg)
        load_state(head, tensors, str(path))
        head = head.float().eval()
        d2t = tensors["d2t"]
        w_draft = model.lm_head.weight.detach()[d2t].float()
        st = TrainSettings(
            kind=kind, draft_vocab=len(d2t), levels=args.levels, window=args.window, batch_size=8
        )
        with torch.no_grad():
            exact = (model.lm_head.weight.detach(), d2t) if args.agreement == "full" else None
            metric = evaluate(head, held, w_draft, model.get_input_embeddings(), st, exact=exact, fuse=fuse)
        tokens = [t for s in held for t in s.tokens[s.answer_start :].tolist()]
        vocab = set(d2t.tolist())
        cover = sum(t in vocab for t in tokens) / max(1, len(tokens))
        row = {
            "head": kind,
            "file": path.name,
            "draft_vocab": len(d2t),
            "answer_coverage": round(cover, 4),
            "heldout": source,
            **metric,
        }
        out.append(row)
        print(json.dumps(row), flush=True)
        write_json(json_out, out, indent=2)  # as measured: a later head's error keeps this one's row
    return 0


def _heldout_ids(head: Path) -> set[str] | None:
    """The prompt ids a head file's JSON records as held out of its training; None when it records none."""
    from env.safe_zip import ArchiveProblem, parse_json

    try:
        meta = parse_json(head.with_suffix(".json").read_bytes())
    except (ArchiveProblem, OSError):
        return None
    training = meta.get("training") if isinstance(meta, dict) else None
    ids = training.get("heldout_ids") if isinstance(training, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return None
    return set(ids)


if __name__ == "__main__":
    raise SystemExit(main())
