"""A burst of engine outputs taken together decodes exactly as the same outputs taken one by one:
text, logprobs, stop strings, tool calls, reasoning, finish_reason and the token count."""
from __future__ import annotations

import asyncio

import pytest
from tiny_tokenizer import build_tiny_tokenizer

from moe_serve.engine.messages import RequestOutput, SamplingParams, TokenLogprob
from moe_serve.server.choice import ChoiceDecoder, ChoiceDelta, TextOptions
from moe_serve.server.output_sink import EngineLost, OutputSink, merge_outputs
from moe_serve.server.reasoning import ReasoningStream
from moe_serve.server.tokenizer import Tokenizer
from moe_serve.server.tool_parsers.hermes import HermesParser
from moe_serve.server.tool_parsers.stream import ToolCallStream, merge_tool_call_deltas


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return Tokenizer(str(path))


def _engine_outputs(tokenizer: Tokenizer, text: str, finish_reason: str = "stop") -> list[RequestOutput]:
    """One output per token, as the engine sends them while decoding; EOS last when it stopped."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids += list(tokenizer.eos_token_ids[:1]) if finish_reason == "stop" else []
    return [RequestOutput("r", (t,), logprobs=(TokenLogprob(t, -0.1 * i, ((t, -0.1 * i), (3, -9.0))),),
                          finish_reason=finish_reason if i == len(ids) - 1 else None, prompt_tokens=4,
                          first_token_seconds=0.01 if i == 0 else None)
            for i, t in enumerate(ids)]


def _decoder(tokenizer: Tokenizer, stops: tuple[str, ...] = (), tools: bool = False,
             reasoning: bool = False) -> ChoiceDecoder:
    params = SamplingParams(max_tokens=200, stop_token_ids=tokenizer.eos_token_ids, logprobs=1)
    return ChoiceDecoder(0, tokenizer, TextOptions(stops=stops), params,
                         ToolCallStream(HermesParser(), None) if tools else None,
                         ReasoningStream("qwen3") if reasoning else None)


def _accumulate(whole: ChoiceDelta, delta: ChoiceDelta) -> None:
    whole.text += delta.text
    whole.logprobs.extend(delta.logprobs)
    merge_tool_call_deltas(whole.tool_calls, delta.tool_calls)
    whole.reasoning += delta.reasoning
    whole.finish_reason = delta.finish_reason or whole.finish_reason


def _through_sink(outputs: list[RequestOutput], burst: int) -> list[list[RequestOutput | EngineLost]]:
    """What a reader that looks once every `burst` outputs takes from the sink."""
    async def run() -> list[list[RequestOutput | EngineLost]]:
        sink, taken = OutputSink(), []
        for start in range(0, len(outputs), burst):
            for output in outputs[start:start + burst]:
                sink.put_nowait(output)
            taken.append(await sink.take())
        return taken
    return asyncio.run(run())


def _decode(decoder: ChoiceDecoder, takes: list[list[RequestOutput | EngineLost]]) -> tuple[ChoiceDelta, int]:
    """The choice whole, and how many deltas (stream chunks) it came in; stops at the choice's end
    as Generation.deltas does."""
    whole, chunks = ChoiceDelta(0), 0
    for items in takes:
        for item in items:
            if decoder.finish_reason is None:
                _accumulate(whole, decoder.consume(item))
                chunks += 1
    return whole, chunks


CASES = {
    "plain": ("Hello, wörld 🙂 and more text", {}),
    "stop string": ("one two STOP three four", {"stops": ("STOP",)}),
    "tool call": ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                  {"tools": True}),
    "reasoning": ("<think>let me see 日本</think>The answer is 4.", {"reasoning": True}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("burst", [3, 1000])
def test_a_burst_decodes_as_one_chunk_equal_to_token_by_token(tokenizer: Tokenizer, case: str, burst: int) -> None:
    text, options = CASES[case]
    outputs = _engine_outputs(tokenizer, text)
    one_by_one = _decoder(tokenizer, **options)
    reference, reference_chunks = _decode(one_by_one, _through_sink(outputs, 1))
    burst_decoder = _decoder(tokenizer, **options)
    merged, chunks = _decode(burst_decoder, _through_sink(outputs, burst))
    if case != "stop string":  # a stop string ends the choice before its last outputs are read
        assert (reference_chunks, chunks) == (len(outputs), -(-len(outputs) // burst))  # one chunk per take
    assert merged.text == reference.text and merged.reasoning == reference.reasoning
    assert merged.logprobs == reference.logprobs
    assert [(c.index, c.name, c.arguments) for c in merged.tool_calls] == \
        [(c.index, c.name, c.arguments) for c in reference.tool_calls]
    assert merged.finish_reason == reference.finish_reason
    assert burst_decoder.completion_tokens == one_by_one.completion_tokens
    if case == "tool call":
        assert merged.finish_reason == "tool_calls" and merged.tool_calls[0].name == "get_weather"
    if case == "stop string":
        assert merged.text == "one two " and merged.finish_reason == "stop"
    if case == "reasoning":
        assert merged.reasoning and merged.text == "The answer is 4."


def test_a_whole_answer_in_one_take_is_one_output(tokenizer: Tokenizer) -> None:
    outputs = _engine_outputs(tokenizer, "abc déf")
    (taken,) = _through_sink(outputs, len(outputs))
    assert len(taken) == 1 and taken[0] == merge_outputs(outputs)
    merged = taken[0]
    assert merged.new_token_ids == tuple(t for o in outputs for t in o.new_token_ids)
    assert merged.logprobs == tuple(lp for o in outputs for lp in o.logprobs)
    assert (merged.finish_reason, merged.prompt_tokens, merged.first_token_seconds) == ("stop", 4, 0.01)


def test_requests_are_merged_apart_and_engine_lost_comes_last() -> None:
    async def run() -> list[RequestOutput | EngineLost]:
        sink = OutputSink()
        for item in (RequestOutput("a", (5,)), RequestOutput("b", (6,)), RequestOutput("a", (7,), finish_reason="length"),
                     EngineLost("gone")):
            sink.put_nowait(item)
        return await sink.take()

    a, b, lost = asyncio.run(run())
    assert (a.request_id, a.new_token_ids, a.finish_reason) == ("a", (5, 7), "length")
    assert (b.request_id, b.new_token_ids) == ("b", (6,)) and lost == EngineLost("gone")
