"""The only types that cross the server <-> engine process boundary.

Small picklable dataclasses: the engine never sees HTTP, JSON or pydantic; the server never
sees tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, compiled by the engine's grammar engine.

    spec by kind: json_schema: the schema as JSON text; json_object: "" (any JSON object);
    regex: the pattern; choice: a JSON list of the allowed strings; grammar: a Lark grammar."""

    kind: StructuredKind
    spec: str


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()  # EOS and friends; stop *strings* are matched by the server
    logprobs: int | None = None  # None = off, else number of top alternatives per token (0..20)
    # None = off, else the top alternatives given with each prompt token's logprob (0..20); computed in
    # the prefill (moe_serve/engine/prompt_logprobs.py), so a request that does not ask pays nothing
    prompt_logprobs: int | None = None
    # vLLM's extras (moe_serve/engine/sampler.py applies them per row): added to the logits, token id -> bias;
    # min_p keeps tokens at least min_p times as likely as the best; repetition_penalty (1 = off)
    # divides positive / multiplies negative logits of tokens in the prompt or the output; the
    # stop_token_ids cannot be drawn before min_tokens tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    structured: StructuredOutput | None = None  # constrained decoding (response_format, tool_choice)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first
    rank: int | None = None  # tokens at least as likely, itself included (1 = the best); prompt logprobs only


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request since its previous RequestOutput."""

    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    # of prompt tokens 1.. (token 0 has nothing before it), on the first output after the prefill;
    # empty unless params.prompt_logprobs asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    first_token_seconds: float | None = None  # TTFT, set on the first output of a request


@dataclass(frozen=True)
class StepOutputs:
    """The RequestOutputs of one pass of the engine loop (a step, and any rejections or aborts before
    it), sent as one message: the server pays one pickle, one pipe write and one event-loop wake-up
    per step rather than per sequence."""

    outputs: tuple[RequestOutput, ...]


@dataclass(frozen=True)
class EngineReady:
    model_name: str
    max_model_len: int
    vocab_size: int
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineFailed:
    message: str


@dataclass(frozen=True)
class MetricsSnapshot:
    """Cumulative engine-side counters; the server turns them into Prometheus series."""

    cache_hits_per_layer: tuple[int, ...] = ()
    cache_misses_per_layer: tuple[int, ...] = ()
    resident_experts: int = 0
    pcie_bytes_demand: int = 0
    pcie_bytes_prefetch: int = 0
    pcie_wait_seconds: float = 0.0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_accepted_at_position: tuple[int, ...] = ()  # [i]: times draft position i was kept
    spec_needed_per_layer: tuple[int, ...] = ()  # [l]: experts verify passes routed to
    spec_predicted_needed_per_layer: tuple[int, ...] = ()  # [l]: of those, the ones the draft phase predicted
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0
    cpu_expert_computations: int = 0
    num_running: int = 0
    num_waiting: int = 0
    tpot_samples: tuple[float, ...] = ()  # per-token times observed since the last snapshot
    batch_size_samples: tuple[int, ...] = ()  # sequences in each step since the last snapshot
    batch_token_samples: tuple[int, ...] = ()  # tokens fed in each step since the last snapshot
    preemptions: int = 0  # sequences whose KV was freed to be recomputed later
    kv_cache_usage: float = 0.0  # share of KV blocks in use
    expert_format: str = ""  # the routed experts' format (experts/formats/), "" for a dense model
    expert_bytes: int = 0  # one expert slot: the row a miss copies (the largest layer's where layers differ)
