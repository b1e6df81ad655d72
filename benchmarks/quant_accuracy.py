"""How far a quantized format's next-token distributions are from the float model's, on data
the project ships: fixed prompts with the float model's greedy continuations, and a fixed
passage for perplexity. No download.

Every position is computed by a decode step that reads its context from the KV cache
(teacher forcing, one token per sequence per step), so an int8 KV cache is measured where it
acts: a prefill chunk attends to its own new keys in full precision and would hide it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.input_batch import InputBatch
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.loaded_model import LoadedModel

EVAL_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "List three colors:\n1.",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first human landed on the",
    "Translate to French: 'good morning' ->",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Photosynthesis is the process by which",
    "Q: What is 12 times 12?\nA:",
)
# Perplexity text: written for this benchmark (plain expository prose the model has not seen
# verbatim), split into equal segments that run as one batch.
EVAL_PASSAGE = (
    "A library is a quiet place where people borrow books, read newspapers and study. Most "
    "towns have at least one public library, and many schools keep a small collection of "
    "their own. Librarians sort the books by subject so that readers can find what they need, "
    "and they help visitors search catalogues and online records. In recent years libraries "
    "have also started to lend laptops, offer free internet access and run classes for adults "
    "who want to learn new skills. Children often visit with their parents on weekends to "
    "listen to stories and choose picture books to take home. A good library is more than a "
    "room full of shelves: it is a shared space that belongs to everyone in the community.\n\n"
    "Bread is made from flour, water, salt and yeast. The yeast feeds on sugars in the dough "
    "and releases carbon dioxide, which makes the dough rise. After the first rise the baker "
    "shapes the loaf, lets it rise again and then bakes it in a hot oven until the crust turns "
    "golden brown. The smell of fresh bread fills the kitchen, and it is hard to wait until it "
    "has cooled enough to slice. Different flours give different results: whole wheat flour "
    "makes a denser loaf, while white flour gives a lighter crumb.\n\n"
    "Rivers begin in mountains or hills, where rain and melting snow collect into small "
    "streams. The streams join together and grow larger as they flow downhill toward the sea. "
    "Along the way a river carries sand and mud, which it drops where the water slows down, "
    "building flat plains and wide deltas. People have always settled near rivers because "
    "they provide fresh water, fertile soil and an easy way to travel and trade goods."
)
NUM_CONTINUATION_TOKENS = 64
PASSAGE_SEGMENT_TOKENS = 64
PASSAGE_CONTEXT_TOKENS = 8
"""Tokens of each passage segment given before scoring starts."""
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class EvalSequence:
    token_ids: list[int]
    num_context_tokens: int
    """Positions before this are context only; the tokens after it are scored."""


@dataclass(frozen=True, slots=True)
class Reference:
    """What every format is compared with: the float model's outputs on the eval data."""

    prompts: list[EvalSequence]
    """Each prompt followed by the float model's greedy continuation."""
    passage: list[EvalSequence]
    log_probs: list[Tensor]
    """Per prompt sequence: the float model's log-softmax at every scored position [n, V]."""


@dataclass(frozen=True, slots=True)
class Accuracy:
    kl_divergence: float
    """Mean KL(float || format) of the next-token distribution, nats."""
    top1_agreement: float
    """Fraction of positions where the argmax token equals the float model's."""
    greedy_agreement: float
    """Mean fraction of the 64 greedy tokens generated before the first divergence."""
    perplexity: float
    prompt_log_probs: list[Tensor]
    """The format's own teacher-forced log-softmax on the reference prompts (for pairings)."""


def greedy_continuations(
    loaded: LoadedModel, config: EngineConfig, prompts: list[list[int]]
) -> list[list[int]]:
    """NUM_CONTINUATION_TOKENS greedy tokens per prompt (EOS ignored), one batch."""
    engine = LLMEngine(config, loaded=loaded)
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=NUM_CONTINUATION_TOKENS, ignore_eos=True
    )
    results = engine.generate(prompts, sampling)
    return [result.token_ids for result in results]


def teacher_forced_log_probs(
    loaded: LoadedModel, kv_cache_dtype: str, kv_group_size: int, sequences: list[EvalSequence]
) -> list[Tensor]:
    """log-softmax (fp32) at every scored position of each sequence: [len - context, V].

    Position p's distribution predicts token p + 1; the context is prefilled, then every
    later position is one decode step that reads the cache.
    """
    model = loaded.model
    spec = KVCacheSpec.for_model(
        model.architecture,
        BLOCK_SIZE,
        loaded.kv_cache_dtype(kv_cache_dtype),
        kv_group_size,
    )
    blocks_per_seq = [-(-len(seq.token_ids) // BLOCK_SIZE) for seq in sequences]
    cache = PagedKVCache(spec, sum(blocks_per_seq), loaded.device)
    batch = InputBatch(BLOCK_SIZE, loaded.device)
    first_block = 0
    new_sequences = []
    for index, (seq, num_blocks) in enumerate(zip(sequences, blocks_per_seq, strict=True)):
        block_ids = list(range(first_block, first_block + num_blocks))
        first_block += num_blocks
        new_sequences.append(
            NewSequence(
                str(index), seq.token_ids, len(seq.token_ids), block_ids, 0, SamplingParams()
            )
        )
    outputs: list[list[Tensor]] = [[] for _ in sequences]
    scheduled = {str(i): seq.num_context_tokens for i, seq in enumerate(sequences)}
    plan = BatchPlan(step_id=0, new_sequences=new_sequences, num_scheduled_tokens=scheduled)
    batch.apply(plan)
    step = 0
    with torch.inference_mode():
        while scheduled:
            inputs = batch.prepare(plan)
            forward = inputs.forward
            # One row per sequence: the last token scheduled for it this step.
            counts = torch.tensor(list(scheduled.values()))
            forward.logits_indices = (counts.cumsum(0) - 1).to(loaded.device)
            logits = model(forward, cache.layers)
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            for row, request_id in enumerate(scheduled):
                outputs[int(request_id)].append(log_probs[row])
            batch.advance(plan, {})
            step += 1
            scheduled = {
                rid: 1
                for rid, seq in batch.sequences.items()
                if seq.num_computed_tokens < len(seq.token_ids) - 1
            }
            plan = BatchPlan(step_id=step, num_scheduled_tokens=scheduled)
    return [torch.stack(rows) for rows in outputs]


def passage_sequences(loaded: LoadedModel) -> list[EvalSequence]:
    ids = loaded.tokenizer.encode(EVAL_PASSAGE)
    count = len(ids) // PASSAGE_SEGMENT_TOKENS
    return [
        EvalSequence(
            ids[i * PASSAGE_SEGMENT_TOKENS : (i + 1) * PASSAGE_SEGMENT_TOKENS],
            PASSAGE_CONTEXT_TOKENS,
        )
        for i in range(count)
    ]


def build_reference(float_model: LoadedModel, float_config: EngineConfig) -> Reference:
    prompts = [float_model.tokenizer.encode(text) for text in EVAL_PROMPTS]
    continuations = greedy_continuations(float_model, float_config, prompts)
    prompt_seqs = [EvalSequence(p + c, len(p)) for p, c in zip(prompts, continuations, strict=True)]
    log_probs = teacher_forced_log_probs(float_model, "auto", 8, prompt_seqs)
    return Reference(prompt_seqs, passage_sequences(float_model), log_probs)


def kl_and_top1(reference: list[Tensor], candidate: list[Tensor]) -> tuple[float, float]:
    """Mean KL(reference || candidate) and argmax agreement over all positions."""
    ref = torch.cat(reference)
    cand = torch.cat(candidate)
    kl = (ref.exp() * (ref - cand)).sum(dim=-1)
    top1 = (ref.argmax(dim=-1) == cand.argmax(dim=-1)).float()
    return float(kl.mean()), float(top1.mean())


def perplexity(log_probs: list[Tensor], sequences: list[EvalSequence]) -> float:
    """exp(mean NLL of each scored token given everything before it)."""
    nll: list[Tensor] = []
    for rows, seq in zip(log_probs, sequences, strict=True):
        targets = torch.tensor(seq.token_ids[seq.num_context_tokens :], device=rows.device)
        nll.append(-rows.gather(1, targets[:, None]).squeeze(1))
    return math.exp(float(torch.cat(nll).mean()))


def prefix_agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Mean fraction of each reference sequence matched before the first differing token."""
    fractions = []
    for ref, cand in zip(reference, candidate, strict=True):
        same = 0
        for a, b in zip(ref, cand, strict=False):
            if a != b:
                break
            same += 1
        fractions.append(same / len(ref))
    return sum(fractions) / len(fractions)


def measure_accuracy(loaded: LoadedModel, config: EngineConfig, reference: Reference) -> Accuracy:
    """One format (its loaded weights + config's KV cache format) against the reference."""
    prompt_log_probs = teacher_forced_log_probs(
        loaded, config.kv_cache_dtype, config.kv_cache_group_size, reference.prompts
    )
    kl, top1 = kl_and_top1(reference.log_probs, prompt_log_probs)
    prompts = [seq.token_ids[: seq.num_context_tokens] for seq in reference.prompts]
    greedy = greedy_continuations(loaded, config, prompts)
    expected = [seq.token_ids[seq.num_context_tokens :] for seq in reference.prompts]
    passage_log_probs = teacher_forced_log_probs(
        loaded, config.kv_cache_dtype, config.kv_cache_group_size, reference.passage
    )
    return Accuracy(
        kl_divergence=kl,
        top1_agreement=top1,
        greedy_agreement=prefix_agreement(expected, greedy),
        perplexity=perplexity(passage_log_probs, reference.passage),
        prompt_log_probs=prompt_log_probs,
    )
