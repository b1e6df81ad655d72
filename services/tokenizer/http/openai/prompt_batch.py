"""/v1/completions with a batch of prompts (`prompt` as a list of strings or of token-id
lists): one scheduler request per prompt, answered as one response, as vLLM and OpenAI do.

    prompt[i], choice j (n per prompt)  →  choices[i * n + j]     (prompt-major)
    usage                               =  the prompts' usages summed
    a stream                            =  the prompts' chunks interleaved as they come, each
                                           naming its choice by that index; the usage (when
                                           asked for) after the last prompt finished

Each prompt (at most schemas.MAX_PROMPTS) is checked, admitted against its key's limits and
routed on its own; a refusal of any is the whole request's (naming `prompt[i]`), and the ones
admitted before it give their place back. An error in one prompt's stream ends them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from services.contracts.errors import InvalidRequestError
from services.contracts.usage import Usage
from services.tokenizer.generation import GenerationStream, Prepared
from services.tokenizer.output import OutputDelta
from services.tokenizer.validation import GenerateInput

_PROMPT_FIELDS = ("prompt", "prompt_token_ids")


async def prepare_batch(
    inputs: Sequence[GenerateInput], prepare: Callable[[GenerateInput], Awaitable[Prepared]]
) -> list[Prepared]:
    """Each prompt prepared in turn. A refusal names the prompt (`prompt[i]`) when there are
    several; the prompts admitted before it release their key's place."""
    prepared: list[Prepared] = []
    try:
        for index, generate_input in enumerate(inputs):
            try:
                prepared.append(await prepare(generate_input))
            except InvalidRequestError as exc:
                if len(inputs) == 1 or exc.field not in _PROMPT_FIELDS:
                    raise
                raise type(exc)(f"prompt[{index}]", exc.message) from None
    except BaseException:
        for done in prepared:
            if done.admission is not None:
                done.admission.release()
        raise
    return prepared


class BatchStream:
    """The prompts' GenerationStreams as one: `deltas()` renumbers each choice prompt-major
    and ends with the summed usage; `cancel()` ends every scheduler call."""

    def __init__(self, streams: Sequence[GenerationStream], n: int) -> None:
        self._streams = list(streams)
        self._n = n

    def cancel(self) -> None:
        for stream in self._streams:
            stream.cancel()

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        iterators = [stream.deltas() for stream in self._streams]
        # One pending read per prompt: a prompt's next delta is read only once its last one
        # went out, so a slow client lets each prompt's output pile up and merge as a single
        # prompt's does (generation.py), rather than queueing here.
        pending: dict[asyncio.Future[OutputDelta | None], int] = {
            asyncio.ensure_future(anext(iterator, None)): index
            for index, iterator in enumerate(iterators)
        }
        usages: list[Usage] = []
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: pending[f]):  # prompt order
                    prompt_index = pending.pop(future)
                    delta = future.result()  # a prompt's error ends the batch
                    if delta is None:
                        continue
                    if delta.ends_stream:
                        assert delta.usage is not None
                        usages.append(delta.usage)
                    else:
                        pending[asyncio.ensure_future(anext(iterators[prompt_index], None))] = (
                            prompt_index
                        )
                    yield self._renumbered(prompt_index, delta, usages)
        finally:
            for future in pending:
                future.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self.cancel()
            for iterator in iterators:
                await iterator.aclose()  # type: ignore[attr-defined]

    def _renumbered(
        self, prompt_index: int, delta: OutputDelta, usages: list[Usage]
    ) -> OutputDelta:
        """The delta as the batch's: its choice's index, and the usage only on the last
        prompt's last delta (the one that ends the batch), summed over the prompts."""
        index = prompt_index * self._n + delta.index
        if not delta.ends_stream:
            return replace(delta, index=index)
        if len(usages) < len(self._streams):
            return replace(delta, index=index, usage=None, timings=None)
        return replace(
            delta,
            index=index,
            usage=Usage(
                prompt_tokens=sum(u.prompt_tokens for u in usages),
                completion_tokens=sum(u.completion_tokens for u in usages),
                cached_prompt_tokens=sum(u.cached_prompt_tokens for u in usages),
            ),
        )
