"""Grading of one attempt.

- Q&A: the answer inside <final_answer> tags must cite path:LINE (or path:START-END); every
  citation is checked against the attempt's worktree: the file exists there, the lines exist,
  and the cited lines or their neighbours (WINDOW lines either side) contain an identifier the
  answer names. A missing answer, no citation or a bad citation fails the attempt; otherwise it
  awaits the human grader (verdict NEEDS_HUMAN; `ate-bench report` exports the sheet).
- Operate: programmatic checks of the artifacts the agent left in ate-artifacts/.
- New feature: the loss-curve check, then a judge command given the task's rules and the
  attempt's diff; without a judge the verdict is NEEDS_JUDGE.
"""

import csv
import io
import json
import math
import re
import shlex
import subprocess
from pathlib import Path

from ate_bench.npz import load_npz

WINDOW = 2  # neighbouring lines searched either side of a cited line
MAX_SPAN = 40  # a cited span wider than this proves nothing about where the code is
CITATION = re.compile(
    r"(?<![\w.-])(/?(?:[\w.-]+/)*[\w.-]*\w\.[A-Za-z0-9_]+):L?(\d+)(?:\s*[-\u2013]\s*L?(\d+))?(?![\w])"
)
FINAL_ANSWER = re.compile(r"<final_answer>(.*?)(?:</final_answer>|\Z)", re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Words too common in code to show that a citation points at what the answer describes.
STOPWORDS = {
    "self", "cls", "def", "class", "return", "import", "from", "none", "true", "false", "torch",
    "the", "and", "for", "with", "not", "int", "str", "float", "bool", "dict", "list", "tuple",
    "args", "kwargs", "if", "else", "elif", "in", "is", "or", "as", "py", "nn",
}  # fmt: skip
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|infinity)"
# A step and its loss as training frameworks print them: `step 5 | loss 7.91`, `step=5 loss=7.91`,
# `step:  5  loss:  9.80` (TorchTitan), `iteration 5/ 100 | lm loss: 7.1E+00` (Megatron), a tqdm bar
# `5/10 [00:02<00:01, 2.1step/s, loss=7.91]` (Pith, PithTrain), or a JSON line {"step": 5, "loss": 7.91}.
STEP_TEXT = re.compile(r"\b(?:step|iteration|iter)\s*[:=#]?\s*(\d+)(?![\d.])", re.IGNORECASE)
LOSS_TEXT = re.compile(rf"\bloss\s*[:=]?\s*({NUMBER})(?![\w.])", re.IGNORECASE)
TQDM_LOSS = re.compile(rf"(?<![\d.])(\d+)/\d+\s*\[[^\]]*?\bloss=({NUMBER})", re.IGNORECASE)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # TorchTitan colours its log lines
JSON_STEP_KEYS, JSON_LOSS_KEYS = ("step", "iteration", "iter"), ("loss", "train_loss", "lm_loss")
LOG_FORMATS = (
    "'step N ... loss X', 'step=N loss=X', 'iteration N/M | lm loss: X', a tqdm bar 'N/M [... loss=X]' "
    'or a JSON line {"step": N, "loss": X}'
)
NPZ_NAME = re.compile(r"step-\d{8}\.npz")
KERNEL_HEADER = ["kernel_name", "total_time_ms", "instances", "mean_time_ms"]
MAX_NEW_FILE_BYTES = 512 * 1024
MAX_DIFF_CHARS = 400_000  # ~100K tokens: what a judge can be given in one prompt
RULE_VERDICT = re.compile(r"RULE\s*(\d+)\s*:\s*(PASS|FAIL)", re.IGNORECASE)


def extract_final_answer(text: str | None) -> str | None:
    if not text:
        return None
    matches = FINAL_ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def answer_identifiers(answer: str) -> set[str]:
    """Identifiers the answer names: words in `code spans`, plus bare words that look like code
    (snake_case, CamelCase with an inner capital, or a call `name(`). Citations are removed first
    so a file name does not count as a named identifier."""
    text = CITATION.sub(" ", answer)
    names = {w for span in CODE_SPAN.findall(text) for w in WORD.findall(CITATION.sub(" ", span))}
    prose = CODE_SPAN.sub(" ", text)
    for match in WORD.finditer(prose):
        word = match.group()
        follows = prose[match.end() : match.end() + 1]
        if "_" in word.strip("_") or re.search(r"[a-z][A-Z]", word) or follows == "(":
            names.add(word)
    return {n for n in names if len(n) >= 3 and n.lower() not in STOPWORDS}


def check_citation(path_text: str, start: int, end: int, worktree: Path, names: set[str]) -> dict:
    result = {"citation": f"{path_text}:{start}" + (f"-{end}" if end != start else ""), "ok": False}
    root = worktree.resolve()
    candidate = Path(path_text)
    if candidate.is_absolute():
        try:
            candidate = candidate.resolve().relative_to(root)
        except ValueError:
            return result | {"reason": "absolute path outside the attempt's worktree"}
    file = (root / candidate).resolve()
    if not file.is_relative_to(root):
        return result | {"reason": "path leaves the worktree"}
    if not file.is_file():
        return result | {"reason": "no such file in the worktree"}
    lines = file.read_text(errors="replace").splitlines()
    if not 1 <= start <= end <= len(lines):
        return result | {"reason": f"line out of range (file has {len(lines)} lines)"}
    if end - start > MAX_SPAN:
        return result | {"reason": f"span wider than {MAX_SPAN} lines"}
    nearby = "\n".join(lines[max(0, start - 1 - WINDOW) : end + WINDOW])
    found = sorted(n for n in names if re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", nearby))
    if not found:
        return result | {"reason": "no identifier named in the answer at or near the cited lines"}
    return result | {"ok": True, "matched": found[:5]}


def check_citations(answer: str, worktree: Path) -> dict:
    """Every path:line citation of the answer checked against the worktree."""
    names = answer_identifiers(answer)
    results = []
    for match in CITATION.finditer(answer):
        start = int(match.group(2))
        end = int(match.group(3)) if match.group(3) else start
        results.append(check_citation(match.group(1), start, end, Path(worktree), names))
    return {
        "citations": results,
        "citations_total": len(results),
        "citations_valid": sum(r["ok"] for r in results),
        "citations_ok": bool(results) and all(r["ok"] for r in results),
    }


def grade_qa(final_text: str | None, worktree: Path) -> dict:
    answer = extract_final_answer(final_text)
    if answer is None:
        return {"verdict": "FAIL", "reason": "no <final_answer> in the agent's final message", "answer": None}
    checked = check_citations(answer, worktree)
    if checked["citations_total"] == 0:
        verdict, reason = "FAIL", "the answer cites no path:line"
    elif not checked["citations_ok"]:
        bad = checked["citations_total"] - checked["citations_valid"]
        verdict, reason = "FAIL", f"{bad} of {checked['citations_total']} citations do not check out"
    else:
        verdict, reason = "NEEDS_HUMAN", "all citations check out; correctness is for the human grader"
    return {"verdict": verdict, "reason": reason, "answer": answer} | checked


def is_finite_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def json_step_loss(line: str) -> tuple[int, str] | None:
    """(step, loss) of a JSON-object log line naming both, else None."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    step = next((record[k] for k in JSON_STEP_KEYS if k in record), None)
    loss = next((record[k] for k in JSON_LOSS_KEYS if k in record), None)
    if isinstance(step, bool) or not isinstance(step, int) or isinstance(loss, bool):
        return None
    return (step, str(float(loss))) if isinstance(loss, int | float) else None


def step_losses(text: str) -> dict[int, str]:
    """Step -> the last loss the log reports for it, in any of the LOG_FORMATS. Carriage returns
    split lines too (a tqdm bar redraws itself with them); the last report wins because a bar is
    redrawn at step N with step N-1's postfix before the trainer sets step N's."""
    found = {}
    for line in re.split(r"[\r\n]+", ANSI_ESCAPE.sub("", text)):
        line = line.strip()
        if line.startswith("{") and (pair := json_step_loss(line)):
            found[pair[0]] = pair[1]
            continue
        step, loss = STEP_TEXT.search(line), LOSS_TEXT.search(line)
        if step and loss:
            found[int(step.group(1))] = loss.group(1)
        found |= {int(n): x for n, x in TQDM_LOSS.findall(line)}
    return found


def steps_seen(found: dict[int, str]) -> str:
    if not found:
        return "no step with a loss"
    return f"losses for {len(found)} step(s), {min(found)} to {max(found)}"


def check_smoke_log(spec: dict, artifacts: Path) -> tuple[bool, str]:
    """smoke.log (or, failing that, a JSONL metrics file beside it) reports the step's finite loss."""
    name, step = spec["file"], int(spec["step"])
    log = artifacts / name
    if not log.is_file():
        return False, f"{name} not found in {artifacts}"
    places = [log, *sorted(artifacts.glob("*.jsonl"))]
    seen = []
    for path in places:
        found = step_losses(path.read_text(errors="replace"))
        if step in found:
            if not is_finite_number(found[step]):
                return False, f"{path.name}: the loss at step {step} is not finite: {found[step]}"
            return True, f"{path.name}: step {step} loss {found[step]}"
        seen.append(f"{path.name}: {steps_seen(found)}")
    return False, (
        f"no report of step {step} with a loss in {', '.join(p.name for p in places)} (in {artifacts}); "
        f"looked for {LOG_FORMATS}; found {'; '.join(seen)}"
    )


def check_train_eval(spec: dict, artifacts: Path) -> tuple[bool, str]:
    export = artifacts / spec["export_dir"]
    if not (export / "config.json").is_file():
        return False, f"{spec['export_dir']}/config.json not found in {artifacts}"
    try:
        json.loads((export / "config.json").read_text())
    except json.JSONDecodeError as error:
        return False, f"{spec['export_dir']}/config.json is not JSON: {error}"
    weights = [*export.glob("*.safetensors"), *export.glob("pytorch_model*.bin")]
    if not any(w.stat().st_size > 0 for w in weights):
        return False, f"no non-empty *.safetensors or pytorch_model*.bin in {spec['export_dir']}"
    eval_file = artifacts / spec["eval_file"]
    try:
        score = json.loads(eval_file.read_text())["score"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        return False, f"{spec['eval_file']} has no readable 'score': {error!r}"
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        return False, f"{spec['eval_file']}: the score is not a finite number: {score!r}"
    return True, f"export with {len(weights)} weight file(s), eval score {score}"


def check_routing_file(path: Path, tokens: int) -> str | None:
    """None when the file matches the schema, else what is wrong."""
    try:
        arrays = load_npz(path)
    except ValueError as error:
        return str(error)
    if set(arrays) != {"expert_ids", "gate_weights", "num_experts"}:
        return f"expected arrays expert_ids, gate_weights, num_experts, got {sorted(arrays)}"
    ids, weights, experts = arrays["expert_ids"], arrays["gate_weights"], arrays["num_experts"]
    if ids.kind not in "iu" or weights.kind != "f" or experts.kind not in "iu" or experts.size != 1:
        return "expected integer expert_ids, float gate_weights and one integer num_experts"
    if len(ids.shape) != 3 or ids.shape != weights.shape or ids.shape[1] != tokens or ids.shape[2] < 1:
        shapes = f"{ids.shape} and {weights.shape}"
        return f"expected expert_ids and gate_weights of shape [L, {tokens}, k], got {shapes}"
    num_experts = experts.values[0]
    if num_experts < 1 or not all(0 <= i < num_experts for i in ids.values):
        return f"expert ids outside [0, {num_experts})"
    if not all(math.isfinite(w) and w >= 0 for w in weights.values):
        return "gate weights must be finite and non-negative"
    tolerance = 1e-2 if weights.itemsize == 2 else 1e-3  # fp16 rounding of k summands
    worst = max(abs(sum(row) - 1.0) for row in weights.rows())
    if worst > tolerance:
        return f"gate weights of a token sum to 1 +- {worst:.3g} (tolerance {tolerance})"
    return None


def check_routing_trace(spec: dict, artifacts: Path) -> tuple[bool, str]:
    trace_dir = artifacts / spec["dir"]
    files = (
        sorted(p for p in trace_dir.glob("*.npz") if NPZ_NAME.fullmatch(p.name)) if trace_dir.is_dir() else []
    )
    if not files:
        return False, f"no step-XXXXXXXX.npz file in {trace_dir}"
    for file in files:
        problem = check_routing_file(file, int(spec["tokens"]))
        if problem:
            return False, f"{spec['dir']}/{file.name}: {problem}"
    return True, f"{len(files)} trace file(s) match the schema"


def check_top_kernels(spec: dict, artifacts: Path) -> tuple[bool, str]:
    table = artifacts / spec["file"]
    if not table.is_file():
        return False, f"{spec['file']} not found in {artifacts}"
    name = spec["file"]
    rows = [r for r in csv.reader(io.StringIO(table.read_text(encoding="utf-8-sig"))) if r]
    if not rows or [c.strip() for c in rows[0]] != KERNEL_HEADER:
        got = ",".join(rows[0]) if rows else "nothing"
        return False, f"{name}: expected the header {','.join(KERNEL_HEADER)}, got {got}"
    if len(rows) != 4:
        return False, f"{name}: expected exactly 3 kernel rows, got {len(rows) - 1}"
    totals = []
    for row in rows[1:]:
        if len(row) != 4 or not row[0].strip():
            return False, f"{name}: expected 4 fields with a kernel name, got {row}"
        try:
            total, instances, mean = float(row[1]), int(row[2]), float(row[3])
        except ValueError:
            return False, f"{name}: expected numbers (instances an integer) in {row}"
        if not (math.isfinite(total) and math.isfinite(mean) and total > 0 and mean > 0 and instances >= 1):
            return False, f"{name}: expected positive finite times and instances >= 1 in {row}"
        if not math.isclose(mean, total / instances, rel_tol=0.01, abs_tol=1e-3):
            return (
                False,
                f"{name}: mean_time_ms {mean} is not total_time_ms / instances = {total / instances:.4g}",
            )
        totals.append(total)
    if totals != sorted(totals, reverse=True):
        return False, f"{name}: rows are not ordered heaviest first: {totals}"
    prefix = spec["profile_prefix"]
    profiles = [p for p in artifacts.iterdir() if p.name.startswith(prefix) and p.stat().st_size > 0]
    if not profiles:
        return False, f"no non-empty profile file ({prefix}*) in {artifacts}"
    return True, f"3 kernels, heaviest {rows[1][0].strip()!r} ({totals[0]} ms); profile {profiles[0].name}"


def check_loss_curve(spec: dict, artifacts: Path) -> tuple[bool, str]:
    """`steps` distinct steps, every loss finite, and the mean over the last eighth of the steps
    below the mean over the first eighth (a single noisy step must not decide)."""
    steps = int(spec["steps"])
    path = artifacts / spec["loss_file"]
    if not path.is_file():
        return False, f"{spec['loss_file']} not found"
    by_step = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = float(record["loss"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            return False, f"line {number} of {spec['loss_file']} is not {{'step': N, 'loss': X}}"
    if len(by_step) < steps:
        return False, f"expected {steps} steps, got {len(by_step)}"
    losses = [by_step[s] for s in sorted(by_step)][:steps]
    if not all(math.isfinite(x) for x in losses):
        return False, "a loss is not finite"
    window = max(1, steps // 8)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    if not last < first:
        return (
            False,
            f"loss does not decrease: first-{window} mean {first:.4g}, last-{window} mean {last:.4g}",
        )
    return True, f"loss {first:.4g} -> {last:.4g} over {steps} steps"


ARTIFACT_CHECKS = {
    "smoke_log": check_smoke_log,
    "train_eval": check_train_eval,
    "routing_trace": check_routing_trace,
    "top_kernels": check_top_kernels,
}


def attempt_diff(worktree: Path, base_commit: str) -> str:
    """What the agent changed against the pinned commit: tracked files and new files up to
    MAX_NEW_FILE_BYTES (checkpoints and logs an agent leaves lying around are named, not shown);
    artifacts excluded; cut at MAX_DIFF_CHARS."""
    git = ["git", "-C", str(worktree)]
    listed = subprocess.run(
        [*git, "ls-files", "-z", "--others", "--exclude-standard"], check=True, capture_output=True
    )
    new_files = [
        n
        for n in listed.stdout.decode(errors="replace").split("\0")
        if n and not n.startswith("ate-artifacts/")
    ]
    small = [n for n in new_files if (worktree / n).lstat().st_size <= MAX_NEW_FILE_BYTES]
    if small:  # intent-to-add, so `git diff` shows them as new files without staging their content
        names = "\0".join(small).encode()
        add = [*git, "add", "-N", "--pathspec-from-file=-", "--pathspec-file-nul"]
        subprocess.run(add, input=names, check=True, capture_output=True)
    diff = subprocess.run(
        [*git, "diff", base_commit, "--", ".", ":(exclude)ate-artifacts"], check=True, capture_output=True
    ).stdout.decode(errors="replace")
    if len(diff) > MAX_DIFF_CHARS:
        diff = diff[:MAX_DIFF_CHARS] + f"\n[diff cut at {MAX_DIFF_CHARS} characters]\n"
    large = sorted(set(new_files) - set(small))
    return diff + "".join(f"\n[new file not shown, over {MAX_NEW_FILE_BYTES} bytes: {n}]" for n in large)


def judge_prompt(title: str, rules: list[str], diff: str) -> str:
    listed = "\n".join(f"RULE {i}: {rule}" for i, rule in enumerate(rules, 1))
    return (
        f"You are judging whether a code change implements '{title}' in a training framework.\n"
        "Decide each rule below from the diff alone. Answer with one line per rule, exactly\n"
        "'RULE <n>: PASS' or 'RULE <n>: FAIL', each followed by a one-sentence reason.\n\n"
        f"{listed}\n\nThe diff:\n```diff\n{diff}\n```\n"
    )


def run_judge(command: str, prompt_file: Path, worktree: Path, n_rules: int, timeout_s: float) -> dict:
    """Run the judge (a shell command template with {prompt_file} and {worktree}) and read its
    RULE n: PASS|FAIL lines."""
    shell = command.format(prompt_file=shlex.quote(str(prompt_file)), worktree=shlex.quote(str(worktree)))
    try:
        done = subprocess.run(
            shell, shell=True, capture_output=True, text=True, timeout=timeout_s, cwd=prompt_file.parent
        )
    except subprocess.TimeoutExpired:
        return {"rules": {}, "ok": None, "error": f"judge timed out after {timeout_s}s"}
    (prompt_file.parent / "judge-output.txt").write_text(done.stdout + done.stderr)
    verdicts = {int(n): v.upper() == "PASS" for n, v in RULE_VERDICT.findall(done.stdout)}
    if set(verdicts) != set(range(1, n_rules + 1)):
        return {"rules": verdicts, "ok": None, "error": f"judge gave verdicts for rules {sorted(verdicts)}"}
    return {"rules": verdicts, "ok": all(verdicts.values()), "error": None}


def grade_feature(task, worktree: Path, artifacts: Path, attempt_dir: Path, base_commit: str, judge) -> dict:
    loss_ok, loss_detail = check_loss_curve(task.grading, artifacts)
    rules = task.grading["rules"]
    prompt_file = attempt_dir / "judge-prompt.md"
    prompt_file.write_text(judge_prompt(task.title, rules, attempt_diff(worktree, base_commit)))
    judged = run_judge(judge, prompt_file, worktree, len(rules), 1800) if judge else None
    if not loss_ok or (judged and judged["ok"] is False):
        verdict = "FAIL"
    elif judged is None or judged["ok"] is None:
        verdict = "NEEDS_JUDGE"
    else:
        verdict = "PASS"
    return {"verdict": verdict, "loss_curve": {"ok": loss_ok, "detail": loss_detail}, "judge": judged}


def grade_attempt(
    task, worktree: Path, final_text: str | None, attempt_dir: Path, base_commit: str, judge=None
):
    """The grade record of one attempt (a dict with at least `verdict`)."""
    artifacts = Path(worktree) / "ate-artifacts"
    kind = task.grading["kind"]
    if kind == "qa":
        return grade_qa(final_text, Path(worktree))
    if kind == "feature":
        return grade_feature(task, Path(worktree), artifacts, Path(attempt_dir), base_commit, judge)
    ok, detail = ARTIFACT_CHECKS[kind](task.grading, artifacts)
    return {"verdict": "PASS" if ok else "FAIL", "detail": detail}
