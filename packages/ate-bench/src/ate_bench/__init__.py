"""ate-bench."""
