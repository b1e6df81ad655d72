"""Settings shared by several services, each defined once with its default and doc.

Service configs inherit the groups they use, so flags and LLMSERVE_* variables stay flat
(`--max-num-seqs`, not `--batching-max-num-seqs`) and `llmserve up` can hand a group to its
children unchanged (services.common.config_flags.config_argv).

    group           composed by
    ModelConfig     worker, engine, stack
    ChatConfig      tokenizer, engine, stack
    WeightsConfig   worker, engine, stack
    DeviceConfig    worker, stack
    KvTierConfig    worker, engine, stack
    BatchingConfig  scheduler (core and server), worker, engine, stack
    StepLoopConfig  scheduler (server), stack
    RuntimeConfig   worker, engine, stack
    SpeculationConfig scheduler (core and server), worker, engine, stack
    LoraConfig      worker, engine, stack
    PublicConfig    tokenizer, stack
    InternalConfig  tokenizer, scheduler (server), worker, stack
    DisaggregationConfig tokenizer, scheduler (server), stack

The groups are frozen dataclasses without slots: a class inheriting several slotted bases
cannot be laid out, while a slotted service config may inherit any number of these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from services.contracts.errors import LLMServeError
from services.contracts.sampling_params import MAX_SPECULATIVE_TOKENS
from services.contracts.text_parsers import ReasoningParserName, ToolCallParserName

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
SchedulingMode = Literal["overlapped", "serial"]

DEFAULT_KV_GROUP_SIZE = 8
"""int8 KV cache: values of head_dim sharing one fp16 scale."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model is served, and how long a sequence may grow."""

    model: str | None = None
    """A .gguf file or Hugging Face directory (the same for the tokenizer tier and the
    workers); unset = the embedded SmolLM2-135M-Instruct."""
    max_model_len: int | None = None
    """Longest prompt + output; unset = the model's context length (never more than it)."""


@dataclass(frozen=True)
class ChatConfig:
    """How chat messages become a prompt (where chat templates are rendered)."""

    chat_template: str | None = None
    """A chat template that replaces the model's, or gives one to a model that ships none
    (without either, chat requests are refused; completions work): a built-in's name, as
    llama.cpp's server takes it (chatml, llama2, llama3, mistral, gemma, phi3, qwen,
    deepseek ...: services/text/builtin_chat_templates.py), or a Jinja file."""
    reasoning_parser: ReasoningParserName | None = None
    """How a reasoning model marks its thinking (deepseek_r1, qwen3: `<think>...</think>`):
    a chat answer's thinking then goes out apart from its content (OpenAI's
    `reasoning_content`, the gRPC `reasoning_text`); unset = all of it is content."""
    tool_call_parser: ToolCallParserName = "auto"
    """How the model writes a tool call, when a request gives tools (vLLM's names): hermes
    (Hermes, Qwen2.5/3 `<tool_call>`), llama3_json, mistral (`[TOOL_CALLS]`), json (the whole
    answer is a call object or a list of them); auto = told from the chat template."""


@dataclass(frozen=True)
class WeightsConfig:
    """How the weights and the KV cache are stored."""

    dtype: DTypeName = "auto"
    """auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA or where the CPU has native
    bf16)."""
    quantization: str = "auto"
    """Weights: auto (a GGUF keeps its own blocks, a HF directory its dtype), none, int8, w8a8,
    int4, nf4, gguf (a GGUF's blocks, activations rounded to int8 as llama.cpp does) or
    gguf-exact (the same blocks against float activations, and a float32 KV cache unless
    --kv-cache-dtype says otherwise: transformers' arithmetic)."""
    kv_cache_dtype: str = "auto"
    """auto, float32, bfloat16, float16 or int8 (per-group fp16 scales; about 1.6x the blocks
    of bf16). auto: the model dtype, but float16 for a float32 model under --quantization gguf
    on a CPU (llama.cpp's default cache: half the bytes per token), float32 under gguf-exact."""
    kv_cache_group_size: int = DEFAULT_KV_GROUP_SIZE
    """int8 KV cache: values of head_dim sharing one scale (8: 1.25 B/value, 64: 1.03)."""
    block_size: int = 16
    """Tokens per KV block."""


@dataclass(frozen=True)
class DeviceConfig:
    """Where a worker runs and how much memory its KV cache takes."""

    device: str = "cpu"
    """cpu or cuda[:N]."""
    kv_cache_gib: float = 1.0
    """Memory for the paged KV cache, GiB; the number of blocks follows."""


class KvTierFlagError(LLMServeError, ValueError):
    """A KV tier flag the deployment cannot honour; the message names the flag and why."""


HOST_TIER_ON_CPU = (
    "--kv-offload-gib: there is no host-memory tier on a CPU worker: its KV pool already "
    "lives in host memory, and a second copy there would only pay if it were smaller, which "
    "KV does not get (lossless compression saves 7-16% at ~100 MB/s to decompress, about "
    "what recomputing the block costs; docs/prefix-cache.md, Host tier). Give the pool the "
    "memory instead (a bigger --kv-cache-gib, or --kv-cache-dtype int8 for ~1.6x the "
    "blocks), and add --kv-disk-dir: its block files stay in the OS page cache while memory "
    "is free, and on disk when it is not"
)
HOST_TIER_ON_GPU = (
    "--kv-offload-gib: the host-memory tier below a GPU's KV pool is not built yet; use "
    "--kv-disk-dir (its block files stay in the OS page cache while host memory is free)"
)


@dataclass(frozen=True)
class KvTierConfig:
    """Where the prefix cache's blocks go below the worker's KV pool (docs/prefix-cache.md,
    Disk tier)."""

    kv_disk_dir: str | None = None
    """Directory of the KV disk tier: full cached blocks written below the pool, kept across
    restarts; one live worker per directory (a second is refused); unset = no disk tier."""
    kv_disk_gib: float = 10.0
    """Most bytes the KV disk tier keeps, in GiB; the least recently used blocks go first."""
    kv_offload_gib: float = 0.0
    """A host-memory tier between the pool and the disk, in GiB: refused on a CPU, whose pool
    is host memory already (the message says what to use instead); not built yet for a GPU.
    0 = none."""

    def check_kv_tiers(self, device: str) -> None:
        if self.kv_disk_gib <= 0:
            raise KvTierFlagError(f"--kv-disk-gib must be positive; got {self.kv_disk_gib}")
        if self.kv_offload_gib < 0:
            raise KvTierFlagError(f"--kv-offload-gib must be >= 0; got {self.kv_offload_gib}")
        if self.kv_offload_gib:
            raise KvTierFlagError(HOST_TIER_ON_CPU if device == "cpu" else HOST_TIER_ON_GPU)


@dataclass(frozen=True)
class BatchingConfig:
    """How many requests one step and the waiting queue hold."""

    max_num_seqs: int = 128
    """Most sequences in one step (running + newly admitted); the worker compiles decode step
    graphs up to this batch, larger batches run eagerly."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step, shared by prefill chunks and decodes."""
    max_waiting_requests: int = 256
    """Requests that may wait beyond the max_num_seqs seats: a scheduler holding
    max_num_seqs + max_waiting_requests (running or waiting) refuses the next at once
    (RESOURCE_EXHAUSTED), so free seats count as queue room."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose chained token hash is already cached."""
    fair_share: bool = True
    """Share a busy scheduler between tenants by weight (services/scheduler/features/fair_share.py):
    admission in fair order, seats taken back from tenants over their share for tenants under
    it, queue room kept for them. Off: first come first served whoever sends."""


@dataclass(frozen=True)
class StepLoopConfig:
    """How a scheduler paces its worker's steps."""

    scheduling: SchedulingMode = "overlapped"
    """overlapped: the next plan is sent while the worker runs the current one (the worker
    feeds each sequence the token it just sampled), so the worker never waits for the
    scheduler; a sequence that stops costs at most one discarded token. serial: one plan in
    flight, each made after the previous result (the reference behaviour)."""


@dataclass(frozen=True)
class DisaggregationConfig:
    """KV moving between pairs: prefill/decode disaggregation (docs/disaggregation.md), which
    prompts are prefilled on a prefill pair and how long a decode pair waits for their KV; and
    prefix fetch (docs/prefix-cache.md)."""

    disaggregate_min_prompt: int = 512
    """Shortest prompt (tokens) the tokenizer tier sends to a prefill pair when one answers;
    shorter ones are prefilled on the decode pair that serves them."""
    kv_transfer_timeout_s: float = 60.0
    """Longest a decode scheduler waits for a prefill pair's first token and its own worker's
    word that the KV has landed (AwaitKv) before it prefills the prompt itself; also bounds a
    prefix fetch."""
    prefix_fetch_min_blocks: int = 4
    """Prefix fetch (docs/prefix-cache.md): when routing sends a prompt to a pair that holds at
    least this many fewer of its leading blocks than another pair does (by the Redis prefix
    index), the request names that pair, and the chosen one fetches those blocks' KV from its
    cache instead of computing them, while fetching measures cheaper. 0: never."""

    def check_disaggregation(self) -> None:
        if self.disaggregate_min_prompt < 1:
            raise ValueError("--disaggregate-min-prompt must be at least 1")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError("--kv-transfer-timeout-s must be positive")
        if self.prefix_fetch_min_blocks < 0:
            raise ValueError("--prefix-fetch-min-blocks must be 0 (off) or more")


@dataclass(frozen=True)
class DebugConfig:
    """Checks for tests and debugging, of the scheduler (its core, server and the stack)."""

    debug_checks: bool = False
    """After every step, check that the scheduler's queues, seats, block tables and block
    reference counts agree (an AssertionError names the first disagreement). Costs time in
    proportion to the requests and blocks held: for tests and debugging."""


@dataclass(frozen=True)
class RuntimeConfig:
    """How a worker executes steps."""

    seed: int | None = None
    """Seed of the sampler's shared generator (requests without their own seed), so the same
    requests on the same config repeat their samples; sampled requests then do not draft
    (speculative decoding stays on for greedy ones)."""
    enforce_eager: bool = False
    """Run every step eagerly (no compiled step graphs): slower, starts faster."""
    fused_decode: bool = True
    """Pure-decode steps on a CPU (GGUF blocks or dense float weights) run every layer in one
    C++ call (no compilation needed); --no-fused-decode uses compiled graphs or eager ops
    instead."""
    deterministic: bool | None = None
    """Batch-invariant steps: a sequence's logits depend only on its own tokens, so greedy
    output is the same whatever a request is batched with, alone or repeated from the prefix
    cache, chunked or not. Unset (the default): on where it costs nothing, a CPU worker whose
    projections are GGUF blocks read with int8 activations (every step, prefill too, runs the
    fused C++ layers with each token attending as a decode query); off elsewhere. Set: on
    everywhere the worker can (float weights then run every step eagerly, slower; a GPU or
    another quantization is refused). --no-deterministic: off."""


DEFAULT_SPECULATIVE_NGRAM = 3
"""Most drafts per sequence and step by default: an upper bound (the scheduler's policy grants
draft j only while acceptance^j pays for its token). 3: a sequence's decode row and its drafts
then fill the CPU kernels' 4-row tile, and a 5th row starts another (`llmserve bench
verify-rows` prints the cost per row count on a given model)."""

DEFAULT_SUFFIX_CACHE_TOKENS = 65536
"""Suffix decoding's budget by default: ~20 MiB of Python lists and index (~320 bytes a
token, measured), the recent exchanges of a small worker (~100 chats of 600 tokens), and a
proposal stays ~0.2 ms whatever the budget (bounded candidates)."""


@dataclass(frozen=True)
class SpeculationConfig:
    """Model-free speculative decoding, on by default: a decoding sequence's next tokens are
    guessed from its own context (prompt lookup: where its last n tokens occurred before) and
    from recent requests' text (suffix decoding), and one forward checks the guesses with the
    regular token. Output is unchanged (greedy: token for token; sampled: the same
    distribution); only its speed differs. The scheduler grants drafts per step only while
    they raise output tokens per second, so large (compute-bound) batches and sequences whose
    drafts keep failing do not draft."""

    speculation: bool | None = None
    """Speculative decoding. Unset: on where verifying drafts cannot change greedy output,
    a batch-invariant worker (the default for a GGUF file on a CPU: docs/determinism.md);
    elsewhere (float or gguf-exact weights, a GPU) a draft row's last-bit differences could
    flip a near tie, so drafts come only to requests that set num_speculative_tokens.
    --speculation: on everywhere. --no-speculation turns every proposer off (no drafts, no
    suffix cache; requests' num_speculative_tokens is ignored): the baseline to compare
    with. It overrides the --speculative-* settings rather than conflicting with them, so a
    deployment's settings stay in place while a run measures the baseline."""
    speculative_ngram: int = DEFAULT_SPECULATIVE_NGRAM
    """Most draft tokens a step may verify per sequence (from either proposer), for requests
    that do not set num_speculative_tokens (0 = off for those). The scheduler grants fewer,
    or none, when verifying drafts would cost more than they save."""
    speculative_ngram_min_n: int = 2
    """Shortest suffix of the context that prompt lookup matches."""
    speculative_ngram_max_n: int = 4
    """Longest suffix tried first (a longer match guesses better)."""
    speculative_suffix_cache_tokens: int = DEFAULT_SUFFIX_CACHE_TOKENS
    """Suffix decoding: tokens of recent prompts and outputs (finished and running requests)
    the worker keeps to draft from, besides each sequence's own context; the oldest requests
    are evicted past it (~320 bytes of worker memory a token). Drafts come only from the same
    tenant (cache salt) and LoRA adapter. 0 = off (prompt lookup alone)."""
    speculative_suffix_min_prob: float = 0.1
    """Suffix decoding cuts a draft where its continuation's frequency among the matched
    earlier text (the product along the draft) falls below this."""

    @property
    def suffix_cache_tokens(self) -> int:
        """speculative_suffix_cache_tokens as served: 0 (no cache) under --no-speculation."""
        return 0 if self.speculation is False else self.speculative_suffix_cache_tokens

    def default_draft_limit(self, batch_invariant: bool) -> int:
        """The draft limit of a request that does not set its own, on a worker that is (or
        is not) batch-invariant: speculative_ngram where speculation is on, 0 elsewhere."""
        if self.speculation is False:
            return 0
        if self.speculation is None and not batch_invariant:
            return 0
        return self.speculative_ngram

    def check_speculation(self) -> None:
        if not 0 <= self.speculative_ngram <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_ngram must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.speculative_ngram}"
            )
        if self.speculative_suffix_cache_tokens < 0:
            raise ValueError(
                "speculative_suffix_cache_tokens must be >= 0, got "
                f"{self.speculative_suffix_cache_tokens}"
            )
        if not 0.0 <= self.speculative_suffix_min_prob <= 1.0:
            raise ValueError(
                "speculative_suffix_min_prob must be in [0, 1], got "
                f"{self.speculative_suffix_min_prob}"
            )
        if not 1 <= self.speculative_ngram_min_n <= self.speculative_ngram_max_n:
            raise ValueError(
                "need 1 <= speculative_ngram_min_n <= speculative_ngram_max_n, got "
                f"{self.speculative_ngram_min_n} and {self.speculative_ngram_max_n}"
            )


MAX_LORA_RANK = 64
"""The largest max_lora_rank a worker accepts."""


def parse_lora_module(module: str) -> tuple[str, str]:
    """One --lora-modules value → (name, path): `NAME=PATH` (the path may hold `=`), or
    vLLM's JSON object with `name` and `path` (its `base_model_name` is ours: ignored)."""
    if module.lstrip().startswith("{"):
        try:
            spec = json.loads(module)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules: {module!r} is not valid JSON ({exc})") from exc
        name, path = spec.get("name"), spec.get("path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: {module!r} needs string fields 'name' and 'path'")
        return name, path
    name, _, path = module.partition("=")
    if not name or not path:
        raise ValueError(f"lora_modules: {module!r} is not NAME=PATH")
    return name, path


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters of the one base model (services/worker/lora/): how many a step may mix,
    how large they may be, and how many stay loaded in host memory."""

    max_loras: int = 4
    """Adapters held on the device at once (slots): one batch mixes at most this many. The
    slots' memory is taken when the first adapter is loaded; 0 = no adapters."""
    max_lora_rank: int = 16
    """Largest rank an adapter may have (up to 64); the slots are padded to it."""
    max_cpu_loras: int = 8
    """Adapters kept in host memory (least recently used forgotten first; read again from
    their file when a sequence needs them); at least max_loras."""
    lora_modules: tuple[str, ...] = field(default=(), metadata={"values_per_flag": "+"})
    """Adapters to load at start, each `NAME=PATH` or vLLM's JSON `{"name": ..., "path": ...}`
    (a PEFT directory or a GGUF LoRA file), several after one flag (`--lora-modules a=X
    b=Y`, as vLLM takes them) or the flag repeated; requests name one by `model`. One that
    does not fit the model stops the start, naming why."""

    def lora_module_paths(self) -> dict[str, str]:
        """--lora-modules as {name: path}."""
        return dict(parse_lora_module(module) for module in self.lora_modules)

    def check_lora(self) -> None:
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}"
            )
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        names: set[str] = set()
        for module in self.lora_modules:
            name, _ = parse_lora_module(module)
            if name in names:
                raise ValueError(f"lora_modules: {name!r} is named twice")
            names.add(name)
        if self.lora_modules and self.max_loras == 0:
            raise ValueError("lora_modules: adapters need LoRA slots (max_loras is 0)")


@dataclass(frozen=True)
class PublicConfig:
    """The tokenizer tier's public doors (gRPC and OpenAI HTTP): who may call, over what."""

    http: bool = True
    """Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /v1/models, /health, /ready) beside gRPC."""
    http_port: int = 8000
    """Port of the HTTP API (0 = any free port); replicas share it, as they share the gRPC
    port."""
    api_key: tuple[str, ...] = field(default=(), repr=False, metadata={"secret": True})
    """An API key callers must send (HTTP `Authorization: Bearer KEY`, gRPC `authorization`
    metadata); repeatable. No key at all = the API is open."""
    admin_api_key: tuple[str, ...] = field(default=(), repr=False, metadata={"secret": True})
    """A key that may also RegisterPrompt / DeletePrompt and act for any tenant; repeatable."""
    api_key_file: str | None = None
    """A file of keys, one per line: `KEY`, `KEY tenant=ID` (the key acts for that tenant
    only) or `KEY admin`, each optionally with `weight=N` (its fair share) and limits
    `max_concurrent=N` (requests in flight), `rpm=N` (requests per minute), `tpm=N` (prompt +
    output tokens per minute); `#` comments. Keeps keys off the command line."""
    http_max_body_bytes: int = 4 * 1024 * 1024
    """Largest HTTP request body, in bytes (4 MiB); a larger one is refused with 413 before
    it is read (by its Content-Length, or as soon as a chunked body passes the limit)."""
    http_timeout_s: float = 30.0
    """How long a client may take to send a request's headers, and then its body: a slower
    one (a trickle, a stalled upload) gets 408 and its connection is closed."""
    http_max_connections: int = 1024
    """Most HTTP connections a replica serves at once: a request on any connection beyond
    them gets 503 (and its connection is closed), so trickling clients cannot take every
    file descriptor."""
    tls_cert: str | None = None
    """PEM certificate (chain) of the public gRPC and HTTP ports; with --tls-key, both
    ports speak TLS only."""
    tls_key: str | None = None
    """PEM private key of --tls-cert."""

    def check_public(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_max_body_bytes <= 0 or self.http_max_connections <= 0:
            raise ValueError("http_max_body_bytes and http_max_connections must be > 0")
        if self.http_timeout_s <= 0:
            raise ValueError(f"http_timeout_s must be > 0, got {self.http_timeout_s}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


@dataclass(frozen=True)
class InternalConfig:
    """How the stack's own processes know each other: the internal ports (scheduler, worker)
    answer only calls that carry the stack's secret (services/common/internal_auth.py)."""

    internal_secret: str | None = field(default=None, repr=False, metadata={"secret": True})
    """A secret every internal call carries (tokenizer → scheduler, scheduler → worker) and
    the scheduler and worker ports require (UNAUTHENTICATED without it; health and reflection
    stay open). Unset = those ports trust anyone who reaches them. `llmserve up` makes one per
    stack; give every service the same one through LLMSERVE_INTERNAL_SECRET, never a flag."""


# The shared groups each service's config is made of, declared once: the service configs
# inherit exactly these (services/worker/config.py, services/scheduler/server_config.py,
# services/tokenizer/config.py, each adding only its own fields), and the launcher hands a
# child these groups of the stack's config as flags.
SERVICE_GROUPS: dict[str, tuple[type, ...]] = {
    "worker": (
        ModelConfig,
        WeightsConfig,
        DeviceConfig,
        KvTierConfig,
        BatchingConfig,
        RuntimeConfig,
        SpeculationConfig,
        LoraConfig,
        InternalConfig,
    ),
    "scheduler": (
        BatchingConfig,
        StepLoopConfig,
        SpeculationConfig,
        InternalConfig,
        DisaggregationConfig,
        DebugConfig,
    ),
    # The model reaches the tokenizer tier through the schedulers.
    "tokenizer": (PublicConfig, ChatConfig, InternalConfig, DisaggregationConfig),
}
