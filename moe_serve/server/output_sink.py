"""One HTTP request's outputs from the engine, merged per engine request while its reader is behind.

The engine delivers one RequestOutput per sequence per step. A stream that keeps up takes them
one at a time; one that falls behind (many streams on one event loop) finds several waiting and
takes them as one merged output per choice, so it decodes, encodes and writes once for all of
them, as vLLM's output collector does. Merging loses nothing: the choice decoder feeds tokens one
at a time, so its text, stop strings, tool calls and reasoning do not depend on how the tokens
were grouped.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from moe_serve.engine.messages import RequestOutput


@dataclass(frozen=True)
class EngineLost:
    """Put in a request's sink when the engine process died under it."""

    message: str


class OutputSink:
    def __init__(self) -> None:
        self._pending: dict[str, list[RequestOutput]] = {}  # engine request id -> outputs not yet taken
        self._lost: EngineLost | None = None
        self._waiting = asyncio.Event()

    def put_nowait(self, item: RequestOutput | EngineLost) -> None:
        """Call on the event loop."""
        if isinstance(item, EngineLost):
            self._lost = item
        else:
            self._pending.setdefault(item.request_id, []).append(item)
        self._waiting.set()

    async def take(self) -> list[RequestOutput | EngineLost]:
        """Wait for something, then all of it: one merged output per engine request (in the order
        their first outputs came), then the EngineLost if the engine died."""
        await self._waiting.wait()
        self._waiting.clear()
        pending, self._pending = self._pending, {}
        items: list[RequestOutput | EngineLost] = [merge_outputs(outputs) for outputs in pending.values()]
        if self._lost is not None:
            items.append(self._lost)
        return items


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: tokens, logprobs and prompt logprobs in order; the
    end (finish_reason, error) from the last; the prompt size and TTFT from the first that has them."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=tuple(t for o in outputs for t in o.new_token_ids),
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
        prompt_logprobs=tuple(lp for o in outputs for lp in o.prompt_logprobs),
        finish_reason=last.finish_reason,
        error=last.error,
        prompt_tokens=next((o.prompt_tokens for o in outputs if o.prompt_tokens), 0),
        first_token_seconds=next((o.first_token_seconds for o in outputs if o.first_token_seconds is not None), None),
    )
