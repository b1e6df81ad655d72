"""Token sampling in torch: per-row temperature, top-k, top-p, min-p; greedy fast path.

Filters are applied in Hugging Face's order (top-k, then top-p over the renormalised top-k
set, then min-p) and each is a per-row *threshold* on the temperature-scaled logits: a token
survives when its logit >= max(t_top_k, t_top_p, t_min_p). Ties at a threshold all survive.

    t_top_k = the k-th largest logit
    t_top_p = the smallest logit x (among those >= t_top_k) with mass(logits > x) < p * mass
    t_min_p = max logit + log(min_p)          (prob >= min_p * max prob, in logit space)

The draw uses the exponential race: argmax_i(p_i / E_i) with E_i ~ Exp(1) picks i with
probability p_i, and argmax_i(logit_i - log E_i) is the same argmax without a softmax. Passing
`exponentials` makes a draw reproducible (the Triton kernel is tested on the same draws).

Sorting is avoided where it can be: top-k uses torch.topk over the largest k only; top-p
sorts just the top-k candidates when every top-p row also sets top_k, the whole vocabulary
only otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def scaled_logits(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits [B, V] * (1 / T) in fp32; greedy rows (T <= 0) are left unscaled."""
    inv_t = torch.where(temperature > 0, 1.0 / temperature.float(), 1.0)
    return logits.float() * inv_t[:, None]


def keep_thresholds(x: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Per-row logit threshold [B] (fp32) over scaled logits x [B, V]; -inf keeps everything."""
    batch, vocab = x.shape
    threshold = torch.full((batch,), NEG_INF, dtype=torch.float32, device=x.device)
    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    if bool(k_on.any()):
        max_k = int(top_k[k_on].max())
        top_values = torch.topk(x, max_k, dim=-1).values  # sorted, descending
        kth = top_values.gather(1, (top_k.clamp(1, max_k) - 1).long()[:, None]).squeeze(1)
        threshold = torch.where(k_on, kth, threshold)
    if bool(p_on.any()):
        # Only rows with top-p need sorted candidates; if all of them also have a top-k, the
        # k largest suffice (the rest of the vocabulary is already filtered out).
        need_full = bool((p_on & ~k_on).any())
        num_candidates = vocab if need_full else int(top_k[p_on].max())
        candidates = torch.topk(x, num_candidates, dim=-1).values
        candidates = candidates.masked_fill(candidates < threshold[:, None], NEG_INF)
        mass = torch.softmax(candidates, dim=-1)
        mass_before = mass.cumsum(dim=-1) - mass  # mass strictly above each candidate (no ties)
        kept = (mass_before < top_p[:, None]) & (candidates > NEG_INF)
        last_kept = (kept.sum(dim=-1) - 1).clamp(min=0)
        t_p = candidates.gather(1, last_kept[:, None]).squeeze(1)
        threshold = torch.where(p_on, torch.maximum(threshold, t_p), threshold)
    m_on = min_p > 0
    if bool(m_on.any()):
        t_m = x.max(dim=-1).values + torch.log(min_p.float().clamp(min=1e-30))
        threshold = torch.where(m_on, torch.maximum(threshold, t_m), threshold)
    return threshold


def sample_tokens(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    exponentials: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Samples one token per row -> [B] int64.

    logits [B, V]; temperature [B] (<= 0: greedy); top_k [B] int (<= 0 or >= V: off);
    top_p [B] (>= 1: off); min_p [B] (<= 0: off); exponentials [B, V] fp32 Exp(1) draws, or
    None to draw them here from `generator`.
    """
    greedy = temperature <= 0
    if bool(greedy.all()):
        return logits.argmax(dim=-1)  # fast path: no scaling, filtering or noise
    x = scaled_logits(logits, temperature)
    threshold = keep_thresholds(x, top_k, top_p, min_p)
    if exponentials is None:
        exponentials = torch.empty_like(x).exponential_(generator=generator)
    scores = (x - exponentials.log()).masked_fill_(x < threshold[:, None], NEG_INF)
    return torch.where(greedy, logits.argmax(dim=-1), scores.argmax(dim=-1))
