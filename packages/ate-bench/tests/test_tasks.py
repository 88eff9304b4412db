"""The task suite and the framework TOMLs shipped with the package."""

from pathlib import Path

import pytest
from ate_bench.frameworks import load_framework
from ate_bench.tasks import load_category, load_tasks, select_tasks

FRAMEWORKS = Path(__file__).parents[1] / "frameworks"


def test_suite_has_12_qa_4_operate_4_feature_tasks():
    tasks = load_tasks()
    counts = {c: sum(t.category == c for t in tasks) for c in ("qa", "operate", "feature")}
    assert counts == {"qa": 12, "operate": 4, "feature": 4} and len({t.id for t in tasks}) == 20
    assert all(t.read_only == (t.category == "qa") for t in tasks)
    assert all("<final_answer>" in t.prompt for t in tasks if t.category == "qa")
    assert all(
        len(t.grading["rules"]) == 3 and t.grading["steps"] == 64 for t in tasks if t.category == "feature"
    )
    assert all("ATE_ARTIFACTS" in t.prompt for t in tasks if t.category != "qa")


def test_select_by_id_prefix_and_category():
    tasks = load_tasks()
    assert [t.id for t in select_tasks(tasks, ["op-03", "nf-03-moba"])] == [
        "op-03-routing-trace",
        "nf-03-moba",
    ]
    assert len(select_tasks(tasks, ["feature", "nf-01"])) == 4
    assert select_tasks(tasks, []) == tasks
    with pytest.raises(ValueError, match="got 'qa-99'"):
        select_tasks(tasks, ["qa-99"])


def test_unknown_task_keys_are_errors(tmp_path):
    bad = tmp_path / "qa.toml"
    bad.write_text(
        'category = "qa"\nread_only = true\ntime_limit_s = 1\npreamble = "p"\n'
        '[[task]]\nid = "x"\ntitle = "t"\nprompt = "q"\nanswer = "leaked"\n[task.grading]\nkind = "qa"\n'
    )
    with pytest.raises(ValueError, match=r"unknown \['answer'\]"):
        load_category(bad)


@pytest.mark.parametrize("name", ["pith", "megatron-lm", "torchtitan"])
def test_shipped_framework_tomls_load(name):
    framework = load_framework(FRAMEWORKS / f"{name}.toml")
    assert framework.name == name and framework.commit and framework.launch_notes.strip()
    assert {"train_data", "eval_script"} <= set(framework.staged_data)
    assert "<" not in framework.launch_notes and "TODO" not in framework.launch_notes


def test_pith_toml_points_at_this_repository():
    assert (load_framework(FRAMEWORKS / "pith.toml").path / "packages" / "ate-bench").is_dir()


def test_framework_toml_errors(tmp_path):
    toml = tmp_path / "f.toml"
    toml.write_text('name = "x"\npath = "."\ncommit = ""\nlaunch_notes = "n"\n')
    with pytest.raises(ValueError, match="non-empty string for 'commit'"):
        load_framework(toml)
    toml.write_text('name = "x"\npath = "."\ncommit = "HEAD"\nlaunch_notes = "n"\ncheckout = "y"\n')
    with pytest.raises(ValueError, match=r"unknown \['checkout'\]"):
        load_framework(toml)
