"""The Responses API's store: the newest stored responses (body and conversation) for GET
/v1/responses/{id} and previous_response_id, in SQLite, so that every API server process of one
server (--api-server-count) finds a response whichever process stored it."""
from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from moe_serve.server.errors import APIError

MAX_STORED_RESPONSES = 256
MAX_STORED_CHARACTERS = 32 * 2**20  # of their conversations: with 4 MiB bodies, 256 could hold 1 GiB
BUSY_TIMEOUT_SECONDS = 10.0  # the longest a call waits for another process's write


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as GET returns it
    conversation: tuple[dict[str, Any], ...]  # its chat messages and its answer, for previous_response_id

    @property
    def size(self) -> int:
        return sum(len(json.dumps(message)) for message in self.conversation)


class ResponseStore:
    """The newest stored responses, within a count and a size (the oldest go first), in SQLite: a private
    database file when path is None, else the file at path, which every API server process of one server
    opens (--api-server-count), so a GET or a previous_response_id finds a response whichever process
    stored it. Each process and thread gets its own connection, as sqlite requires; the rows are JSON."""

    def __init__(self, path: str | None = None, max_responses: int = MAX_STORED_RESPONSES,
                 max_characters: int = MAX_STORED_CHARACTERS) -> None:
        self._private = tempfile.TemporaryDirectory(prefix="moe-serve-responses-") if path is None else None
        self._path = path if self._private is None else os.path.join(self._private.name, "responses.sqlite3")
        self._max_responses, self._max_characters = max_responses, max_characters
        self._local = threading.local()
        self._connection()  # the table exists before the first request

    def put(self, stored: StoredResponse) -> None:
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT OR REPLACE INTO responses (id, size, body, conversation) VALUES (?, ?, ?, ?)",
                       (stored.body["id"], stored.size, _json(stored.body), _json(stored.conversation)))
            db.execute(_TRIM, (self._max_characters, self._max_responses))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        row = self._connection().execute("SELECT body, conversation FROM responses WHERE id = ?",
                                         (response_id,)).fetchone()
        if row is None:
            raise APIError(404, f"no stored response with id '{response_id}' (the newest {self._max_responses} "
                           f"responses are kept, when store is not false)", param=param,
                           code="response_not_found")
        return StoredResponse(json.loads(row[0]), tuple(json.loads(row[1])))

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection; a new one in a child process, since a connection never crosses a fork."""
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            # isolation_level None: put's transaction is explicit; timeout is sqlite's busy timeout
            db = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
            _wal(db)
            db.execute("PRAGMA synchronous=NORMAL")  # a lost response is no harm: no fsync per put
            db.execute(_SCHEMA)
            local.db, local.pid = db, os.getpid()
        return local.db


def _wal(db: sqlite3.Connection) -> None:
    """WAL journal mode, so readers never wait for the writer. Switching a new file to it fails at once,
    without the busy timeout, while another process opens the file too: that is retried."""
    deadline = time.monotonic() + BUSY_TIMEOUT_SECONDS
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


# the INTEGER PRIMARY KEY is the rowid: the table is its own index on insertion order; size comes before
# the bodies, so trimming reads no overflow pages of theirs
_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, size INTEGER NOT NULL, body TEXT NOT NULL,
    conversation TEXT NOT NULL)"""
# everything from the newest response past either bound down to the oldest
_TRIM = """DELETE FROM responses WHERE seq <= (
    SELECT MAX(seq) FROM (SELECT seq, SUM(size) OVER newest_first AS characters, ROW_NUMBER() OVER newest_first AS n
                          FROM responses WINDOW newest_first AS (ORDER BY seq DESC))
    WHERE characters > ?1 OR n > ?2)"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
