"""Speculative decoding on the worker (prompt lookup): drafts proposed from each sequence's own
tokens (ngram_proposer.py), checked in the step that computes them (verify_step.py) by the
rules in draft_verification.py. The scheduler decides who drafts and how much
(services/scheduler/features/draft_slots.py)."""
