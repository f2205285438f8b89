"""The baselines and the tables they are compared in: the Hugging Face baselines decode greedily whatever a model
folder's ``generation_config.json`` holds (a repetition penalty, suppressed tokens, a list of eos ids); ``run``
warms the static-cache sizes ``bench`` does; a run's summary and report name the settings the run resolved and the
machine it ran on; the best speculative method is never an autoregressive loop; a ratio with no prompt in common
is null, not NaN."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments.records import Record

PROMPT = [13, 70, 49, 76, 31, 8]  # the tiny target decodes other tokens here under a repetition penalty


def _tiny_folder(root: Path, **generation: object) -> Path:
    """The tiny test target saved as a Hugging Face folder whose generation config holds ``generation``."""
    from tests.drafters.tiny import tiny_loaded

    model = tiny_loaded().model
    for k, v in generation.items():
        setattr(model.generation_config, k, v)
    model.save_pretrained(root)
    return root


@pytest.mark.parametrize("generation", [{"repetition_penalty": 1.3}, {"suppress_tokens": [8]}])
def test_hf_baselines_are_greedy_whatever_the_folders_generation_config(tmp_path, generation):
    from env.model import load_model
    from experiments.hf_baselines import HFRunner
    from tests.drafters.tiny import decode

    loaded = load_model(str(_tiny_folder(tmp_path, **generation)), dtype="fp32", device="cpu")
    want = decode(loaded, None, PROMPT, 16)[0]  # our greedy loop
    for method in ("hf_greedy", "hf_pld", "hf_static"):
        got, wall = HFRunner(loaded, method).run(PROMPT, 16)
        assert got == want, method
    gen = loaded.model.generation_config  # the model's own config, as loaded, after the calls
    assert all(getattr(gen, k) == v for k, v in generation.items())


def test_hf_baselines_take_a_list_of_eos_ids(tmp_path):
    from env.model import load_model
    from experiments.hf_baselines import HFRunner
    from tests.drafters.tiny import decode

    loaded = load_model(str(_tiny_folder(tmp_path, eos_token_id=[94, 95], pad_token_id=None)), dtype="fp32",
                        device="cpu")  # fmt: skip
    want = decode(loaded, None, PROMPT, 12)[0]
    for method in ("hf_greedy", "hf_static"):
        assert HFRunner(loaded, method).run(PROMPT, 12)[0] == want, method
    from drafters.hf_greedy import special_ids

    assert special_ids(SimpleNamespace(eos_token_id=[94, 95], pad_token_id=None)) == ([94, 95], 94)
    assert special_ids(SimpleNamespace(eos_token_id=[94, 95], pad_token_id=0)) == ([94, 95], 0)
    assert special_ids(SimpleNamespace(eos_token_id=7, pad_token_id=None)) == (7, 7)


class _WordTokenizer:
    """One id per word, no chat template: enough for ``chat_prompt``."""

    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [5] * len(text.split())}


def test_run_warms_each_static_cache_size_as_bench_does(tmp_path, monkeypatch):
    """A 300-word prompt with 64 new tokens needs the second 256-position bucket; the warm-up prompt builds the
    first. ``run`` and ``bench`` both build it untimed before the timed call."""
    import experiments.bench as bench
    import experiments.runner as runner
    from env.workloads import load_workload
    from experiments.config import load_config

    loaded = SimpleNamespace(model_id="tiny", dtype=torch.float32, device=torch.device("cpu"), weights="dense",
                             forward="lean", tokenizer=_WordTokenizer(), max_context=2048, config=SimpleNamespace(vocab_size=64))  # fmt: skip
    workload = tmp_path / "long.jsonl"
    workload.write_text(
        json.dumps({"question_id": 1, "category": "summarization", "turns": ["word " * 300]}) + "\n"
    )
    calls: list[tuple[int, int]] = []

    def fake(method, loaded, decoders, ids, n, **kw):
        calls.append((len(ids), n))
        return [5] * n, 0.1, n, 1.0, []

    monkeypatch.setattr(bench, "run_method", fake)
    monkeypatch.setattr(runner, "run_method", fake)
    bench.run_bench(loaded, load_workload(str(workload)), ["hf_static"], max_new_tokens=64, out_dir=tmp_path / "b",
                    settings={}, progress=False)  # fmt: skip
    in_bench, calls[:] = list(calls), []
    cfg = load_config(
        None, sets=['methods=["hf_static"]', f'workload.path="{workload}"', "decode.max_new_tokens=64"]
    )
    runner.run(cfg, tmp_path / "r", progress=False, loaded=loaded)
    assert in_bench == calls == [(2, 4), (257, 4), (300, 64)]


def _run_folder(root: Path, settings_of: SimpleNamespace | None) -> Path:
    """A finished run directory (made-up records); ``settings.json`` as ``draftgym run`` writes it for a model
    loaded as ``settings_of`` (None: a folder from before it had one)."""
    from experiments.args import same_settings
    from experiments.config import load_config
    from experiments.records import load_done
    from experiments.runner import finish, prepare_run_dir, run_settings, select_prompts

    cfg = load_config(None, text='name = "r"\nmethods = ["ar", "ngram-d8"]\n[workload]\nlimit = 2\n')
    out = root / "r"
    prepare_run_dir(cfg, out)
    if settings_of is not None:
        same_settings(out, run_settings(cfg, settings_of), started=False, command="run")
    recs = [Record(m, p.prompt_id, p.category, 40, 20, w, 20, 1.0, list(range(20)), ["none"] * 19)
            for p in select_prompts(cfg) for m, w in (("ar", 2.0), ("ngram-d8", 1.0))]  # fmt: skip
    (out / "records.jsonl").write_text("".join(json.dumps(r.__dict__) + "\n" for r in recs))
    finish(cfg, out, load_done(out / "records.jsonl"), select_prompts(cfg))
    return out


def test_a_runs_summary_and_report_name_its_resolved_settings_and_machine(tmp_path, monkeypatch):
    from env.machine import cpu_label
    from experiments import plots
    from experiments.cli import main

    notes: list[str] = []
    real_save = plots._save
    monkeypatch.setattr(
        plots, "_save", lambda fig, path, note="": notes.append(note) or real_save(fig, path, note)
    )
    loaded = SimpleNamespace(model_id="smollm2-135m-instruct", dtype=torch.bfloat16, device=torch.device("cpu"),
                             weights="int4", forward="lean")  # as "auto" resolves on a bf16 CPU  # fmt: skip
    out = _run_folder(tmp_path, loaded)
    s = json.loads((out / "summary.json").read_text())["settings"]
    assert (s["dtype"], s["device"], s["weights"], s["forward"]) == ("bfloat16", "cpu", "int4", "lean")
    assert s["machine"] == {"cpu": cpu_label()}
    assert notes == [f"measured on CPU {cpu_label()}"] * 3  # each plot's footer
    assert f"CPU {cpu_label()}" in (out / "summary.md").read_text()
    prov = out / "provenance.jsonl"  # the machine had a GPU the run did not use
    line = json.loads(prov.read_text())
    line["machine"].update(cuda=True, gpu="Some GPU 80GB")
    prov.write_text(json.dumps(line) + "\n")
    assert main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "(bfloat16, weights int4, forward lean) on cpu" in text and "(auto)" not in text
    assert f"- machine: CPU {cpu_label()}" in text and "Some GPU" not in text
    from experiments.runner import machine_label

    cuda = {"device": "cuda:0", "machine": {"cpu": "X", "gpu": "H200"}}
    assert machine_label(cuda) == "GPU H200 (cuda:0), CPU X"
    assert machine_label({**cuda, "device": "cpu"}) == "CPU X"


def test_a_summary_from_before_the_settings_were_named_is_still_reported(tmp_path):
    from experiments.cli import main

    out = _run_folder(tmp_path, None)  # no settings.json: the config's values
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["dtype"] == "auto" and summary["settings"]["machine"] is None
    summary["settings"] = {k: summary["settings"][k] for k in ("model", "dtype", "workload", "prompts",
                                                               "max_new_tokens", "temperature", "methods")}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))  # as an older version wrote it
    assert main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert (
        "- model smollm2-135m-instruct (auto), workload builtin (2 prompts)" in text and "- machine: " in text
    )


def _row(method: str, x: float, category: str = "overall") -> dict:
    return {"category": category, "method": method, "prompts": 1, "tokens": 10, "tokens_per_s": 10.0 * x,
            "tau": 1.0, "speedup_vs_hf": x, "speedup_vs_ar": x, "median_speedup_vs_ar": x}  # fmt: skip


def test_the_best_speculative_method_is_never_an_autoregressive_loop():
    from experiments.bench import best_by_category, format_table

    loops = ["ar", "none", "ar@int4", "none@int4+compiled", "device:none", "hf_pld", "hf_static", "llama_cpp"]
    rows = [_row("hf_greedy", 1.0)] + [_row(m, 3.0 + i) for i, m in enumerate(loops)]
    rows += [_row("ngram-d8", 1.5), _row("device:lookup-d4", 1.7), _row("ngram-d8@int4", 1.2)]
    assert best_by_category(rows) == {"overall": ("device:lookup-d4", 1.7)}
    assert "best speculative method" in format_table(rows)
    only_one = [r for r in rows if r["method"] != "device:lookup-d4" and r["method"] != "ngram-d8@int4"]
    assert "best speculative method" not in format_table(only_one)  # one method to choose among: no choice


def test_a_ratio_with_no_prompt_in_common_is_null_not_nan():
    from experiments.bench import format_table, summarize

    def rec(method: str, pid: str) -> Record:
        return Record(method, pid, "qa", 10, 8, 0.5, 8, 1.0, list(range(8)))

    rows = summarize(
        [rec("hf_greedy", "1"), rec("ar", "1"), rec("ngram-d8", "2")], ["hf_greedy", "ar", "ngram-d8"]
    )
    ours = next(r for r in rows if r["method"] == "ngram-d8" and r["category"] == "overall")
    assert ours["speedup_vs_hf"] is None and ours["speedup_vs_ar"] is None
    json.dumps(rows, allow_nan=False)  # standard JSON: bench.json holds null
    line = next(ln for ln in format_table(rows).splitlines() if ln.startswith("overall") and "ngram-d8" in ln)
    assert line.split()[-3:] == ["-", "-", "-"]
