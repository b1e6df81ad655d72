"""Incremental detokenization: generated token ids in, text deltas out, one request at a time.

Byte-level BPE (SmolLM2, Llama 3, Qwen2) often splits one character (an emoji, a CJK
character) over several tokens. Decoding a token alone then yields U+FFFD, so the stream
holds such text back until the character completes, and never emits half a character.

Each step decodes a short window of token ids, never the whole output:

    ids:   ... prompt tail | generated ...........................................
                 ^ prefix_offset       ^ read_offset                     ^ len(ids)
                 |<-- prefix_text ---->|<-- new tokens (maybe pending) -->|
                 |<------------------------- new_text ------------------->|

    prefix_text = decode(ids[prefix_offset:read_offset])   already emitted, kept as context
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]               emitted unless it ends in U+FFFD

The context tokens before `read_offset` are there so that a token decodes as it would
inside the text (a SentencePiece-style decoder strips the leading space of the first token
it sees). After a delta is emitted, the window slides: prefix_offset = read_offset,
read_offset = len(ids), and the ids before the new prefix_offset are dropped. The window
thus holds the tokens of the last emitted delta plus the pending ones, which keeps the
cost per token (and the memory) O(window), not O(output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Trailing prompt tokens decoded as context for the first generated token (vLLM and TGI
# use a handful too: enough for any merge or leading-space rule to see real text).
NUM_CONTEXT_TOKENS = 5

# Text is held back while it ends in U+FFFD. A real character spans at most 4 bytes, so
# at most 4 tokens; a longer pending run means the model produced invalid bytes, and
# holding them forever would make every step decode an ever longer window.
MAX_PENDING_TOKENS = 16

# When pending text is split (see _split_pending), at most this many tokens stay pending:
# enough for the bytes of one incomplete character.
_MAX_SPLIT_TAIL = 4


class TokenDecoder(Protocol):
    """What the detokenizer needs: `tokenizers.Tokenizer` and `ModelTokenizer` both fit."""

    def decode(self, ids: Sequence[int], /, *, skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas that never split a character.

    Invariant: the concatenation of every `add()` result and `finish()` equals
    `tokenizer.decode(generated_ids, skip_special_tokens=...)` for a byte-level BPE
    tokenizer, however the ids are chunked into `add()` calls. For a decoder that strips
    the leading space of what it decodes (SentencePiece), it is the text the output has
    after the prompt instead (" Paris", not "Paris"), as vLLM and TGI stream it too.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the window is kept: ids before prefix_offset are dropped as it slides.
        self._ids: list[int] = self._context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_generated_tokens = 0

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (cheap: the window is a few ids)."""
        clone = object.__new__(IncrementalDetokenizer)
        clone.__dict__.update(self.__dict__)
        clone._ids = list(self._ids)
        return clone

    @property
    def num_generated_tokens(self) -> int:
        return self._num_generated_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Generated tokens whose text is held back (an incomplete character, or no text yet)."""
        return len(self._ids) - self._read_offset

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends generated ids; returns the text that is now complete (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self._num_generated_tokens += len(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR):
            return self._split_pending(prefix_text, num_new_tokens=len(token_ids))
        if len(new_text) <= len(prefix_text) and self.num_pending_tokens <= MAX_PENDING_TOKENS:
            # No visible text yet (a skipped special token): keep the context where it
            # is, so the next real token still decodes next to text.
            return ""
        return self._emit(prefix_text, new_text, len(self._ids))

    def finish(self) -> str:
        """Flushes the held-back text at the end of the stream.

        An incomplete character that never completed is genuinely invalid UTF-8 and comes
        out as U+FFFD here, exactly as a one-shot `decode()` of the whole output shows it.
        """
        if self.num_pending_tokens == 0:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        return self._emit(prefix_text, new_text, len(self._ids))

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The longest tail of the prompt (<= NUM_CONTEXT_TOKENS) whose text ends cleanly.

        A tail whose text ends in U+FFFD would let the first generated bytes complete or
        rewrite it, and the deltas would no longer line up with prefix_text. That happens
        when the tail starts inside a byte-fallback group (shorter tails then fix it), or
        when the prompt itself ends inside a character (raw token-id prompts can): then
        there is no context, and the output decodes as it does alone.
        """
        for size in range(min(NUM_CONTEXT_TOKENS, len(prompt_token_ids)), 0, -1):
            context = list(prompt_token_ids[len(prompt_token_ids) - size :])
            if not self._decode(context).endswith(REPLACEMENT_CHAR):
                return context
        return []

    def _emit(self, prefix_text: str, new_text: str, read_end: int) -> str:
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = read_end - self._read_offset
        return new_text[len(prefix_text) :]

    def _split_pending(self, prefix_text: str, num_new_tokens: int) -> str:
        """Emits the pending tokens but the last few, when that cannot change the text.

        Two cases. A chunk of several new ids (speculative decoding, a slow consumer) may
        end inside a character while the ids before it are complete: emit those now.
        And a pending run longer than MAX_PENDING_TOKENS is invalid bytes: emit up to
        the last few tokens even though that text ends in U+FFFD.

        A split is safe when decoding both sides apart gives the text of decoding them
        together. For UTF-8 lossy decoding (byte-level BPE) the bytes after the split then
        do not continue the sequence before it, so no later byte can either, and the text
        before the split is final. Byte-fallback decoders (SentencePiece) decode a run of
        byte tokens as one group, so outside the forced case a split also needs the text
        before it to end cleanly. When no split is safe, keep holding.
        """
        pending = self._ids[self._read_offset :]
        forced = len(pending) > MAX_PENDING_TOKENS
        # A split that leaves all new ids pending was already tried by the previous call.
        max_tail = min(_MAX_SPLIT_TAIL, len(pending) - 1)
        if not forced:
            max_tail = min(max_tail, num_new_tokens - 1)
        if max_tail < 1:
            return ""
        together = self._decode(pending)
        for tail in range(1, max_tail + 1):
            split = len(pending) - tail
            head_text = self._decode(pending[:split])
            if not forced and head_text.endswith(REPLACEMENT_CHAR):
                continue
            if head_text + self._decode(pending[split:]) == together:
                read_end = self._read_offset + split
                new_text = self._decode(self._ids[self._prefix_offset : read_end])
                return self._emit(prefix_text, new_text, read_end)
        return ""

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
