"""A scripted stand-in for a coding agent, copied into a temporary directory and made executable
by test_run.py. Called either like the Claude Code CLI (`claude -p PROMPT ...`) or through a
generic template (`fake-agent PROMPT_FILE`). It picks a behaviour from the prompt, does the task
in its working directory (the attempt's worktree), and prints a Claude stream-json transcript.
Each call appends its argv to $FAKE_AGENT_LOG so tests can count invocations."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def emit(event):
    print(json.dumps(event), flush=True)


def assistant(number, block):
    usage = {"input_tokens": 10, "cache_read_input_tokens": 100 * number, "cache_creation_input_tokens": 0}
    emit(
        {
            "type": "assistant",
            "message": {"id": f"msg_{number}", "content": [block], "usage": usage | {"output_tokens": 5}},
        }
    )


def tool(number, name, **tool_input):
    assistant(number, {"type": "tool_use", "id": f"toolu_{number}", "name": name, "input": tool_input})


def finish(text, turns):
    scale = int(os.environ.get("FAKE_SCALE", "1"))
    usage = {
        "inputTokens": 40,
        "outputTokens": 250 * scale,
        "cacheReadInputTokens": 600,
        "cacheCreationInputTokens": 160,
    }
    emit({"type": "result", "subtype": "success", "is_error": False, "duration_ms": 1500 * scale,
          "num_turns": turns, "result": text, "modelUsage": {"claude-test": usage}})  # fmt: skip


def main():
    argv = sys.argv[1:]
    prompt = argv[argv.index("-p") + 1] if "-p" in argv else Path(argv[0]).read_text()
    prompt = " ".join(prompt.split())  # prompts are wrapped at ~100 columns
    with open(os.environ["FAKE_AGENT_LOG"], "a") as log:
        log.write(json.dumps(argv) + "\n")
    artifacts = Path(os.environ["ATE_ARTIFACTS"])
    emit({"type": "system", "subtype": "init", "cwd": os.getcwd()})
    if "process groups" in prompt:
        tool(1, "Grep", pattern="init_process_group")
        tool(2, "Read", file_path=str(Path.cwd() / "train.py"))
        answer = "The default group is created by `init_process_group` in `setup` (train.py:5)."
        finish(f"<final_answer>{answer}</final_answer>", 3)
    elif "until training step 5" in prompt:
        tool(1, "Bash", command="python train.py --steps 5")
        (artifacts / "smoke.log").write_text("".join(f"step {s} loss {8 - s / 10}\n" for s in range(1, 6)))
        finish("Ran the smoke script.", 2)
    elif "Differential Transformer" in prompt:
        tool(1, "Edit", file_path="model.py")
        with open("model.py", "a") as f:
            f.write("\n\ndef diff_attention(q1, q2, k1, k2, v, lam):\n    return None\n")
        tool(2, "Bash", command="python train.py --steps 64")
        with open(artifacts / "loss.jsonl", "w") as f:
            f.writelines(json.dumps({"step": s, "loss": 9 - s / 20}) + "\n" for s in range(1, 65))
        finish("Implemented differential attention.", 3)
    elif "MoBA" in prompt:  # misbehaves: walks out of its worktree into the user's checkout
        common = subprocess.run(["git", "rev-parse", "--git-common-dir"], capture_output=True, text=True)
        (Path(common.stdout.strip()).parent / "stray.py").write_text("oops = 1\n")
        finish("Done.", 1)
    else:  # a long-running job that also starts a detached helper: the timeout must end both
        tool(1, "Bash", command="python train.py --steps 100000")
        helper = subprocess.Popen(["sleep", "300"], start_new_session=True)
        Path(os.environ["FAKE_AGENT_PIDS"]).write_text(f"{os.getpid()} {helper.pid}")
        time.sleep(300)


main()
