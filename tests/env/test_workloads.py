import json

import pytest

from env.workloads import WorkloadError, load_workload


def test_builtin_covers_the_spec_bench_groups():
    prompts = load_workload()
    cats = {p.category for p in prompts}
    assert cats == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert len(load_workload(per_category=1)) == 6


def test_mt_bench_subcategories_round_robin(tmp_path):
    f = tmp_path / "w.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"q{i}"]}
        for i, c in enumerate(["writing"] * 3 + ["coding"] * 3)
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    got = load_workload(f, per_category=2)
    assert [p.prompt_id for p in got] == ["0", "3"] and {p.category for p in got} == {"mt_bench"}


def test_bad_workload_names_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question_id": 1, "category": "qa", "turns": ["ok"]}\n{not json}\n')
    with pytest.raises(WorkloadError, match=":2:"):
        load_workload(f)
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ({"question_id": 1, "category": "qa", "turns": "Say hi."}, "turns are not a list"),
        ({"question_id": 1, "category": None, "turns": ["Say hi."]}, "category is not a name"),
        ({"question_id": [1], "category": "qa", "turns": ["Say hi."]}, "question_id"),
        ({"question_id": 1, "category": "qa", "turns": []}, "turns are not a list"),
        (
            {"question_id": 1, "category": "qa", "turns": [{"text": "Say hi."}]},
            "first turn is not text but a JSON dict",
        ),
        ({"question_id": 1, "category": "qa", "turns": [3]}, "first turn is not text but a JSON int"),
        ({"question_id": 1, "category": "qa", "turns": [" "]}, "first turn is empty"),
    ],
)
def test_malformed_question_fields_are_refused(tmp_path, row, why):
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(WorkloadError, match=why) as err:
        load_workload(f)
    assert "\n" not in str(err.value) and "w.jsonl:1" in str(err.value)


def test_a_question_id_used_twice_is_refused(tmp_path):
    """Results are kept by prompt id: two prompts under one id would lose one of them on a resumed run."""
    f = tmp_path / "w.jsonl"
    rows = [{"question_id": 7, "category": "qa", "turns": [t]} for t in ("One?", "Two?")]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(WorkloadError, match="question_id 7 already used on line 1"):
        load_workload(f)


def test_a_code_workload_imports_nothing(tmp_path, monkeypatch):
    """``code:PKG.SUB`` reads the subpackage's source files; it never imports (runs) the package."""
    pkg = tmp_path / "ranpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n")
    (pkg / "sub" / "__init__.py").write_text(
        'def scale(x, k):\n    """Multiply every element of the list x by the factor k and return the new list."""\n'
        "    return [v * k for v in x]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = load_workload("code:ranpkg.sub")
    assert [p.prompt_id for p in prompts] == ["code-ranpkg.sub-__init__.py:scale"]
    assert not (tmp_path / "RAN").exists()
    for bad in ("ranpkg.absent", "ranpkg..sub", "os;x"):
        with pytest.raises(WorkloadError, match="not installed|not a package name"):
            load_workload(f"code:{bad}")


def test_line_separators_inside_strings_and_lone_surrogates(tmp_path):
    """JSON allows U+2028, U+0085 and the like raw inside a string (``json.dumps(ensure_ascii=False)`` writes
    them): such a line is one question. A lone surrogate escape is no text to tokenize: refused in one line."""
    from env.decoder import PromptError, chat_prompt

    f = tmp_path / "w.jsonl"
    rows = [{"question_id": 1, "category": "qa", "turns": ["One\u2028two\x85three?"]}]
    f.write_text(json.dumps(rows[0], ensure_ascii=False) + "\r\n", encoding="utf-8")
    (p,) = load_workload(f)
    assert p.text == "One\u2028two\x85three?"
    f.write_text('{"question_id": 1, "category": "qa", "turns": ["\\ud800 hi"]}\n')
    with pytest.raises(WorkloadError, match="w.jsonl:1: the first turn is not valid Unicode"):
        load_workload(f)
    with pytest.raises(PromptError, match="not valid text .*lone surrogate"):
        chat_prompt(None, "ab\udcff")


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ('{"question_id": 1, "category": "\\ud800", "turns": ["x"]}', "its category"),
        ('{"question_id": "\\udc00", "category": "qa", "turns": ["x"]}', "its question_id"),
        ('{"question_id": 1, "category": "qa", "turns": ["\\ud800 hi"]}', "the first turn"),
    ],
    ids=["category", "question_id", "turn"],
)
def test_a_lone_surrogate_in_any_field_written_with_the_results_is_one_line(tmp_path, line, what):
    """The category and question id are written with the results: a lone surrogate in either failed the run at its
    end (UnicodeEncodeError), after every prompt had been decoded."""
    f = tmp_path / "w.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=f"w.jsonl:1: {what} is not valid Unicode") as err:
        load_workload(f)
    assert "\n" not in str(err.value)


def test_categories_keep_only_the_groups_named_in_their_order(tmp_path):
    """``categories`` keeps those groups alone (every prompt of each), in the order given: a filter that kept every
    group would serve and train on prompts the caller left out."""
    f = tmp_path / "w.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"q{i}"]}
        for i, c in enumerate(["qa", "rag", "writing", "qa"])
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_workload(f, categories=["rag", "qa"])
    assert [(p.prompt_id, p.category) for p in got] == [("1", "rag"), ("0", "qa"), ("3", "qa")]
    assert [p.prompt_id for p in load_workload(f, categories=["mt_bench"])] == ["2"]


def test_a_code_workload_limit_spreads_over_the_source_files(tmp_path, monkeypatch):
    """``code_prompts(limit=N)`` keeps every k-th documented function (files in order), not the first N: a few
    prompts cover the whole package rather than its first files."""
    from env.workloads import code_prompts

    pkg = tmp_path / "spreadpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in "abcdefghij":
        (pkg / f"{name}.py").write_text(
            f'def f_{name}(x):\n    """Return the value x multiplied by two, for the module {name} here."""\n'
            "    return 2 * x\n"
        )
    with (pkg / "a.py").open("a") as fh:  # too short a docstring to say what to write
        fh.write('def g_a(x):\n    """Double x."""\n    return 2 * x\n')
    (pkg / "tests").mkdir()  # a test suite is no source of instructions
    (pkg / "tests" / "test_a.py").write_text(
        'def check_a(x):\n    """Check that the value x multiplied by two is what the module returns."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    every = [pid for pid, _ in code_prompts("spreadpkg", limit=100)]
    assert every == [f"code-spreadpkg-{n}.py:f_{n}" for n in "abcdefghij"]
    assert [pid for pid, _ in code_prompts("spreadpkg", limit=5)] == every[::2]
