"""`ate-bench inspect PATH`: the agent-native principles, measured on any checkout.

- Lines of code by language: non-blank lines of the files git knows (tracked plus untracked,
  not ignored) or, outside git, of every file; either way not under a hidden, build or venv
  directory.
- Tokens to read all source: characters of the code files divided by 4 (a common rule of thumb
  for English-heavy code with BPE tokenizers; real counts vary by roughly +-20%), and whether
  that fits a 200K and a 1M token context. Documentation and config files are listed by language
  but not counted as source.
- Implicit indirection in Python files (found with the ast module, each with file:line):
    registry           a name containing "registry" assigned, a *Registry class, or a
                       register(...) / x.register(...) call
    registering_decorator  a decorator whose name contains "register"
    string_keyed_lookup    globals()/locals()/vars()/sys.modules or a registry, or a module-level
                       dict literal mapping strings to classes/functions, indexed (or .get) by a
                       non-literal key
    getattr_by_name    getattr(obj, name) with a non-literal name
    dynamic_import     importlib.import_module(...) or __import__(...)
- Share of non-Python source lines, and the skills shipped (skills/*/SKILL.md).
- The framework's own sources, apart from its tests, benchmarks, examples, docs, scripts and skills:
  all lines (as `wc -l` counts them), characters and tokens, against a budget when the checkout states
  one. A checkout names its framework directories and budget in pyproject.toml:
      [tool.ate-bench]
      framework = ["packages/a/src", "packages/b/src"]
      budget = {lines = 11000, characters = 480000}
  without it, every source file outside those other directories counts, and there is no budget.
"""

import ast
import os
import re
import subprocess
import tomllib
from pathlib import Path

CHARS_PER_TOKEN = 4
CODE_LANGUAGES = {
    ".py": "Python", ".pyi": "Python", ".pyx": "Cython", ".pxd": "Cython", ".c": "C", ".h": "C/C++ header",
    ".cc": "C++", ".cpp": "C++", ".cxx": "C++", ".hpp": "C++", ".cu": "CUDA", ".cuh": "CUDA",
    ".sh": "Shell", ".bash": "Shell", ".rs": "Rust", ".go": "Go", ".js": "JavaScript",
    ".ts": "TypeScript", ".java": "Java", ".lua": "Lua", ".jl": "Julia", ".cmake": "CMake",
}  # fmt: skip
OTHER_LANGUAGES = {
    ".md": "Markdown", ".rst": "reStructuredText", ".txt": "Text", ".toml": "TOML", ".yaml": "YAML",
    ".yml": "YAML", ".json": "JSON", ".cfg": "INI", ".ini": "INI",
}  # fmt: skip
SKIP_DIRS = {"node_modules", "__pycache__", "build", "dist", "venv", "site-packages"}
MAX_FILE_BYTES = 2_000_000  # larger files are data, not code anyone reads
PATTERN_KINDS = (
    "registry",
    "registering_decorator",
    "string_keyed_lookup",
    "getattr_by_name",
    "dynamic_import",
)
CONTEXTS = {"fits_200k": 200_000, "fits_1m": 1_000_000}
NOT_FRAMEWORK = {"tests", "test", "benchmarks", "examples", "docs", "scripts", "skills"}


def skipped(directories) -> bool:
    return any(d.startswith(".") or d in SKIP_DIRS for d in directories)


def list_files(root: Path) -> list[Path]:
    done = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
    )
    names = sorted({n for n in done.stdout.decode(errors="replace").split("\0") if n})
    if done.returncode == 0 and names:  # else not a checkout, or a directory git ignores: walk it
        return [root / n for n in names if not skipped(Path(n).parts[:-1]) and (root / n).is_file()]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not skipped([d]))
        files += [Path(folder) / n for n in sorted(names)]
    return files


def dotted(node: ast.AST) -> str:
    """'a.b.c' for a Name/Attribute chain, the callee's name for a call, '' otherwise."""
    if isinstance(node, ast.Call):
        return dotted(node.func)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def code_dicts(tree: ast.Module) -> set[str]:
    """Module-level names bound to a dict literal mapping string constants to names/attributes."""
    found = set()
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if not isinstance(value, ast.Dict) or not value.keys:
            continue
        keys_are_strings = all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys)
        values_are_code = all(isinstance(v, ast.Name | ast.Attribute) for v in value.values)
        if keys_are_strings and values_are_code:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return found


def is_lookup_table(node: ast.AST, tables: set[str]) -> bool:
    name = dotted(node)
    if isinstance(node, ast.Call):
        return name in ("globals", "locals", "vars")
    return name == "sys.modules" or name in tables or "registry" in name.lower()


def is_module_api(name: str) -> bool:
    """torch.nn.Module's register_buffer / register_parameter / register_*_hook attach state to one
    object; they are not lookups by name."""
    return name in ("register_buffer", "register_parameter") or name.endswith("_hook")


def python_patterns(source: str) -> list[tuple[str, int]]:
    """(kind, line) of every implicit-indirection pattern in one Python file."""
    tree = ast.parse(source)
    tables = code_dicts(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found += [
                ("registering_decorator", d.lineno)
                for d in node.decorator_list
                if "register" in dotted(d).lower()
            ]
            if isinstance(node, ast.ClassDef) and "registry" in node.name.lower():
                found.append(("registry", node.lineno))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any("registry" in dotted(t).lower() for t in targets):
                found.append(("registry", node.lineno))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if is_lookup_table(node.value, tables) and not isinstance(node.slice, ast.Constant):
                found.append(("string_keyed_lookup", node.lineno))
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if name in ("importlib.import_module", "import_module", "__import__"):
                found.append(("dynamic_import", node.lineno))
            elif name == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                found.append(("getattr_by_name", node.lineno))
            elif last == "get" and isinstance(node.func, ast.Attribute) and node.args:
                if is_lookup_table(node.func.value, tables) and not isinstance(node.args[0], ast.Constant):
                    found.append(("string_keyed_lookup", node.lineno))
            elif (last == "register" or last.startswith("register_")) and not is_module_api(last):
                found.append(("registry", node.lineno))
    # A decorator call is also an ast.Call: keep the decorator reading of that line only.
    decorated = {line for kind, line in found if kind == "registering_decorator"}
    return sorted(
        {(k, n) for k, n in found if not (k == "registry" and n in decorated)}, key=lambda x: (x[1], x[0])
    )


def framework_settings(root: Path) -> tuple[list[str] | None, dict | None]:
    """pyproject.toml's [tool.ate-bench] framework directories and budget (None where absent)."""
    try:
        tool = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("ate-bench", {})
    except (OSError, tomllib.TOMLDecodeError):
        tool = {}
    return tool.get("framework"), tool.get("budget")


def in_framework(relative: str, dirs: list[str] | None) -> bool:
    parts = Path(relative).parts
    if dirs is not None:
        return any(relative.startswith(d.rstrip("/") + "/") for d in dirs)
    name = parts[-1]
    return not (NOT_FRAMEWORK & set(parts[:-1]) or name.startswith("test_") or name == "conftest.py")


def inspect_tree(path: Path) -> dict:
    root = Path(path).resolve()
    if not root.is_dir():
        raise ValueError(f"expected a directory to inspect, got {str(path)!r}")
    languages: dict[str, dict] = {}
    source_chars = source_lines = python_lines = 0
    framework_dirs, budget = framework_settings(root)
    framework = {"lines": 0, "characters": 0}
    patterns = {kind: [] for kind in PATTERN_KINDS}
    unparsed = []
    for file in list_files(root):
        suffix = file.suffix.lower()
        language = CODE_LANGUAGES.get(suffix) or OTHER_LANGUAGES.get(suffix)
        if language is None or file.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        lines = sum(1 for line in text.splitlines() if line.strip())
        entry = languages.setdefault(language, {"files": 0, "lines": 0, "source": suffix in CODE_LANGUAGES})
        entry["files"] += 1
        entry["lines"] += lines
        if suffix not in CODE_LANGUAGES:
            continue
        source_chars += len(text)
        source_lines += lines
        relative = file.relative_to(root).as_posix()
        if in_framework(relative, framework_dirs):
            framework["lines"] += text.count("\n")
            framework["characters"] += len(text)
        if language != "Python":
            continue
        python_lines += lines
        try:
            for kind, line in python_patterns(text):
                patterns[kind].append(f"{relative}:{line}")
        except (SyntaxError, ValueError):
            unparsed.append(relative)
    tokens = source_chars // CHARS_PER_TOKEN
    skills = sorted(p.parent.name for p in root.glob("skills/*/SKILL.md"))
    return {
        "path": str(path),
        "languages": dict(sorted(languages.items(), key=lambda kv: -kv[1]["lines"])),
        "source_lines": source_lines,
        "source_chars": source_chars,
        "approx_tokens": tokens,
        "token_estimate": f"source characters / {CHARS_PER_TOKEN} (approximate)",
        **{key: tokens <= limit for key, limit in CONTEXTS.items()},
        "non_python_share": (source_lines - python_lines) / source_lines if source_lines else 0.0,
        "pattern_counts": {kind: len(found) for kind, found in patterns.items()},
        "patterns": patterns,
        "unparsed_python": unparsed,
        "skills": skills,
        "framework": {
            **framework,
            "approx_tokens": framework["characters"] // CHARS_PER_TOKEN,
            "directories": framework_dirs,
            "budget": budget,
            "within_budget": None if budget is None else all(framework[k] <= v for k, v in budget.items()),
        },
    }


def format_table(report: dict, max_locations: int = 8) -> str:
    lines = [f"ate-bench inspect {report['path']}", "", f"{'language':<20}{'files':>8}{'lines':>10}  kind"]
    for language, entry in report["languages"].items():
        kind = "source" if entry["source"] else "docs/config"
        lines.append(f"{language:<20}{entry['files']:>8}{entry['lines']:>10}  {kind}")
    lines += [
        "",
        f"source lines (non-blank)      {report['source_lines']}",
        f"tokens to read all source     ~{report['approx_tokens']:,} ({report['token_estimate']})",
        f"fits a 200K context           {'yes' if report['fits_200k'] else 'no'}",
        f"fits a 1M context             {'yes' if report['fits_1m'] else 'no'}",
        f"non-Python share of source    {report['non_python_share'] * 100:.1f}%",
        f"skills shipped                {len(report['skills'])}"
        + (f" ({', '.join(report['skills'])})" if report["skills"] else ""),
        *framework_lines(report["framework"]),
        "",
        "implicit indirection (Python)",
    ]
    for kind, found in report["patterns"].items():
        shown = ", ".join(found[:max_locations]) + (
            f", ... (+{len(found) - max_locations})" if len(found) > max_locations else ""
        )
        lines.append(f"  {kind:<24}{len(found):>5}  {shown}")
    if report["unparsed_python"]:
        lines.append(f"  (not parsed: {', '.join(report['unparsed_python'])})")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def framework_lines(f: dict) -> list[str]:
    where = "pyproject [tool.ate-bench]" if f["directories"] is not None else "all but tests, benchmarks..."
    lines = [
        f"framework sources             {f['lines']:,} lines, {f['characters']:,} characters"
        f" (~{f['approx_tokens']:,} tokens; {where})"
    ]
    if f["budget"] is not None:
        limits = ", ".join(f"{v:,} {k}" for k, v in f["budget"].items())
        lines.append(f"framework budget              {limits}: {'within' if f['within_budget'] else 'OVER'}")
    return lines


README_BLOCK = re.compile(r"(<!-- inspect -->\n```text\n)(.*?)(```)", re.DOTALL)


def readme_table(readme: Path) -> str:
    """The inspect table between the README's `<!-- inspect -->` marker and the end of its code block."""
    found = README_BLOCK.search(Path(readme).read_text())
    if found is None:
        raise ValueError(f"expected a '<!-- inspect -->' marker followed by a ```text block in {readme}")
    return found.group(2)


def write_readme_table(readme: Path, table: str) -> bool:
    """Put `table` in the README's inspect block; True when that changed the file."""
    readme_table(readme)  # the marker must be there
    text = Path(readme).read_text()
    new = README_BLOCK.sub(lambda m: m.group(1) + table + m.group(3), text, count=1)
    Path(readme).write_text(new)
    return new != text
