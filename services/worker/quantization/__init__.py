"""Quantized formats of the worker: the KV cache (int8 with group scales) and the weights
(int8, W8A8, int4, NF4, or a GGUF file's own blocks), chosen at load
(services/worker/loader/model_loader.py): GGUF blocks are attached as the file stores them,
the other formats swap layers made from the float weights."""
