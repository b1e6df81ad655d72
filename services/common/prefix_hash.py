"""Chained hashes of full KV blocks: the names under which a prefix is cached.

Shared by the scheduler (its block pool's cache keys, published to Redis) and the tokenizer
tier (which hashes a prompt the same way to ask Redis where its prefix is cached). Stable
across processes and machines: blake2b over little-endian token ids, never Python's hash().
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Parent of the first block. Every parent is exactly DIGEST_SIZE bytes and every full block
# has the same token count, so the hashed byte strings cannot be ambiguous.
DIGEST_SIZE = 32
_ROOT_HASH = bytes(DIGEST_SIZE)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Chained hash of one full block.

    `extra_key` separates caches that must not share KV (e.g. a tenant salt, a LoRA id).
    """
    hasher = hashlib.blake2b(digest_size=DIGEST_SIZE)
    hasher.update(parent_hash if parent_hash is not None else _ROOT_HASH)
    hasher.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_key:
        # Length-prefixed so (tokens, key) pairs cannot alias each other.
        hasher.update(struct.pack("<I", len(extra_key)) + extra_key)
    return hasher.digest()


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: bytes = b"",
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, first block first.

    The salt enters the first block only: every later hash chains from it, so two salts never
    share a block anywhere in the chain.
    """
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for index in range(num_blocks):
        start = index * block_size
        parent = hash_block_tokens(
            parent, token_ids[start : start + block_size], cache_salt if index == 0 else b""
        )
        hashes.append(parent)
    return hashes


def tenant_salt(tenant_id: str) -> bytes:
    """The cache salt of a tenant id (empty: no tenant, the shared cache)."""
    if not tenant_id:
        return b""
    return hashlib.blake2b(tenant_id.encode(), digest_size=16, person=b"llmserve-tenant").digest()


def adapter_salt(cache_salt: bytes, lora_name: str) -> bytes:
    """The cache salt of a request run with a LoRA adapter: its KV differs from the base
    model's and every other adapter's, so its blocks are cached apart. Empty name: the salt
    as it is. A salt of fixed length (not a concatenation), so no tenant salt and adapter
    name can combine into another pair's."""
    if not lora_name:
        return cache_salt
    hasher = hashlib.blake2b(digest_size=16, person=b"llmserve-lora")
    hasher.update(len(cache_salt).to_bytes(4, "little") + cache_salt)
    hasher.update(lora_name.encode())
    return hasher.digest()
