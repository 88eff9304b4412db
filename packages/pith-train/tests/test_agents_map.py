"""AGENTS.md's change map names only files and tests that exist: every backticked repository path in
its table (a `<placeholder>` path: its directory), and every `file::test` (or `::test`, of the file
named before it in the same cell) a test function in that file."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_path_and_test_in_the_change_map_exists():
    text = (ROOT / "AGENTS.md").read_text()
    table = text[text.index("## Change map") :].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(rows) >= 10, "the change map's header and its nine kinds of change"
    checked = 0
    for cell in (c for row in rows[1:] for c in row.split(" | ")):
        last = None
        for ref in re.findall(r"`([^`]+)`", cell):
            path, _, test = ref.partition("::")
            if "/" not in path and not test:
                continue  # a name (MODELS, validate), not a path
            if path:
                last = ROOT / path
                target = last.parent if "<" in path else last
                assert target.exists(), f"AGENTS.md names {path}, which does not exist"
            if test:
                assert last is not None and re.search(rf"^def {test}\(", last.read_text(), re.M), (
                    f"AGENTS.md names {ref}: no test {test} in {last}"
                )
            checked += 1
    assert checked >= 40, checked
