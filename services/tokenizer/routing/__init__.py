"""Reaching the schedulers: the pool of scheduler clients and their membership (fixed addresses
and DNS names), the routing policies, the Redis prefix locator, the Submit stream, the LoRA
adapters' fan-out over the pool, and the schedulers' errors and snapshots as the tier sees
them. Never imports the HTTP doors."""
