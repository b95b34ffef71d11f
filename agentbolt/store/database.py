"""What a backend provides to the store: transactions over one database.

:class:`~agentbolt.store.sql.SqlStore` writes every statement once, in portable SQL with ``?``
placeholders; a backend (:mod:`.sqlite`, :mod:`.postgres`) supplies connections, transactions
(and statements that commit on their own), the placeholder style, the planner's statistics,
and the few words of SQL that differ between the two.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Database", "Tx"]


class Tx(abc.ABC):
    """One transaction: run statements written with ``?`` placeholders."""

    @abc.abstractmethod
    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    @abc.abstractmethod
    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute; return the number of rows changed."""

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self.all(sql, params)
        return rows[0] if rows else None


class Database(abc.ABC):
    """What a backend provides to :class:`~agentbolt.store.sql.SqlStore`."""

    name: str
    #: how many transactions can run at once (the connection pool's size)
    connections: int = 1
    #: appended to the SELECT that picks the rollout to claim (``FOR UPDATE SKIP LOCKED`` on PostgreSQL)
    claim_lock: str = ""
    #: the schema's portable types as this backend writes them: ``{real}`` (a float column) and
    #: ``{serial}`` (an auto-increasing integer primary key)
    types: Mapping[str, str]

    @abc.abstractmethod
    def transaction(self) -> Any:
        """A context manager yielding a :class:`Tx`; commits on success, rolls back on error."""

    @abc.abstractmethod
    def autocommit(self) -> Any:
        """A context manager yielding a :class:`Tx` whose statements each commit on their own:
        for reads, and for writes that are one statement (on PostgreSQL it saves the BEGIN and
        COMMIT round trips; at READ COMMITTED a transaction of several reads would not read
        one snapshot anyway)."""

    @abc.abstractmethod
    def inserted(self, tables: Sequence[str], rows: int) -> None:
        """``rows`` were just added to ``tables``: the backend may refresh its planner's statistics."""

    @abc.abstractmethod
    def serialize(self, tx: Tx, what: int, on: str = "") -> None:
        """Make transactions that call this with the same ``what`` and ``on`` (e.g. one
        attempt's id) run one after another (until commit)."""

    @abc.abstractmethod
    def lock_schema(self, tx: Tx) -> None:
        """Hold the schema until ``tx`` ends, so that stores opening the same database at once
        migrate it one after another."""

    @abc.abstractmethod
    def close(self) -> None: ...
