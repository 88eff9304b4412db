"""Which commits in a range change executable code in the framework packages.

    python packages/pith-train/benchmarks/code_changes.py A..B [PATH ...]
    python packages/pith-train/benchmarks/code_changes.py --net A B [PATH ...]

For each commit (oldest first) touching Python files under PATHs (default: the four
framework packages' src), every changed file is parsed at the parent and at the commit,
docstrings dropped, and each top-level statement (imports aside) dumped from its AST.
A commit whose dumps are equal as a multiset (over all its changed files) only edits
docstrings, comments or formatting, or moves code between files: it is listed as such
and dropped from the candidates. Otherwise it prints the definitions whose code changed, and marks
the commit "off the step" when they all lie outside what `pith-train bench` runs (pith-train files
other than STEP_FILES). --net: the definitions whose code differs between the trees of A and B,
by name wherever they live (code moved between files drops out), with the files holding them.
"""

import ast
import collections
import subprocess
import sys

DEFAULT_PATHS = [f"packages/pith-{p}/src" for p in ("ops", "engine", "models", "train")]
# What bench runs of pith-train: the workload's config, the model and optimizer it builds, the loop.
STEP_FILES = ("pith_train/bench.py", "pith_train/train.py", "pith_train/optim.py", "pith_train/config.py")


def git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def source(commit, path):
    try:
        return git("show", f"{commit}:{path}")
    except subprocess.CalledProcessError:
        return ""  # absent at that commit


def strip_docstrings(tree):
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def definitions(text):
    """Counter of (name, AST dump) of each top-level non-import statement, docstrings dropped."""
    out = collections.Counter()
    for node in strip_docstrings(ast.parse(text)).body if text else []:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            out[(getattr(node, "name", None) or type(node).__name__, ast.dump(node))] += 1
    return out


def tree_definitions(commit, paths):
    out = collections.defaultdict(lambda: (collections.Counter(), set()))
    for f in git("ls-tree", "-r", "--name-only", commit, "--", *paths).split():
        if f.endswith(".py"):
            for (name, dump), n in definitions(source(commit, f)).items():
                out[name][0][dump] += n
                out[name][1].add(f.split("/src/")[-1])
    return out


def net(a, b, paths):
    A, B = tree_definitions(a, paths), tree_definitions(b, paths)
    for name in sorted(set(A) | set(B)):
        if A[name][0] != B[name][0]:
            print(f"{name}: {' '.join(sorted(A[name][1])) or '-'} -> {' '.join(sorted(B[name][1])) or '-'}")


def main():
    if sys.argv[1] == "--net":
        return net(sys.argv[2], sys.argv[3], sys.argv[4:] or DEFAULT_PATHS)
    rng, paths = sys.argv[1], sys.argv[2:] or DEFAULT_PATHS
    commits = git("rev-list", "--reverse", rng, "--", *paths).split()
    for commit in commits:
        files = [
            f
            for f in git("diff", "--name-only", f"{commit}^", commit, "--", *paths).split()
            if f.endswith(".py")
        ]
        before, after = collections.Counter(), collections.Counter()
        where = collections.defaultdict(set)  # (name, dump) -> the files holding it
        for f in files:
            for side, rev in ((before, f"{commit}^"), (after, commit)):
                found = definitions(source(rev, f))
                side += found
                for key in found:
                    where[key].add(f.split("/src/")[-1])
        subject = git("log", "-1", "--format=%h %s", commit).strip()[:110]
        if before == after:
            print(f"  docs/move only  {subject}")
            continue
        changed = {(f, key[0]) for key in (before - after) + (after - before) for f in where[key]}
        on_step = any(not f.startswith("pith_train/") or f in STEP_FILES for f, _ in changed)
        print(f"{'* CODE          ' if on_step else '  off the step  '} {subject}")
        print(f"      changed: {' '.join(sorted(f'{f}:{n}' for f, n in changed))}")


if __name__ == "__main__":
    main()
