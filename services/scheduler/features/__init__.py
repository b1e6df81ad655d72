"""The scheduler's features, one module each, composed by the core (scheduler.py, step_loop.py)
through hooks: n > 1 choices, speculative draft slots, pinned prefixes, fair shares, LoRA
slots and adapters, grammar readiness, sliding windows, retry hints, event coalescing.

A feature keeps its own per-request state, keyed by request id, and never imports the core
(an import-linter contract in pyproject.toml)."""
