"""The continuous-batching scheduler and its block bookkeeping, without torch or a model.

A fake step stands in for the model: it marks each chunk computed and, when a chunk reaches a
sequence's last token, appends a token. Invariants are checked after every step.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_serve.engine.kv.block_manager import BlockManager, blocks_for
from moe_serve.engine.messages import SamplingParams
from moe_serve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from moe_serve.engine.sequence import Sequence, SequenceStatus

ROOT = Path(__file__).resolve().parents[2]
STOP = 0


def make_seq(name: str, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,)),
                    seed=0)


def fake_step(scheduler: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Sequence]:
    """What the engine does after the forward: advance, sample where a chunk ends, retire finished."""
    finished = []
    for chunk in out.chunks:
        scheduler.advance(chunk)
        if chunk.samples and chunk.seq.append(token, None, scheduler.config.max_model_len):
            scheduler.finish(chunk.seq)
            finished.append(chunk.seq)
    return finished


def check_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    cfg = scheduler.config
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len(out.chunks) <= cfg.max_num_seqs and len(scheduler.running) <= cfg.max_num_seqs
    assert len({id(c.seq) for c in out.chunks}) == len(out.chunks), "a sequence scheduled twice in one step"
    owned = [b for s in scheduler.running for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block owned twice"
    assert len(owned) + scheduler.blocks.num_free_blocks == cfg.num_blocks, "a block leaked"
    assert all(not s.block_table and s.num_computed_tokens == 0 for s in scheduler.waiting if s.num_preemptions)
    for chunk in out.chunks:
        assert chunk.seq.status is SequenceStatus.RUNNING and chunk.num_tokens >= 1
        assert chunk.start == chunk.seq.num_computed_tokens
        assert len(chunk.seq.block_table) >= blocks_for(chunk.start + chunk.num_tokens, cfg.block_size)
    for seq in out.preempted:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table


def run(scheduler: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 10_000) -> int:
    step = 0
    while scheduler.has_unfinished() or any(k >= step for k in arrivals):
        for seq in arrivals.pop(step, []):
            scheduler.add(seq)
        out = scheduler.schedule()
        check_invariants(scheduler, out)
        fake_step(scheduler, out)
        step += 1
        assert step < max_steps, "no progress: a sequence starves"
    return step


def test_the_scheduler_imports_no_torch():
    code = "import sys, moe_serve.engine.scheduler, moe_serve.engine.kv.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_decodes_batch_and_a_long_prompt_is_chunked_between_them():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=64, block_size=4,
                                  max_model_len=64))
    short = [make_seq(f"s{i}", 2, 10) for i in range(3)]
    for seq in short:
        s.add(seq)
    fake_step(s, s.schedule())  # three prefills of 2 tokens, each samples
    assert [seq.num_tokens for seq in short] == [3, 3, 3]
    long = make_seq("long", 20, 4)
    s.add(long)
    sizes = []
    while long.num_computed_tokens < 20:
        out = s.schedule()
        assert sorted(c.num_tokens for c in out.chunks if c.seq is not long) == [1, 1, 1]  # decodes go on
        sizes.append(next(c.num_tokens for c in out.chunks if c.seq is long))
        fake_step(s, out)
    assert sizes == [5, 5, 5, 5] and len(long.output_ids) == 1  # sampled only when the last chunk ended


def test_admission_waits_for_the_sequence_cap_in_arrival_order():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, num_blocks=64, block_size=4,
                                  max_model_len=64))
    seqs = [make_seq(f"r{i}", 3, 2 + i) for i in range(4)]
    for seq in seqs:
        s.add(seq)
    out = s.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["r0", "r1"]
    fake_step(s, out)
    fake_step(s, s.schedule())  # r0 finishes (2 tokens)
    assert [q.request_id for q in s.running] == ["r1"]
    assert [c.seq.request_id for c in s.schedule().chunks] == ["r1", "r2"]


def test_running_out_of_blocks_preempts_the_youngest_and_recomputes_it():
    # 6 blocks of 4 = 24 positions; two sequences of 6-token prompts growing to 16 tokens each
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=6, block_size=4,
                                  max_model_len=24))
    old, young = make_seq("old", 6, 10), make_seq("young", 6, 10)
    s.add(old)
    s.add(young)
    preempted: list[Sequence] = []
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        check_invariants(s, out)
        preempted += out.preempted
        fake_step(s, out)
        steps += 1
    assert preempted and all(p is young for p in preempted)
    assert young.num_preemptions == len(preempted) and s.num_preemptions == len(preempted)
    assert len(old.output_ids) == 10 and len(young.output_ids) == 10  # nothing lost to the recompute
    assert s.blocks.num_free_blocks == 6


def after_one_step(max_num_seqs: int, num_blocks: int, max_model_len: int,
                   prompts: dict[str, int]) -> tuple[Scheduler, list[Sequence]]:
    """Blocks of 4 positions; sequences of these prompt lengths (10 tokens to generate each) added, one step run."""
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, num_blocks=num_blocks,
                                  block_size=4, max_model_len=max_model_len))
    seqs = [make_seq(name, n, 10) for name, n in prompts.items()]
    for seq in seqs:
        s.add(seq)
    fake_step(s, s.schedule())
    return s, seqs


def two_prefilled() -> tuple[Scheduler, Sequence, Sequence]:
    """6 blocks of 4 positions; two sequences of 6-token prompts, prefilled: 2 blocks each, 2 free."""
    s, (a, b) = after_one_step(4, 6, 24, {"a": 6, "b": 6})
    return s, a, b


def test_speculation_reserves_blocks_for_every_sequence_or_for_none():
    s, a, b = two_prefilled()
    assert not s.reserve([(a, 12), (b, 13)])  # 1 + 2 more blocks: too many, and nobody grew
    assert len(a.block_table) == len(b.block_table) == 2 and s.blocks.num_free_blocks == 2
    assert s.reserve([(a, 12), (b, 9)])
    assert len(a.block_table) == len(b.block_table) == 3 and s.blocks.num_free_blocks == 0


def test_preemption_forgets_what_the_draft_model_computed_too():
    """A draft model's paged cache uses the sequence's blocks: freeing them frees its progress."""
    s, _, young = two_prefilled()
    young.num_draft_computed_tokens = 6
    while not young.num_preemptions:
        fake_step(s, s.schedule())
    assert young.num_computed_tokens == young.num_draft_computed_tokens == 0


def test_finish_frees_every_block_at_once_running_or_waiting():
    s, (a, b) = after_one_step(1, 16, 64, {"a": 9, "b": 3})
    assert len(a.block_table) == 3 and s.find("b") is b
    s.finish(a)
    s.finish(b)
    assert s.blocks.num_free_blocks == 16 and not s.has_unfinished() and s.find("a") is None


def test_a_prompt_that_leaves_no_room_is_refused():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, num_blocks=16, block_size=4,
                                  max_model_len=8))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(make_seq("x", 8, 1))


def test_a_cache_smaller_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="fewer than one sequence"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, num_blocks=1, block_size=4, max_model_len=8)


def test_block_manager_counts_and_refuses_overdraft():
    blocks = BlockManager(3, 4)
    seq = make_seq("a", 1, 1)
    blocks.grow(seq, 9)
    assert len(seq.block_table) == 3 and blocks.usage == 1.0 and not blocks.can_grow(seq, 13)
    with pytest.raises(RuntimeError, match="more KV blocks"):
        blocks.grow(seq, 13)
    blocks.free(seq)
    assert blocks.num_free_blocks == 3 and seq.block_table == []


@settings(max_examples=60, deadline=None)
@given(
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    block_size=st.sampled_from([1, 2, 4, 8]),
    extra_blocks=st.integers(0, 12),
    requests=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=12),
)
def test_every_request_finishes_with_all_its_tokens_under_any_load(max_num_seqs, budget, block_size, extra_blocks,
                                                                   requests):
    """Random arrivals (step, prompt length, max_tokens): invariants hold every step, nothing starves,
    every request gets exactly max_tokens tokens, and all blocks come back."""
    max_model_len = 32
    num_blocks = blocks_for(max_model_len, block_size) + extra_blocks
    s = Scheduler(SchedulerConfig(max_num_seqs, budget, num_blocks, block_size, max_model_len))
    arrivals: dict[int, list[Sequence]] = {}
    seqs = []
    for i, (at, prompt_len, max_tokens) in enumerate(requests):
        seq = make_seq(f"r{i}", prompt_len, max_tokens)
        arrivals.setdefault(at, []).append(seq)
        seqs.append(seq)
    run(s, arrivals)
    for seq in seqs:
        assert seq.is_finished and seq.status is SequenceStatus.FINISHED
        assert len(seq.output_ids) == min(seq.params.max_tokens, max_model_len - len(seq.prompt_ids))
    assert s.blocks.num_free_blocks == num_blocks
