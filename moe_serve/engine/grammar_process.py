"""The grammar process: where constrained sequences' llguidance matchers live. Each step the engine
sends it one message (the tokens to consume, the rows to fill) and reads one reply; the process
consumes the tokens and writes each row's mask into memory the two share.

Why a process of its own. A thread of the engine's process needs the GIL whenever it takes a job or
comes back from llguidance, and each such hand-off stalls the engine thread for longer than the
hand-off: beside engine-like host work (tiny torch ops and Python, ~0.5 ms a step), the same
llguidance work a step (consume 32 tokens, fill 32 rows of the bench's JSON array, 280-465 us alone)
made that host work 1.28-1.44x as long on a thread of the same process and 1.00-1.03x in another
process (a 2-core CPU host, blocks of 100 steps in turn, median of 10-20 blocks each; a probe not
kept). The engine thread here only sends a message and reads a reply, both kept small: a step with
the rows of the step before sends only its tokens, and the reply names only the matchers that
completed or failed.

Messages, each a pickled tuple over a Unix socket pair, in order:
    engine -> process  ("tokenizer", tokenizer_json, n_vocab, eos_token)  first, once
                       ("rows", slot_rows, row_bytes), then the rows' memory as a file descriptor
                       ("step", new, free, fill, tokens, size, slot)
    process -> engine  (completed, errors)  for each step, in order
`new` lists (id, grammar) to compile, `free` the ids of matchers whose sequences are gone, `fill`
(id, row) pairs, or None for the last step's; `tokens` holds one token per pair, consumed before the
fill, or is None. The rows of slot `slot` past `fill`'s, up to `size`, allow every token. `completed`
maps the id of a matcher whose grammar a token completed to its count of consumed tokens then, and
`errors` the id of one that failed to why. The engine alternates two slots: a step's fill may start
before the masks of the step before it were copied out.
"""
from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    import torch

    from moe_serve.engine.structured import GrammarMatcher, StepGrammars

SLOTS = 2


class MatcherHost:
    """The process's side: the matchers by id, and the memory their rows are written to."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.tokenizer: llguidance.LLTokenizer | None = None
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        self.consumed: dict[int, int] = {}  # tokens each matcher consumed
        self.fill: list[tuple[int, int]] = []  # the last step's (id, row) pairs
        self.memory: mmap.mmap | None = None
        self.address = 0  # of memory's first byte
        self.slot_bytes = self.row_bytes = 0

    def serve(self) -> None:
        """Until the engine closes its end (with replies unread, which resets the connection)."""
        try:
            while True:
                self.handle(*pickle.loads(self.conn.recv_bytes()))
        except (EOFError, ConnectionResetError, BrokenPipeError):
            return

    def handle(self, kind: str, *args) -> None:
        if kind == "tokenizer":
            tokenizer_json, n_vocab, eos_token = args
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos_token)
        elif kind == "rows":
            self._map(*args, recv_handle(self.conn))
        else:
            self.conn.send_bytes(pickle.dumps(self.step(*args)))

    def _map(self, slot_rows: int, row_bytes: int, fd: int) -> None:
        self.slot_bytes, self.row_bytes = slot_rows * row_bytes, row_bytes
        self.memory = mmap.mmap(fd, SLOTS * self.slot_bytes)
        os.close(fd)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))

    def step(self, new: list[tuple[int, str]], free: list[int], fill: list[tuple[int, int]] | None,
             tokens: list[int] | None, size: int, slot: int) -> tuple[dict[int, int], dict[int, str]]:
        completed: dict[int, int] = {}
        errors: dict[int, str] = {}  # a matcher that fails fails its own sequence, never the process
        for i in free:
            self.matchers.pop(i, None)
            self.consumed.pop(i, None)
        for i, grammar in new:
            self.consumed[i] = 0
            try:
                self.matchers[i] = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            except Exception as exc:  # noqa: BLE001
                errors[i] = str(exc)
        if fill is not None:
            self.fill = fill
        for (i, _), token in zip(self.fill, tokens or ()):
            self._consume(i, token, completed, errors)
        base = self.address + slot * self.slot_bytes
        if len(self.fill) < size:  # a row without a grammar allows every token
            ctypes.memset(base, 0xFF, size * self.row_bytes)
        for i, row in self.fill:
            if i not in errors:
                try:
                    self.matchers[i].unsafe_compute_mask_ptr(base + row * self.row_bytes, self.row_bytes)
                except Exception as exc:  # noqa: BLE001
                    errors[i] = str(exc)
                if i not in errors and self.matchers[i].is_error():
                    errors[i] = self.matchers[i].get_error().strip()
        return completed, errors

    def _consume(self, i: int, token: int, completed: dict[int, int], errors: dict[int, str]) -> None:
        if i in errors:
            return
        matcher = self.matchers[i]
        self.consumed[i] += 1
        try:
            if matcher.consume_token(token) and matcher.is_stopped():  # nothing but EOS can follow
                completed[i] = self.consumed[i]
        except Exception as exc:  # noqa: BLE001
            errors[i] = str(exc)


@dataclass(eq=False)
class Job:
    """A step sent to the process: what its reply updates, and where its masks are written."""

    by_id: dict[int, GrammarMatcher]  # every matcher the step names
    rows: torch.Tensor  # [slot rows, W] its slot of the shared memory
    done: bool = False  # its reply was read, or the process ended first


class GrammarProcess:
    """The engine's side: starts the process, registers matchers with it, sends steps and reads
    their replies (only ever on the engine thread, so the matchers' state needs no lock). If the
    process ends, each matcher it held fails (GrammarMatcher.failure); Grammars starts another for
    new sequences."""

    def __init__(self, tokenizer_spec: tuple[str, int | None, int | None]) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)  # the child imports this package from where the engine did
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.child = subprocess.Popen([sys.executable, "-m", "moe_serve.engine.grammar_process", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ended: str | None = None  # why the process takes no more steps
        self.failed = False  # whether any matcher it held failed: only then are a step's matchers checked
        self._ids = itertools.count()  # matchers'
        self._sent: list[Job] = []  # in order, replies not yet read
        self._free: list[int] = []  # ids of matchers collected since the last step
        self._slots: torch.Tensor | None = None  # [SLOTS, slot rows, W] the shared memory
        self._parity = 0  # the next job's slot
        # the rows the process has: the step, its matchers there by id, the positions of those in its rows
        self._last: tuple[StepGrammars, dict[int, GrammarMatcher], list[int]] | None = None
        self._send(("tokenizer", *tokenizer_spec))

    def submit(self, step: StepGrammars, tokens: list[int] | None) -> Job:
        """Send a step: consume `tokens` (one per constrained row, when given), then fill each
        constrained row's mask."""
        if self._last is not None and self._last[0] is step:  # the rows the process has: only the tokens
            new, fill, by_id, live = [], None, self._last[1], self._last[2]
        else:
            new = [(self._register(g), g.grammar) for _, g in step.rows if g.process is None]
            live = [k for k, (_, g) in enumerate(step.rows) if g.process is self]
            for _, grammar in step.rows:
                if grammar.process is not self:  # held by a process that ended
                    grammar.failure = grammar.failure or grammar.process.ended
                    self.failed = True
            fill = [(step.rows[k][1].gid, step.rows[k][0]) for k in live]
            by_id = {step.rows[k][1].gid: step.rows[k][1] for k in live}
            self._last = step, by_id, live
        if tokens is not None and len(live) < len(step.rows):
            tokens = [tokens[k] for k in live]
        job = Job(by_id, self._slots_for(step.size, step.rows[0][1].mask_words)[self._parity])
        free, self._free = self._free, []
        self._sent.append(job)
        self._send(("step", new, free, fill, tokens, step.size, self._parity))
        self._parity ^= 1
        return job

    def wait(self, job: Job) -> None:
        """Until the job's reply is read (every earlier job's is applied on the way)."""
        while not job.done:
            try:
                completed, errors = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError) as exc:
                self._end(f"the grammar process ended ({exc or f'exit status {self.child.poll()}'})")
                return
            self._apply(self._sent.pop(0), completed, errors)

    def close(self) -> None:
        """The process exits once it has read every step sent before."""
        self._end("the grammar process was closed")
        self.conn.close()
        try:
            self.child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()

    def _register(self, grammar: GrammarMatcher) -> int:
        grammar.process, grammar.gid = self, next(self._ids)
        weakref.finalize(grammar, self._free.append, grammar.gid)  # its sequence is gone: so is the matcher
        return grammar.gid

    def _apply(self, job: Job, completed: dict[int, int], errors: dict[int, str]) -> None:
        for i, consumed in completed.items():
            job.by_id[i].complete_at = consumed
        for i, why in errors.items():
            job.by_id[i].failure = job.by_id[i].failure or why
        self.failed = self.failed or bool(errors)
        job.done = True

    def _slots_for(self, size: int, width: int) -> torch.Tensor:
        import torch  # here, not at the top: the process itself imports this module, and needs no torch

        if self._slots is None or self._slots.shape[1] < size:
            rows = 1 << max(3, (size - 1).bit_length())  # a power of two: a growing batch remaps a few times
            length = SLOTS * rows * width * 4
            fd = os.memfd_create("moe-serve-masks")
            os.ftruncate(fd, length)
            memory = mmap.mmap(fd, length)
            self._send(("rows", rows, width * 4))
            if self.ended is None:
                send_handle(self.conn, fd, self.child.pid)
            os.close(fd)
            self._slots = torch.frombuffer(memory, dtype=torch.int32).view(SLOTS, rows, width)
        return self._slots

    def _send(self, message: tuple) -> None:
        if self.ended is None:
            try:
                self.conn.send_bytes(pickle.dumps(message))
            except OSError as exc:
                self._end(f"the grammar process ended ({exc})")
        if self.ended is not None and message[0] == "step":
            self._end(self.ended)  # so is this step: its matchers fail

    def _end(self, why: str) -> None:
        self.ended, self.failed = why, True
        for job in self._sent:
            for grammar in job.by_id.values():
                grammar.failure = grammar.failure or why
            job.done = True
        self._sent.clear()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the engine's close ends this
    MatcherHost(Connection(int(sys.argv[1]))).serve()
