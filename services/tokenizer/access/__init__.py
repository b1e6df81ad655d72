"""Who may call and how much: API keys and tenants (keys.py), the per-key limits' rules
(limits.py, pure) and their counts in Redis or in process (limiter.py)."""
