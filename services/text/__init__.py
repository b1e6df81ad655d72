"""Text: everything between a model's token ids and the words a person reads or writes.

The tokenizers (Hugging Face `tokenizer.json` or a GGUF file's own vocabulary and
pre-tokenizer), chat templates, incremental detokenization, stop strings, the reasoning
splitter and the tool-call parsers. Torch-free and free of any service: the tokenizer tier,
the worker, the engine and the client all read text through here.
"""
