"""LoRA adapters of the served model: read (PEFT directories, GGUF LoRA files) and checked
against the base, kept in host memory and in device slots, and applied per batch row.

    adapter.py       the adapter in memory, its targets, checks against the served model
    peft_format.py   adapter_config.json + adapter_model.safetensors
    gguf_format.py   llama.cpp's GGUF LoRA files (convert_lora_to_gguf.py)
    slots.py         the device slots: stacked, zero-padded A and B per projection
    adapters.py      names -> host copies (LRU) -> slots; sequences -> slots; the segment table
    batch.py         what a forward batch carries, and the hook the projections call
"""
