"""Speculative decoding on the worker: drafts proposed from each sequence's own tokens
(ngram_proposer.py) and from the recent text of its tenant and adapter (suffix_cache.py),
checked in the step that computes them (verify_step.py) by the rules in draft_verification.py.
The scheduler decides who drafts and how much (services/scheduler/features/draft_slots.py)."""
