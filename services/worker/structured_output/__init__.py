"""Structured output on the worker: one grammar matcher per constrained sequence, masking the
sampler's logits and advancing with each sampled token (matchers.py). Grammars are compiled
ahead of admission (services/common/grammar.py), so no step waits for a compile."""
