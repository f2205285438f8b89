"""The device-resident decoding loop (env.device_loop) on the CPU: greedy output equal to Hugging Face greedy
(fp32, the embedded model) for autoregressive and lookup-chain steps, full and partly filled buckets; a step reads
nothing back to the host (no aten op that synchronizes, checked under a dispatch mode that a planted read trips)
and traces as one graph (torch.compile, fullgraph); the verify buffers give the reference's results. On CUDA
(skipped here) the same under torch.cuda.set_sync_debug_mode("error") and with the step in CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from env.decoder import chat_prompt
from env.device_loop import DeviceLoop, parse_device_arm
from env.lean import lean_of
from env.target import PromptError, eos_ids
from env.workloads import load_workload
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.model

CATEGORIES = ["summarization", "rag", "mt_bench"]
# aten ops that read a device value back to the host (or need to, for their output's size)
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique_consecutive",
              "_unique2", "repeat_interleave"}  # fmt: skip


class HostReads(TorchDispatchMode):
    """Records every aten op that reads a tensor's value on the host (``.item()``, ``int(t)``, ``bool(t)``,
    ``nonzero``, boolean-mask indexing, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args
            if isinstance(a, (list, tuple))
            for i in a
        )
        if name in HOST_READS or bool_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def prompts(fp32_model):
    ws = load_workload()
    return [
        chat_prompt(fp32_model.tokenizer, next(p for p in ws if p.category == c).text) for c in CATEGORIES
    ]


@pytest.fixture(scope="module")
def expected(fp32_model, prompts):
    return [hf_greedy(fp32_model, p, 40) for p in prompts]


@pytest.mark.parametrize("arm", ["none", "lookup-d4", "lookup-d7"])
def test_greedy_equals_hf_generate(fp32_model, prompts, expected, arm):
    net = lean_of(fp32_model)
    loop = DeviceLoop(net, 3, parse_device_arm(arm), 1200, eos_ids(fp32_model), check_every=5)
    run = loop.generate(prompts, 40)
    assert run.tokens == expected
    assert run.tau > 1.1 if arm != "none" else run.tau == 1.0  # the lookup drafts were accepted somewhere
    if arm == "lookup-d7":
        part = DeviceLoop(net, 4, parse_device_arm(arm), 1200, eos_ids(fp32_model)).generate(prompts[1:], 40)
        assert part.tokens == expected[1:]  # a bucket of 4 rows with 2 in use


def test_end_of_sequence_and_short_limits(fp32_model):
    tok = fp32_model.tokenizer
    short, longer = chat_prompt(tok, "What is the capital of France?"), chat_prompt(tok, "Say hello.")
    want = [hf_greedy(fp32_model, ids, 40) for ids in (short, longer)]
    assert [len(w) for w in want] == [8, 30] and all(w[-1] in eos_ids(fp32_model) for w in want)  # they stop
    loop = DeviceLoop(lean_of(fp32_model), 2, 3, 400, eos_ids(fp32_model), check_every=2)
    run = loop.generate([short, longer], 40)
    assert run.tokens == want
    assert run.row_steps[0] < run.row_steps[1]  # the finished row stopped stepping
    assert loop.generate([longer, short], 5).tokens == [want[1][:5], want[0][:5]]
    assert loop.generate([short], 1).tokens == [want[0][:1]]


def test_a_step_reads_nothing_back_and_traces_as_one_graph(fp32_model, prompts):
    loop = DeviceLoop(lean_of(fp32_model), 3, 5, 1200, eos_ids(fp32_model))
    loop.prefill(prompts, 40)
    span = 1024
    with HostReads() as mode:
        loop.step(span)
        loop.step(span)
    assert mode.reads == []
    with HostReads() as planted:  # the check can fail
        loop.step(span)
        int(loop.lens.max())
    assert planted.reads == ["_local_scalar_dense"]
    step = torch.compile(loop.step, backend="eager", fullgraph=True)  # a graph break (a host read) raises
    before = loop.n_out.clone()
    step(span)
    assert bool((loop.n_out > before).all())


def test_bench_runs_the_device_loop(fp32_model, prompts, expected):
    from experiments.bench import run_method

    decoders: dict = {}
    ids, wall, steps, tau, _ = run_method("device:lookup-d3", fp32_model, decoders, prompts[0], 40)
    assert ids == expected[0] and wall > 0 and tau > 1.0 and steps < 40
    assert isinstance(decoders["device:lookup-d3"], DeviceLoop)  # built once, kept for the next prompt


def test_bad_settings_are_one_line_errors(fp32_model):
    net = lean_of(fp32_model)
    for bad in ("lookup", "lookup-d0", "ngram-d3", "lookup-d99"):
        with pytest.raises(ValueError, match="unknown device-loop arm"):
            parse_device_arm(bad)
    loop = DeviceLoop(net, 2, 2, 300, eos_ids(fp32_model))
    with pytest.raises(PromptError, match="exceed"):
        loop.generate([[5] * 290], 20)  # 300 positions asked for, plus the steps' margin
    with pytest.raises(PromptError, match="empty"):
        loop.generate([[]], 20)
    with pytest.raises(ValueError, match="3 prompts for a loop of 2 rows"):
        loop.generate([[5], [6], [7]], 4)
    with pytest.raises(ValueError, match="CUDA"):
        DeviceLoop(net, 1, 0, 100, [2], graph=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_no_host_sync_and_hf_greedy():
    """Eager and in CUDA graphs (captured lazily by ``generate``, and up front by ``capture()`` as ``bench`` does),
    under ``set_sync_debug_mode("error")``: Hugging Face greedy's tokens on CUDA. One model load for all four."""
    from env.model import load_model

    cuda = load_model(dtype="fp32", device="cuda")
    ws = load_workload()
    ids = [chat_prompt(cuda.tokenizer, next(p for p in ws if p.category == c).text) for c in CATEGORIES]
    want = [hf_greedy(cuda, p, 40) for p in ids]
    net = lean_of(cuda)
    for graph, up_front in ((False, False), (True, False), (True, True)):
        for depth in (0, 5):
            loop = DeviceLoop(net, 4, depth, 1200, eos_ids(cuda), graph=graph)
            if up_front:
                loop.capture()
            got = loop.generate(ids, 40, strict_sync=True).tokens
            assert got == want, (graph, up_front, depth)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_bf16_steps_attend_through_the_triton_kernel(monkeypatch):
    """bf16 on CUDA: a chain's forward attends through ``kernels.tree_attention`` (``DRAFTGYM_ATTENTION=auto``), its
    logits those of SDPA's within bf16 rounding (relative error over the whole [1, 16, V] block), the same top token
    nearly everywhere; whole generations in CUDA graphs under ``set_sync_debug_mode("error")`` with it, accepting
    drafts on prompts that quote their source (summarization, RAG)."""
    from env.model import load_model

    m = load_model(dtype="bf16", device="cuda")
    net = lean_of(m)
    ws = load_workload()
    prompts = [
        chat_prompt(m.tokenizer, next(p for p in ws if p.category == c).text)
        for c in ("summarization", "rag")
    ]
    logits = {}
    for mode in ("sdpa", "auto"):
        monkeypatch.setenv("DRAFTGYM_ATTENTION", mode)
        loop = DeviceLoop(net, 1, 15, 2048, eos_ids(m))
        loop.prefill([prompts[0]], 40)
        ids = loop.draft()
        logits[mode] = loop.forward(ids, 2048).float()
    a, b = logits["auto"], logits["sdpa"]
    rel = ((a - b).norm() / b.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert rel < 0.05 and agree >= 0.75, (rel, agree, (a - b).abs().max().item())
    monkeypatch.setenv("DRAFTGYM_ATTENTION", "auto")
    loop = DeviceLoop(net, 2, 5, 2048, eos_ids(m), graph=True)
    run = loop.generate(prompts, 64, strict_sync=True)
    assert all(len(t) > 0 for t in run.tokens) and run.tau > 1.1, (run.tau, [len(t) for t in run.tokens])


def test_a_bad_attention_setting_is_one_line(monkeypatch, capsys):
    """``DRAFTGYM_ATTENTION`` other than auto, sdpa, triton: refused when the model loads, in one line, code 2."""
    from experiments.cli import main

    monkeypatch.setenv("DRAFTGYM_ATTENTION", "flash")
    code = main(["generate", "Hello.", "--max-new-tokens", "2", "--dtype", "fp32", "--drafter", "none"])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in line and "DRAFTGYM_ATTENTION='flash'" in line, line


def test_a_random_weight_shape_decodes_exactly():
    """``random:SHAPE`` (speed studies of larger shapes): a seeded Llama of that shape; both engines give its
    Hugging Face greedy tokens."""
    from env.decoder import SpeculativeDecoder
    from env.engine import parse_arm
    from env.model import ModelError, load_model

    m = load_model("random:llama-tiny", dtype="fp32", device="cpu")
    assert m.model_id == "random-llama-tiny" and m.config.num_key_value_heads == 2
    ids = chat_prompt(m.tokenizer, "Repeat: one two three four, one two three four")
    want = hf_greedy(m, ids, 30)
    g = SpeculativeDecoder(m, [parse_arm("ngram-d6-k3-b12")]).generate(ids, max_new_tokens=30)
    assert g.token_ids == want and g.stats.tau > 1.0
    assert DeviceLoop(lean_of(m), 2, 4, 600, eos_ids(m)).generate([ids], 30).tokens == [want]
    again = load_model("random:llama-tiny", dtype="fp32", device="cpu")
    assert hf_greedy(again, ids, 30) == want  # seeded: the same model every load
    with pytest.raises(ModelError, match="unknown random model shape 'llama-70b'"):
        load_model("random:llama-70b", dtype="fp32", device="cpu")


def test_a_random_weight_shape_needs_only_the_tokenizer(tmp_path, monkeypatch):
    """A cache holding only the embedded model's tokenizer files (what a GPU machine reached by copying gets, without
    the GGUF) loads ``random:SHAPE`` with that tokenizer and converts nothing."""
    import shutil

    from env import model as model_mod

    src = model_mod.embedded_model_folder()
    folder = tmp_path / "models" / model_mod.DEFAULT_MODEL
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, folder / name)
    monkeypatch.setenv("DRAFTGYM_CACHE", str(tmp_path))
    monkeypatch.setattr(model_mod, "embedded_gguf_path", lambda: pytest.fail("converted the GGUF"))
    m = model_mod.load_model("random:llama-tiny", dtype="fp32", device="cpu")
    ids = chat_prompt(m.tokenizer, "Say one word.")
    assert ids and m.tokenizer.decode(ids).count("Say one word.") == 1
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
