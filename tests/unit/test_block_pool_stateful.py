"""Hypothesis state machine over the KV cache manager and its block pool.

Random admit / compute / append / fork / free / evict sequences must never leak or double-free
a block, and every computed token must read back from the KV "contents" a fake device keeps,
which catches wrong prefix hits and missed copy-on-writes. With a sliding window, only the
tokens a next query sees must read back, and blocks before it go back to the pool as the
sequences grow: a block released too early, then reused, fails the read-back.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.contracts.sampling_params import SamplingParams
from services.scheduler.features.sliding_window import RELEASED_BLOCK, num_dead_blocks
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# A tiny alphabet makes shared prefixes, hence prefix hits, common.
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=30)


def is_ready(request: Request) -> bool:
    """Every token computed: the request may append or fork, as between two steps."""
    return request.num_computed_tokens == request.num_tokens


class KVCacheMachine(RuleBasedStateMachine):
    sliding_window = 0

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(
            NUM_BLOCKS, BLOCK_SIZE, watermark=0.1, sliding_window=self.sliding_window
        )
        self.live: dict[str, Request] = {}
        self.allocated_tokens: dict[str, int] = {}
        # What the device would hold: block id -> (position, token) written at each slot; KV
        # depends on the position too (RoPE), so equal tokens elsewhere must not match.
        self.contents: dict[int, list[tuple[int, int] | None]] = {
            b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)
        }
        self.num_created = 0

    def _pick(self, data: st.DataObject, ready: bool = False) -> Request:
        ids = [rid for rid, r in self.live.items() if not ready or is_ready(r)]
        return self.live[data.draw(st.sampled_from(ids))]

    def _apply_copies(self) -> None:
        for src, dst in self.kv.take_pending_copies():
            self.contents[dst] = list(self.contents[src])

    @rule(tokens=tokens_strategy)
    def admit(self, tokens: list[int]) -> None:
        request = Request(f"r{self.num_created}", tokens, SamplingParams(max_new_tokens=64))
        self.num_created += 1
        computed, num_cached = self.kv.get_computed_blocks(request)
        assert num_cached < request.num_tokens
        if self.kv.allocate_slots(request, request.num_tokens - num_cached, computed) is None:
            self.kv.free(request)  # drops the memoized hashes of a request never admitted
            return
        request.num_computed_tokens = num_cached
        self.live[request.request_id] = request
        self.allocated_tokens[request.request_id] = request.num_tokens

    @precondition(
        lambda self: any(r.num_computed_tokens < r.num_tokens for r in self.live.values())
    )
    @rule(data=st.data(), num=st.integers(1, 12))
    def compute(self, data: st.DataObject, num: int) -> None:
        pending = [r for r in self.live.values() if not is_ready(r)]
        request = data.draw(st.sampled_from(pending))
        self._apply_copies()
        table = self.kv.get_block_table(request.request_id)
        end = min(request.num_computed_tokens + num, self.allocated_tokens[request.request_id])
        tokens = request.all_token_ids
        for position in range(request.num_computed_tokens, end):
            block = table[position // BLOCK_SIZE]
            assert self.kv.pool.ref_count(block) == 1, "writing into a shared block"
            self.contents[block][position % BLOCK_SIZE] = (position, tokens[position])
        request.num_computed_tokens = end
        self.kv.cache_full_blocks(request)

    @precondition(
        lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.live.values())
    )
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data: st.DataObject, token: int) -> None:
        request = self._pick(data, ready=True)
        request.output_token_ids.append(token)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(request, 1) is None:
            request.output_token_ids.pop()
            # Nothing taken; blocks out of the window are given back all the same.
            assert free_before <= self.kv.num_free_blocks <= free_before + self._num_dead(request)
            return
        self.allocated_tokens[request.request_id] = request.num_tokens
        # Growing a sequence gives back whatever fell out of its window.
        num_dead = self._num_dead(request)
        table = self.kv.get_block_table(request.request_id)
        assert table[:num_dead] == [RELEASED_BLOCK] * num_dead, table

    def _num_dead(self, request: Request) -> int:
        return num_dead_blocks(request.num_computed_tokens, self.sliding_window, BLOCK_SIZE)

    @precondition(
        lambda self: any(r.num_computed_tokens == r.num_tokens for r in self.live.values())
    )
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self._pick(data, ready=True)
        child = Request(
            f"r{self.num_created}",
            list(parent.prompt_token_ids),
            parent.sampling,
            output_token_ids=list(parent.output_token_ids),
            num_computed_tokens=parent.num_computed_tokens,
        )
        self.num_created += 1
        self.kv.fork(parent.request_id, child.request_id)
        self.live[child.request_id] = child
        self.allocated_tokens[child.request_id] = self.allocated_tokens[parent.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = self._pick(data)
        self.kv.free(request)
        del self.live[request.request_id], self.allocated_tokens[request.request_id]

    @rule(num=st.integers(1, NUM_BLOCKS))
    def evict(self, num: int) -> None:
        """Someone takes free blocks and gives them back: their cached hashes are gone."""
        num = min(num, self.kv.num_free_blocks)
        blocks = self.kv.pool.allocate(num)
        for block in blocks:
            assert self.kv.pool.block_hash(block) is None
        self.kv.pool.free(blocks)

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()

    @invariant()
    def computed_tokens_read_back(self) -> None:
        self._apply_copies()
        for request in self.live.values():
            table = self.kv.get_block_table(request.request_id)
            assert len(table) * BLOCK_SIZE >= self.allocated_tokens[request.request_id]
            tokens = request.all_token_ids
            num_computed = request.num_computed_tokens
            num_released = table.count(RELEASED_BLOCK)
            assert num_released <= num_dead_blocks(num_computed, self.sliding_window, BLOCK_SIZE)
            first_seen = (
                max(0, num_computed - self.sliding_window + 1) if self.sliding_window else 0
            )
            for position in range(first_seen, num_computed):
                slot = self.contents[table[position // BLOCK_SIZE]][position % BLOCK_SIZE]
                assert slot == (position, tokens[position]), (request.request_id, position)


class WindowedKVCacheMachine(KVCacheMachine):
    """The same, in a model whose every layer sees the last 6 tokens (a block and a half)."""

    sliding_window = 6


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
KVCacheMachine.TestCase.settings = SETTINGS
TestKVCacheMachine = KVCacheMachine.TestCase
WindowedKVCacheMachine.TestCase.settings = SETTINGS
TestWindowedKVCacheMachine = WindowedKVCacheMachine.TestCase
