"""Built-in inputs of `llmserve estimate`: common GPUs and well-known model shapes.

GPU figures are from the vendors' datasheets: memory (GB), memory bandwidth (GB/s) and dense
FP16/BF16 tensor-core TFLOPS, i.e. the datasheet's number *without* 2:4 sparsity (datasheets
print the sparse figure with an asterisk, twice as large). Sources:
  T4        NVIDIA Tesla T4 datasheet: 16 GB GDDR6, 320 GB/s, 65 TFLOPS mixed FP16/FP32
  A10       NVIDIA A10 datasheet: 24 GB GDDR6, 600 GB/s, BF16 125 TFLOPS (250 sparse)
  A10G      AWS G5 instances; NVIDIA publishes no A10G datasheet. Same memory as the A10,
            ~70 TFLOPS dense FP16 tensor as reported by AWS partners (e.g. Baseten's A10 vs
            A10G comparison); treat it as approximate
  L4        NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS sparse -> 121 dense
  L40S      NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 733 sparse -> 362 dense
  A100-40G  NVIDIA A100 datasheet (SXM): 40 GB HBM2, 1,555 GB/s, BF16 312 TFLOPS
  A100-80G  NVIDIA A100 datasheet (SXM): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS
  H100-SXM  NVIDIA H100 datasheet (SXM): 80 GB HBM3, 3,350 GB/s, BF16 1,979 sparse -> 989 dense
  H200      NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4,800 GB/s, BF16 989 dense
  RTX 4090  NVIDIA Ada (AD102) architecture whitepaper: 24 GB GDDR6X, 1,008 GB/s, FP16 tensor
            with FP32 accumulate 165.2 TFLOPS dense (the seeds' table uses the same figure)
Prices are indicative on-demand cloud rates in US$ per GPU-hour (rounded, 2024-25 public price
lists of large clouds and GPU clouds); they vary 2-3x by provider, region and commitment, so
pass real ones with --gpus-file.

Model shapes are the published Hugging Face config.json values of each model.
"""

from __future__ import annotations

from services.estimate.roofline import Device, ModelShape

KNOWN_GPUS: dict[str, Device] = {
    device.name.lower(): device
    for device in (
        Device("T4", memory_gb=16, bandwidth_gb_s=320, tflops=65, usd_per_hour=0.53),
        Device("A10G", memory_gb=24, bandwidth_gb_s=600, tflops=70, usd_per_hour=1.01),
        Device("A10", memory_gb=24, bandwidth_gb_s=600, tflops=125, usd_per_hour=0.75),
        Device("L4", memory_gb=24, bandwidth_gb_s=300, tflops=121, usd_per_hour=0.80),
        Device("L40S", memory_gb=48, bandwidth_gb_s=864, tflops=362, usd_per_hour=1.80),
        Device("A100-40G", memory_gb=40, bandwidth_gb_s=1555, tflops=312, usd_per_hour=1.30),
        Device("A100-80G", memory_gb=80, bandwidth_gb_s=2039, tflops=312, usd_per_hour=1.80),
        Device("H100-SXM", memory_gb=80, bandwidth_gb_s=3350, tflops=989, usd_per_hour=3.00),
        Device("H200", memory_gb=141, bandwidth_gb_s=4800, tflops=989, usd_per_hour=3.80),
        Device("RTX-4090", memory_gb=24, bandwidth_gb_s=1008, tflops=165.2, usd_per_hour=0.40),
    )
}

DEFAULT_GPUS = (
    "t4",
    "a10g",
    "l4",
    "l40s",
    "a100-40g",
    "a100-80g",
    "h100-sxm",
    "h200",
    "rtx-4090",
)

KNOWN_MODELS: dict[str, ModelShape] = {
    model.name: model
    for model in (
        ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, tie_word_embeddings=True),
        ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000, tie_word_embeddings=False),
        ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000, tie_word_embeddings=False),
        ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256, tie_word_embeddings=False),
        ModelShape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256, tie_word_embeddings=False),
        ModelShape("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32000, tie_word_embeddings=False),
        ModelShape(
            "qwen2-7b",
            28,
            3584,
            18944,
            28,
            4,
            128,
            152064,
            tie_word_embeddings=False,
            attention_bias=True,
        ),
    )
}


def find_gpu(name: str) -> Device:
    """A built-in GPU by name, case-insensitive; 'RTX 4090' and 'rtx-4090' both work."""
    key = name.strip().lower().replace(" ", "-")
    if key not in KNOWN_GPUS:
        raise ValueError(f"unknown GPU {name!r}; built in: {', '.join(KNOWN_GPUS)}")
    return KNOWN_GPUS[key]
