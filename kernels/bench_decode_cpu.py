"""CPU timing of decode-attention formulations (why attention_torch uses "sdpa_rows").

    python -m kernels.bench_decode_cpu [--heads 9 3 --head-dim 64]

Prints ms per call (best of N) for B in {1, 32, 64} x context in {128, 1024}, fp32 and bf16.
All variants gather the block tables into a dense [B, L, Hkv, D] tensor first; they differ in
how they run attention over it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention_torch import paged_decode_attention

DecodeFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]


def _dense(k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, lens: Tensor) -> tuple:
    block_size = k_cache.shape[1]
    num_blocks = (int(lens.max()) + block_size - 1) // block_size
    ids = block_tables[:, :num_blocks].long()
    keys = k_cache.index_select(0, ids.flatten()).view(*ids.shape, *k_cache.shape[1:])
    values = v_cache.index_select(0, ids.flatten()).view(*ids.shape, *v_cache.shape[1:])
    keys, values = keys.flatten(1, 2), values.flatten(1, 2)
    valid = torch.arange(keys.shape[1])[None, :] < lens[:, None]
    return keys, values, valid


def matmul_rows(q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, lens: Tensor, scale: float):
    """Explicit matmul + fp32 softmax, GQA group as query rows."""
    b, hq, d = q.shape
    hkv = kc.shape[2]
    keys, values, valid = _dense(kc, vc, bt, lens)
    scores = torch.matmul(q.view(b, hkv, hq // hkv, d), keys.permute(0, 2, 3, 1)).float()
    scores.mul_(scale).masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values.transpose(1, 2)).reshape(b, hq, d)


def sdpa_enable_gqa(q: Tensor, kc: Tensor, vc: Tensor, bt: Tensor, lens: Tensor, scale: float):
    """SDPA with one query row per head and enable_gqa."""
    keys, values, valid = _dense(kc, vc, bt, lens)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != kc.shape[2],
    )
    return out.squeeze(2)


VARIANTS: dict[str, DecodeFn] = {
    "matmul_rows": matmul_rows,
    "sdpa_enable_gqa": sdpa_enable_gqa,
    "sdpa_rows (used)": paged_decode_attention,
}


def best_ms(fn: Callable[[], Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    hq, hkv = args.heads
    d, bs = args.head_dim, args.block_size
    g = torch.Generator().manual_seed(0)
    print(f"threads={torch.get_num_threads()} Hq={hq} Hkv={hkv} D={d} block_size={bs}")
    print(f"{'dtype':9}{'B':>4}{'ctx':>6}" + "".join(f"{name:>18}" for name in VARIANTS))
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 32, 64):
            for ctx in (128, 1024):
                per_seq = ctx // bs
                num_blocks = batch * per_seq + 1
                kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
                vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
                perm = torch.randperm(num_blocks - 1, generator=g)[: batch * per_seq]
                bt = perm.view(batch, per_seq).int()
                lens = torch.full((batch,), ctx, dtype=torch.int32)
                lens[0] = ctx - 5  # ragged: one shorter sequence
                q = torch.randn(batch, hq, d, generator=g).to(dtype)
                row = f"{str(dtype).removeprefix('torch.'):9}{batch:>4}{ctx:>6}"
                for fn in VARIANTS.values():
                    ms = best_ms(partial(fn, q, kc, vc, bt, lens, d**-0.5), args.repeats)
                    row += f"{ms:>15.2f} ms"
                print(row, flush=True)


if __name__ == "__main__":
    main()
