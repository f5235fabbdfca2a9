"""Continuous batching: which sequences run in the next step, and how many of their tokens (no torch).

Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):
  1. running sequences first, in arrival order: a decode feeds its one pending token, a prefill
     in progress its next chunk; when the KV blocks run out, the most recently arrived running
     sequence is preempted (its blocks freed, its KV recomputed later from its tokens) until the
     older one fits, so a long generation holding many blocks never starves an older request;
  2. then, unless someone was preempted this step, waiting sequences in arrival order (preempted
     ones at the front) while the budget, the cap and the free blocks allow: a long prompt is cut into chunks, so the decodes of the
     running sequences go on every step while it is being prefilled.
A sequence samples a token in a step only when that step's chunk reaches its last token.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moe_serve.engine.kv.block_manager import BlockManager
from moe_serve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than one "
                             f"sequence of max_model_len {self.max_model_len}: give it more memory or lower "
                             "--max-model-len")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position fed (seq.num_computed_tokens when scheduled)
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.seq.all_ids[self.start : self.start + self.num_tokens]

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so the step samples the next one."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(f"{seq.request_id}: {seq.num_tokens} tokens leave no room under max_model_len "
                             f"{self.config.max_model_len}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in (*self.running, *self.waiting) if s.request_id == request_id), None)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished, aborted or failed sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted by an older sequence in this very loop, or no budget left
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, preempted):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        # after a preemption the blocks are short: admitting anyone now would only thrash
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                break  # arrival order: nothing younger jumps ahead of it
            self.waiting.popleft()
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(chunks, preempted)

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Grow seq's blocks to num_tokens, preempting the youngest running sequences as needed;
        False when seq itself was the youngest and got preempted."""
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks now, keep the tokens, go back to the front of the queue."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def reserve(self, wanted: list[tuple[Sequence, int]]) -> bool:
        """Grow each running seq's blocks to hold its first n positions, all or none (speculation's
        drafted positions: when the blocks are short the step decodes plainly instead)."""
        missing = sum(self.blocks.blocks_missing(seq, n) for seq, n in wanted)
        if missing > self.blocks.num_free_blocks:
            return False
        for seq, n in wanted:
            self.blocks.grow(seq, n)
        return True

    def advance(self, chunk: ScheduledChunk) -> None:
        """The step computed chunk's tokens: they are in the KV cache now."""
        chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
