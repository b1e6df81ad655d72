"""`llmserve estimate`: plan hardware for a model before serving it. The roofline arithmetic
(roofline.py), a catalog of GPUs and model shapes (catalog.py), this CPU's copy bandwidth
(memory_bandwidth.py) and the command (command.py). A planning tool of the product, not a
benchmark: it runs no model."""
