"""`ate-bench inspect` on a small synthetic tree whose patterns and sizes are known."""

import json
import subprocess
from pathlib import Path

import pytest
from ate_bench.cli import main
from ate_bench.inspect_repo import format_table, inspect_tree, readme_table

INDIRECT = """\
import importlib
MODEL_REGISTRY = {}


def register_model(name):
    def wrap(cls):
        MODEL_REGISTRY[name] = cls
        return cls
    return wrap


@register_model("llama")
class Llama:
    pass


def build(name, cfg):
    cls = MODEL_REGISTRY[name]
    act = getattr(cfg, name)
    fixed = getattr(cfg, "hidden", 1)
    mod = importlib.import_module(name)
    other = __import__(name)
    g = globals()[name]
    return cls, act, fixed, mod, other, g
"""

DIRECT = """\
import torch
from pkg import a, b

MODELS = {"a": a.Model, "b": b.Model}
SIZES = {"small": 1, "large": 2}


def pick(name):
    return MODELS[name]


def fixed(name):
    return MODELS["a"], SIZES[name]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(1))
"""

KERNEL_CU = "__global__ void k(float* x) {\n  x[0] = 1.0f;\n}\n"


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "indirect.py").write_text(INDIRECT)
    (tmp_path / "pkg" / "direct.py").write_text(DIRECT)
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "kernel.cu").write_text(KERNEL_CU)
    (tmp_path / "README.md").write_text("# demo\n\nsome words\n")
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "site.py").write_text("x = getattr(a, b)\n" * 50)  # never counted
    (tmp_path / "skills" / "profile").mkdir(parents=True)
    (tmp_path / "skills" / "profile" / "SKILL.md").write_text("# profile\n")
    (tmp_path / "skills" / "notes").mkdir()
    return tmp_path


def test_patterns_found_with_locations(tree):
    report = inspect_tree(tree)
    assert report["patterns"] == {
        "registry": ["pkg/indirect.py:2"],
        "registering_decorator": ["pkg/indirect.py:12"],
        "string_keyed_lookup": ["pkg/direct.py:9", "pkg/indirect.py:18", "pkg/indirect.py:23"],
        "getattr_by_name": ["pkg/indirect.py:19"],
        "dynamic_import": ["pkg/indirect.py:21", "pkg/indirect.py:22"],
    }
    assert report["unparsed_python"] == ["pkg/broken.py"]


def test_sizes_tokens_share_and_skills(tree):
    report = inspect_tree(tree)
    python_lines = sum(
        1 for src in (INDIRECT, DIRECT, "def (:\n") for line in src.splitlines() if line.strip()
    )
    assert report["languages"]["Python"] == {"files": 3, "lines": python_lines, "source": True}
    assert report["languages"]["CUDA"]["lines"] == 3
    assert report["languages"]["Markdown"] == {"files": 2, "lines": 3, "source": False}
    assert report["source_lines"] == python_lines + 3
    chars = len(INDIRECT) + len(DIRECT) + len("def (:\n") + len(KERNEL_CU)
    assert report["source_chars"] == chars and report["approx_tokens"] == chars // 4
    assert report["fits_200k"] and report["fits_1m"]
    assert report["non_python_share"] == pytest.approx(3 / (python_lines + 3))
    assert report["skills"] == ["profile"]


def test_framework_sources_and_their_budget(tree, capsys):
    """Without settings the framework is every source file outside tests, skills...; pyproject's
    [tool.ate-bench] names its directories and a budget, which --check-budget enforces."""
    (tree / "tests").mkdir()
    (tree / "tests" / "test_x.py").write_text("x = 1\n")
    f = inspect_tree(tree)["framework"]
    chars = len(INDIRECT) + len(DIRECT) + len("def (:\n") + len(KERNEL_CU)
    lines = sum(src.count("\n") for src in (INDIRECT, DIRECT, "def (:\n", KERNEL_CU))
    assert (f["lines"], f["characters"], f["budget"], f["within_budget"]) == (lines, chars, None, None)
    assert main(["inspect", str(tree), "--check-budget"]) == 1  # no budget stated
    settings = '[tool.ate-bench]\nframework = ["pkg"]\nbudget = {{lines = {}, characters = 100000}}\n'
    py_lines = lines - 3
    for limit, within in ((py_lines, True), (py_lines - 1, False)):
        (tree / "pyproject.toml").write_text(settings.format(limit))
        f = inspect_tree(tree)["framework"]
        assert (f["lines"], f["directories"], f["within_budget"]) == (py_lines, ["pkg"], within)
        assert main(["inspect", str(tree), "--check-budget"]) == (0 if within else 1)
        assert ("within" if within else "OVER") in capsys.readouterr().out


def test_git_checkout_lists_only_files_git_knows(tree):
    (tree / ".gitignore").write_text("ignored/\n")
    (tree / "ignored").mkdir()
    (tree / "ignored" / "big.py").write_text("x = 1\n" * 100)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    report = inspect_tree(tree)
    assert report["languages"]["Python"]["files"] == 3
    assert inspect_tree(tree / "ignored")["source_lines"] == 100  # a directory git ignores is walked


def test_cli_table_and_json(tree, capsys):
    assert main(["inspect", str(tree)]) == 0
    table = capsys.readouterr().out
    assert "dynamic_import" in table and "pkg/indirect.py:21" in table and "fits a 200K context" in table
    assert main(["inspect", str(tree), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pattern_counts"]["string_keyed_lookup"] == 3
    assert main(["inspect", str(tree / "nope")]) == 2


def test_readme_inspect_table_is_current():
    """The package README's inspect table is this repository's: refresh it with
    `uv run ate-bench inspect . --readme packages/ate-bench/README.md` at the repository root."""
    root = Path(__file__).resolve().parents[3]
    report = inspect_tree(root)
    report["path"] = "."
    assert readme_table(root / "packages" / "ate-bench" / "README.md") == format_table(report), (
        "stale: run `uv run ate-bench inspect . --readme packages/ate-bench/README.md` at the repository root"
    )


def test_readme_block_is_written_and_checked(tree, capsys):
    readme = tree / "README.md"
    readme.write_text("# demo\n\n<!-- inspect -->\n```text\nold\n```\nafter\n")
    assert main(["inspect", str(tree), "--readme", str(readme), "--check"]) == 1
    assert main(["inspect", str(tree), "--readme", str(readme)]) == 0
    assert readme_table(readme).startswith(f"ate-bench inspect {tree}\n") and readme.read_text().endswith(
        "after\n"
    )
    assert main(["inspect", str(tree), "--readme", str(readme), "--check"]) == 0
    assert "current" in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(ValueError, match="inspect -->"):
        readme_table(tree / "pkg" / "direct.py")
