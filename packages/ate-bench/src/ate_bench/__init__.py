"""ATE-Bench: what it costs a coding agent to understand, operate and extend a training framework.

Modules: tasks (the 20 tasks), frameworks (framework TOMLs), agents (how each agent CLI is
launched), runner (worktrees, time limits, resume), transcript (metrics), gpu (NVML sampler),
grading (citations, artifact checks, judge), report (report / compare), inspect_repo (inspect),
cli (the `ate-bench` command).
"""
