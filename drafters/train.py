"""Self-distillation for the trained draft heads (``eagle``, ``early_exit``): the target answers prompts greedily,
and the heads learn to predict the target's own next features / tokens (EAGLE, arXiv 2401.15077, section 4;
Kangaroo, arXiv 2404.18911). Only the target and a prompt set are needed.

1. ``drafters.train_data``: the target's greedy answers (or teacher-forced prompts) with its hidden states and
   early-exit residual streams captured, written in resumable parts.
2. ``train_head``: AdamW on a held-out-split dataset; loss = soft cross-entropy against the target's distribution
   restricted to the draft vocabulary, plus (eagle) a smooth-L1 feature regression; EAGLE-3's training-time test
   unrolls the head ``levels`` times. A checkpoint of the training state (head, optimizer, the batch generator) is
   written every ``save_every_s`` seconds and picked up again after a kill. The budget is CPU minutes, or ``steps``:
   then the learning-rate schedule follows the steps, and a run killed and resumed trains exactly the head an
   uninterrupted one does (a CPU budget ends, and sets the schedule, at a time no two runs share). The held-out
   metric is the top-1 agreement with the target per draft depth and the mean accepted length of a chain of
   ``levels`` drafts.

Costs are counted in CPU seconds of this process (``time.process_time``), summed over resumed sessions.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from drafters.base import DrafterError
from drafters.heads import HeadConfig, aux_layers, check_fingerprint, save_head, target_fingerprint
from drafters.train_checkpoint import check_state_path, load_train_state, resume, save_train_state
from drafters.train_data import Sequence, draft_vocab, load_data, repeat_answers, split, windows

# ---------------------------------------------------------------- training


MAX_STEPS = 1 << 24  # optimizer steps a training is given at most (--steps): weeks on a CPU
MAX_LEVELS = 64  # training-time-test unrolls (EAGLE-3 trains 7): past it, hours or a memory error, not a head


@dataclass(frozen=True)
class TrainSettings:
    kind: str  # eagle | eagle3 | early_exit
    draft_vocab: int = 6144
    exit_layer: int = 4  # early_exit only
    levels: int = 2  # eagle: training-time-test depth (also the chain length of the held-out metric)
    batch_size: int = 8
    compute: str = "float32"  # or "bfloat16": the head's products under autocast (weights and optimizer fp32)
    lr: float = 3e-3
    weight_decay: float = 0.05
    feat_noise: float = 0.2  # eagle: uniform noise on input features (EAGLE's augmentation; features' RMS ~2)
    reg_weight: float = 0.2  # eagle: weight of the smooth-L1 feature loss (the cross-entropy weighs 1)
    prompt_frac: float = 1.0  # share of prompt positions in the loss (every answer position is in it)
    answer_repeat: int = 1  # windows holding answer positions appear this many times an epoch
    window: int = 192  # train on the last `window` positions of each sequence
    cpu_minutes: float = 10.0  # stop when this process's CPU time (summed over resumes) reaches it
    steps: int = 0  # > 0: the budget in optimizer steps instead (the lr schedule follows them: reproducible)
    max_steps: int = 100_000
    seed: int = 0
    save_every_s: float = 60.0


def build_head(kind: str, cfg: HeadConfig, model: Any) -> torch.nn.Module:
    """A fresh head. The early-exit adapter starts as target layer ``exit_layer`` (it reads the residual stream that
    layer reads, so it starts as "exit one layer later"); the eagle layer starts random (a copied layer scored worse
    at step 0: it maps f_t to a guess of x_{t+1} again). Both output norms start as the target's final norm."""
    from drafters.eagle import EagleHead
    from drafters.early_exit import ExitAdapter

    head = EagleHead(cfg) if kind in ("eagle", "eagle3") else ExitAdapter(cfg)
    src = model.model.layers[cfg.exit_layer]
    mine = head.layer
    pairs = [
        (mine.norm1, src.input_layernorm),
        (mine.q, src.self_attn.q_proj),
        (mine.k, src.self_attn.k_proj),
        (mine.v, src.self_attn.v_proj),
        (mine.o, src.self_attn.o_proj),
        (mine.norm2, src.post_attention_layernorm),
        (mine.gate, src.mlp.gate_proj),
        (mine.up, src.mlp.up_proj),
        (mine.down, src.mlp.down_proj),
    ]
    with torch.no_grad():
        head.norm.weight.copy_(
            model.model.norm.weight.float()
        )  # outputs on the scale of the target's features
        if kind == "early_exit":
            for a, b in pairs:
                a.weight.copy_(b.weight.float())
    return head.float()


def _batches(seqs: list[Sequence], size: int, gen: torch.Generator):
    perm = torch.randperm(len(seqs), generator=gen).tolist()
    for i in range(0, len(perm), size):
        yield [seqs[j] for j in perm[i : i + size]]


def _collate(
    batch: list[Sequence],
    kind: str,
    exit_layer: int,
    window: int,
    gen: torch.Generator | None = None,
    fuse: tuple[int, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """Padded tensors of ``window`` positions per sequence -- the last ones (the answer), or for a sequence without
    answer a random window when ``gen`` is given: tokens [B, T], inputs [B, T, H] (early exit: the states after
    ``exit_layer`` layers), feats [B, T, H], lens [B], answer_start [B]; eagle3: aux [B, T, k * H], the streams
    after the layers ``fuse`` (the head's ``fuse_layers``; None: every layer the data captured)."""
    t = min(window, max(s.tokens.shape[0] for s in batch))
    h = batch[0].feats.shape[1]
    out = {
        "tokens": torch.zeros(len(batch), t, dtype=torch.long),
        "feats": torch.zeros(len(batch), t, h),
        "lens": torch.zeros(len(batch), dtype=torch.long),
        "answer_start": torch.zeros(len(batch), dtype=torch.long),
    }
    if kind == "early_exit":
        out["inputs"] = torch.zeros(len(batch), t, h)
    if kind != "eagle3":
        fuse = ()
    elif fuse is None:
        fuse = tuple(sorted(batch[0].exits))
    if fuse:
        out["aux"] = torch.zeros(len(batch), t, len(fuse) * h)
    for b, s in enumerate(batch):
        cut = max(0, s.tokens.shape[0] - t)
        if gen is not None and cut and s.answer_start >= s.tokens.shape[0]:
            cut = int(torch.randint(0, cut + 1, (1,), generator=gen))
        n = min(t, s.tokens.shape[0] - cut)
        out["tokens"][b, :n] = s.tokens[cut : cut + n]
        out["feats"][b, :n] = s.feats[cut : cut + n].float()
        out["lens"][b] = n
        out["answer_start"][b] = max(0, s.answer_start - cut)
        if fuse:
            if not set(fuse) <= set(s.exits):
                raise DrafterError(
                    f"the eagle3 head fuses the streams after layers {list(fuse)}; the data captured "
                    f"{sorted(s.exits)}"
                )
            for k, n_layer in enumerate(fuse):
                out["aux"][b, :n, k * h : (k + 1) * h] = s.exits[n_layer][cut : cut + n].float()
        if kind == "early_exit":
            if exit_layer not in s.exits:
                raise DrafterError(
                    f"the data has no states after layer {exit_layer}; captured: {sorted(s.exits)}"
                )
            out["inputs"][b, :n] = s.exits[exit_layer][cut : cut + n].float()
    return out


def _select(batch: dict[str, torch.Tensor], shift: int, last: int, frac: float, gen: torch.Generator | None):
    """Loss positions j (predicting the token at j + shift): valid (j + shift <= n - 1 - last ... see callers),
    every answer position, and a ``frac`` sample of the prompt positions. Returns (sel [B, T], answer [B, T])."""
    b, t = batch["tokens"].shape
    j = torch.arange(t)[None, :]
    valid = j <= batch["lens"][:, None] - 1 - last
    answer = (j + shift) >= batch["answer_start"][:, None]
    pick = torch.rand(b, t, generator=gen) < frac if gen is not None else torch.zeros(b, t, dtype=torch.bool)
    return valid & (answer | pick), valid & answer


def loss_eagle(head, batch, w_draft, embed, st: TrainSettings, gen=None, stats: dict | None = None):
    """Pair j = (f_j, e(x_{j+1})) predicts f_{j+1} and the target's distribution over x_{j+2} (teacher
    softmax(W f_{j+1}) over the draft vocabulary); valid for j <= n - 3 (the last token has no feature) and, at
    level s, j >= s - 1."""
    tokens, feats = batch["tokens"], batch["feats"]
    emb_next = torch.zeros_like(feats)
    emb_next[:, :-1] = embed(tokens[:, 1:]).float()
    target = torch.zeros_like(feats)
    target[:, :-1] = feats[:, 1:]
    sel, answer = _select(batch, 2, 2, st.prompt_frac, gen)
    j = torch.arange(tokens.shape[1])[None, :]
    inputs = feats
    if gen is not None and st.feat_noise > 0:  # training: robustness to the head's own (noisy) features
        inputs = feats + (torch.rand(feats.shape, generator=gen) * 2 - 1) * st.feat_noise
    if "aux" in batch:  # EAGLE-3: the first feature is the fusion of the low, middle and high streams
        inputs = head.fused(batch["aux"])
    outs = head.unrolled(inputs, emb_next, st.levels)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the teacher stays fp32 under bf16 training
        teacher_all = torch.softmax(target[sel] @ w_draft.T, dim=-1)  # [M, Vd], shared by the levels
    j_sel = j.expand_as(sel)[sel]
    total = 0.0
    for s, out in enumerate(outs, start=1):
        m = sel & (j >= s - 1)
        teacher = teacher_all[j_sel >= s - 1]
        logp = torch.log_softmax((out[m] @ w_draft.T).float(), dim=-1)
        ce = -(teacher * logp).sum(-1)
        if st.reg_weight > 0:
            ce = ce + st.reg_weight * F.smooth_l1_loss(out[m], target[m], reduction="none").mean(-1)
        total = total + ce.mean()
        if stats is not None:
            hit = torch.zeros_like(m)
            if "_exact" in stats:  # the drafted token against the target's argmax over its whole vocabulary
                if s == 1:
                    stats["_full"] = _full_argmax(target[sel], stats["_exact"][0])
                hit[m] = stats["_exact"][1][logp.argmax(-1)] == stats["_full"][j_sel >= s - 1]
            else:
                hit[m] = logp.argmax(-1) == teacher.argmax(-1)
            _agree(stats, s, hit, m & answer)
    return total / len(outs)


def _full_argmax(feats: torch.Tensor, w_full: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The target's greedy token for each feature row (its LM head over the whole vocabulary), in chunks."""
    parts = [(feats[i : i + chunk] @ w_full.T).argmax(-1) for i in range(0, feats.shape[0], chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # (a batch may select nothing)


def loss_exit(head, batch, w_draft, st: TrainSettings, gen=None, stats: dict | None = None):
    """Position j: the residual stream after ``exit_layer`` layers predicts the target's distribution over
    x_{j+1} (teacher softmax(W f_j)); valid for j <= n - 2."""
    feats = batch["feats"]
    sel, answer = _select(batch, 1, 1, st.prompt_frac, gen)
    out = head.forward_train(batch["inputs"])
    with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the teacher stays fp32 under bf16 training
        teacher = torch.softmax(feats[sel] @ w_draft.T, dim=-1)
    logp = torch.log_softmax((out[sel] @ w_draft.T).float(), dim=-1)
    loss = -(teacher * logp).sum(-1).mean()
    if stats is not None:
        hit = torch.zeros_like(sel)
        hit[sel] = logp.argmax(-1) == teacher.argmax(-1)
        _agree(stats, 1, hit, sel & answer)
    return loss


def _autocast(st: TrainSettings):
    """The products of a training step in ``st.compute``: bf16 under autocast, the backward's too (the logits are
    cast back, so softmaxes, the loss and the teacher stay fp32; the weights and AdamW's state are fp32 either way).
    On a CPU with native bf16 products a step takes about half the time."""
    if st.compute not in ("float32", "bfloat16"):
        raise DrafterError(f"training compute must be float32 or bfloat16, got {st.compute!r}")
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=st.compute == "bfloat16")


def _agree(stats: dict, level: int, hit: torch.Tensor, mask: torch.Tensor) -> None:
    key = f"top1_depth{level}"
    a, n = stats.get(key, (0, 0))
    stats[key] = (a + int((hit & mask).sum()), n + int(mask.sum()))
    stats.setdefault("_hits", {})[level] = (hit & mask, mask)


@torch.no_grad()
def evaluate(
    head,
    seqs: list[Sequence],
    w_draft,
    embed,
    st: TrainSettings,
    exact: tuple | None = None,
    fuse: tuple[int, ...] | None = None,
) -> dict[str, float]:
    """Held-out top-1 agreement with the target (on answer tokens) per draft depth, and for eagle the mean accepted
    length (bonus included) of a greedy chain of ``levels`` drafts rooted at every answer position (a chain rooted
    at pair j is accepted to depth m when levels 1..m hit at pairs j..j+m-1).

    ``exact = (the target's LM head weight [V, H], d2t)``: a hit is the drafted token equal to the target's argmax
    over its whole vocabulary -- what verification accepts, and comparable between heads of different draft
    vocabularies (a token outside the head's vocabulary is a miss). Without it, the argmax of the target's
    distribution restricted to the draft vocabulary (the larger the vocabulary, the harder that is to agree with).
    ``fuse``: an eagle3 head's ``fuse_layers`` (None: every layer the data captured, as training checks them)."""
    head.eval()
    exact = (
        exact if st.kind in ("eagle", "eagle3") else None
    )  # (the early-exit loss scores the draft vocabulary)
    stats: dict[str, Any] = {} if exact is None else {"_exact": (exact[0].float(), exact[1])}
    tau_sum, tau_n = 0.0, 0
    for i in range(0, len(seqs), st.batch_size):
        batch = _collate(seqs[i : i + st.batch_size], st.kind, st.exit_layer, st.window, fuse=fuse)
        if st.kind in ("eagle", "eagle3"):
            loss_eagle(head, batch, w_draft, embed, st, None, stats)
            hits = stats.pop("_hits")
            alive = hits[1][1]
            run = torch.ones_like(alive)
            acc = torch.zeros(alive.shape)
            for s in range(1, st.levels + 1):
                h = torch.zeros_like(run)
                h[:, : h.shape[1] - (s - 1)] = hits[s][0][:, s - 1 :]
                run = run & h
                acc += run.float()
            tau_sum += float(((acc + 1) * alive).sum())
            tau_n += int(alive.sum())
        else:
            loss_exit(head, batch, w_draft, st, None, stats)
            stats.pop("_hits")
    head.train()
    stats.pop("_exact", None)
    stats.pop("_full", None)
    out = {k: round(a / max(n, 1), 4) for k, (a, n) in stats.items()}
    out["agreement"] = "full vocabulary" if exact is not None else "draft vocabulary"
    if tau_n:
        out[f"chain{st.levels}_tau"] = round(tau_sum / tau_n, 4)
    out["positions"] = stats.get("top1_depth1", (0, 0))[1]
    return out


def _trajectory(st: TrainSettings) -> dict[str, Any]:
    """The settings a resumed run must share with the checkpoint (all but the budget and the save interval; the
    step budget is compared apart, ``train_checkpoint.resume``: a CPU budget resumes any checkpoint)."""
    return {
        k: v for k, v in asdict(st).items() if k not in ("cpu_minutes", "steps", "max_steps", "save_every_s")
    }


def check_data_fits(seqs: list[Sequence], model: Any, data_dirs: Any) -> None:
    """The data is this target's: token ids within its vocabulary, features of its hidden size (data made for
    another model fails in one line here, not as a shape error inside the loss)."""
    where = ", ".join(map(str, data_dirs))
    vocab, hidden = int(model.config.vocab_size), int(model.config.hidden_size)
    if any(s.tokens.numel() and int(s.tokens.max()) >= vocab for s in seqs):
        raise DrafterError(f"the data in {where} holds token ids outside this target's vocabulary of {vocab} "
                           "(made for another model?)")  # fmt: skip
    width = next((int(s.feats.shape[1]) for s in seqs if s.feats.dim() == 2), hidden)
    if width != hidden:
        raise DrafterError(f"the data in {where} holds features of size {width}; this target's hidden size is "
                           f"{hidden} (made for another model?)")  # fmt: skip


def train_head(
    model: Any,
    model_id: str,
    data_dirs: list[Path],
    out_path: Path,
    st: TrainSettings,
    *,
    work_dir: Path,
    data_info: dict[str, Any],
    progress: bool = True,
    keep_ids: set[str] | None = None,
) -> dict[str, Any]:
    """Train (or resume training) a head on the data in ``data_dirs`` (``keep_ids``: only these prompts' and
    windows' sequences); save it to ``out_path`` with its metadata."""
    from tqdm import tqdm

    torch.manual_seed(st.seed)
    seqs = load_data(*data_dirs, keep=keep_ids)
    check_data_fits(seqs, model, data_dirs)
    train, held = split(seqs)
    whole = train  # (the counts below: windows overlap)
    if st.kind == "eagle3":  # every position trains: long sequences are cut into windows
        train, held = windows(train, st.window), windows(held, st.window)
    distinct, train = train, repeat_answers(train, st.answer_repeat)
    # what the batches are drawn from: a resume on other data (another prefill, more prompts) would train on it
    # from the middle of an epoch of this data's length
    data_id = hashlib.sha256(json.dumps(sorted(
        (s.prompt_id, int(s.tokens.shape[0]), int(s.answer_start)) for s in distinct)).encode()).hexdigest()[:16]  # fmt: skip
    eos = model.generation_config.eos_token_id
    size = min(st.draft_vocab, int(model.config.vocab_size))
    d2t = draft_vocab(distinct, size, always=tuple(eos if isinstance(eos, list) else [eos]))
    hidden = model.config.hidden_size
    fuse: tuple[int, ...] = ()
    if st.kind == "eagle3":
        fuse = tuple(sorted(seqs[0].exits))
        want = aux_layers(int(model.config.num_hidden_layers))
        if fuse != want:
            raise DrafterError(
                f"eagle3 needs the data's streams after layers {list(want)}; it has {list(fuse)}"
            )
    cfg = HeadConfig.from_target(
        model, st.kind, len(d2t), exit_layer=st.exit_layer if st.kind == "early_exit" else 0, fuse_layers=fuse
    )
    w_draft = model.lm_head.weight.detach()[d2t].float()
    embed = model.get_input_embeddings()
    head = build_head(st.kind, cfg, model)
    opt = torch.optim.AdamW(head.parameters(), lr=st.lr, weight_decay=st.weight_decay, betas=(0.9, 0.95))
    fingerprint = target_fingerprint(model, model_id)
    steps_per_epoch = math.ceil(len(train) / st.batch_size)
    state_path = work_dir / f"train-state-{st.kind}.pt"
    check_state_path(state_path)
    step, cpu_before, epoch = 0, 0.0, 0
    resume_gen: torch.Tensor | None = None  # the batch generator's state when the checkpoint was written
    if state_path.is_file():  # resume after a kill
        state = load_train_state(state_path)
        check_fingerprint(state.get("target", {}), model, model_id, f"training checkpoint {state_path}")
        run = {"data": data_id, "config": asdict(cfg), "d2t": d2t, "settings": _trajectory(st),
               "steps_per_epoch": steps_per_epoch}  # fmt: skip
        resume(state_path, state, head, opt, run=run, defaults=_trajectory(TrainSettings(kind=st.kind)),
               steps=st.steps)  # fmt: skip
        step, epoch, cpu_before = int(state["step"]), int(state["epoch"]), float(state["cpu_s"])
        resume_gen = state.get("gen")
    if hidden != cfg.hidden:
        raise DrafterError(f"the data's features have size {hidden}, the head {cfg.hidden}")
    cpu0, last_save = time.process_time(), time.monotonic()
    budget_s = st.cpu_minutes * 60
    total_steps = min(st.max_steps, max(1, int(steps_per_epoch * 50)))
    # the bar's total: the step count when it is the budget; else percent of the CPU-minute budget (ETA from it)
    by_steps = bool(st.steps)
    bar = tqdm(total=st.steps if by_steps else 100.0, initial=step if by_steps else 0.0, desc=f"train {st.kind}",
               disable=not progress, unit="step" if by_steps else "% CPU budget",
               bar_format=None if by_steps else "{l_bar}{bar}| {n:.1f}/{total:.0f}% [{elapsed}<{remaining}{postfix}]")  # fmt: skip

    def cpu_used() -> float:
        return cpu_before + time.process_time() - cpu0

    def progress_frac() -> float:  # of the budget: steps when given (reproducible), else CPU time
        return step / st.steps if st.steps else min(1.0, cpu_used() / budget_s)

    def finished() -> bool:
        if st.steps:
            return step >= st.steps
        return cpu_used() >= budget_s or step >= min(st.max_steps, total_steps)

    gen: torch.Generator | None = None
    loss: torch.Tensor | None = None

    def save_state() -> None:
        save_train_state(state_path, {
            "head": head.state_dict(), "opt": opt.state_dict(), "step": step, "cpu_s": cpu_used(), "epoch": epoch,
            "gen": gen.get_state() if gen is not None else resume_gen, "config": asdict(cfg),
            "settings": {**_trajectory(st), "steps": st.steps}, "d2t": d2t, "data": data_id, "target": fingerprint,
        }, loss)  # fmt: skip

    head.train()
    done = finished()
    while not done:
        gen = torch.Generator().manual_seed(st.seed + epoch)
        batches = list(_batches(train, st.batch_size, gen))  # this epoch's order, drawn from gen
        start = step - epoch * steps_per_epoch  # resumed mid-epoch: the batches already seen are skipped ...
        if resume_gen is not None:  # ... and gen goes on from where the checkpoint left it (exact resume)
            gen.set_state(resume_gen)
            resume_gen = None
        for batch in batches[start:]:
            frac = progress_frac()
            lr = st.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            tens = _collate(batch, st.kind, st.exit_layer, st.window, gen)
            with _autocast(st):
                if st.kind in ("eagle", "eagle3"):
                    loss = loss_eagle(head, tens, w_draft, embed, st, gen)
                else:
                    loss = loss_exit(head, tens, w_draft, st, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            if by_steps:
                bar.update(1)
            else:
                bar.update(100.0 * progress_frac() - bar.n)
            bar.set_postfix(step=step, loss=f"{loss.item():.3f}", cpu_min=f"{cpu_used() / 60:.1f}")
            if time.monotonic() - last_save > st.save_every_s:
                save_state()
                last_save = time.monotonic()
            if finished():
                done = True
                break
        else:
            epoch += 1
    bar.close()
    save_state()
    train_cpu_s = cpu_used()  # (the held-out evaluation below is not training)
    metric = evaluate(head, held, w_draft, embed, st, exact=(model.lm_head.weight.detach(), d2t))
    n_tokens = sum(int(s.tokens.shape[0]) for s in whole)  # distinct positions (answer_repeat not counted)
    n_answer = sum(int(s.tokens.shape[0]) - s.answer_start for s in whole)
    meta = {
        "target": fingerprint,
        "trained_dtype": "float32",
        "trained_compute": st.compute,
        "training": {
            "settings": asdict(st),
            "data": data_info,
            "train_sequences": len(train),
            "heldout_sequences": len(held),
            # the prompts this head never trained on, as ``head_eval`` scores it (a corpus folder grows)
            "heldout_ids": sorted({s.prompt_id for s in held}),
            "train_positions": n_tokens,
            "train_answer_tokens": n_answer,
            "steps": step,
            "train_cpu_minutes": round(train_cpu_s / 60, 2),
            "data_cpu_minutes": round(float(data_info.get("cpu_s", 0.0)) / 60, 2),
        },
        "metric": metric,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    save_head(out_path, head, d2t, cfg, meta)
    return meta
