"""A hot path's statement, compiled once and run as the driver's own SQL.

SQLAlchemy does some work on every execution of a Core statement: it looks the statement
up in its compiled cache (a cache key over the whole statement), processes each bound
parameter through its type, builds the result's metadata and runs the result processors.
For the two statements on the way from a dispatch to ``provision()`` — the intake's write
of a batch (:mod:`corral.scheduler.batch`) and the provider worker's claim
(:mod:`corral.worker.claims`), each a statement of several data-modifying CTEs — that work
cost about 0.5 ms a statement in a process woken by its message (its caches cold), as
much as PostgreSQL's own execution of it.

:class:`DriverStatement` compiles such a statement once per dialect and runs the SQL text
with :meth:`Connection.exec_driver_sql`, which keeps what matters of SQLAlchemy: its errors
(a ``DBAPIError`` carrying the driver's, hidden parameters included), the invalidation of a
connection that was lost, and its events. Parameters go through their types' bind
processors, as SQLAlchemy would send them. Results are the driver's values: no result
processors run, so such a statement returns no column whose type processes results
(:class:`corral.shared.store.db.UTCDateTime`, say); JSON comes back decoded by the driver.
An expanding parameter (``IN``) is rendered per length of its list, as SQLAlchemy does:
``= ANY(:array)`` would be one text for every length, but PostgreSQL's generic plan for it
may scan the table where the list's ids are known to be few.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, CursorResult, Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

_PARAMETER = re.compile(r"%\((\w+)\)s")
_EXPANDING = re.compile(r"__\[POSTCOMPILE_(\w+)\]")


class _Compiled:
    """One statement's SQL for one dialect: the constants bound in it (processed once), the
    bind processors of the parameters its callers give, and the expanding ones (``IN``)."""

    def __init__(self, statement: ClauseElement, dialect: Dialect) -> None:
        if dialect.paramstyle != "pyformat":
            raise ValueError(f"DriverStatement needs a pyformat driver, not {dialect.driver}")
        compiled = statement.compile(dialect=dialect)
        if not isinstance(compiled, SQLCompiler):
            raise TypeError("DriverStatement runs SQL statements (not DDL)")
        self.sql = compiled.string
        self.expanding = set(_EXPANDING.findall(self.sql))
        named = set(_PARAMETER.findall(self.sql)) | self.expanding
        self.constants: dict[str, Any] = {}
        self.processors: dict[str, Callable[[Any], Any]] = {}
        for name, bind in compiled.binds.items():
            if name not in named:
                continue  # an anonymous bind's template; its rendered name is here too
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:
                if processor is not None:
                    self.processors[name] = processor
            else:  # a literal of the statement's own
                self.constants[name] = processor(bind.value) if processor else bind.value
        self.required = named - self.constants.keys()
        self._order = tuple(sorted(self.required))  # the expanding lengths' order, too
        self._by_length: dict[tuple[int, ...], str] = {}

    def render(self, given: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The SQL for ``given`` (an expanding parameter's list as that many parameters:
        one text, so one prepared statement, per length) and the parameters to send."""
        missing = self.required - given.keys()
        if missing:
            raise ValueError(f"parameters missing: {', '.join(sorted(missing))}")
        sent = dict(self.constants)
        lengths = []
        for name in self._order:
            processor = self.processors.get(name)
            if name not in self.expanding:
                sent[name] = processor(given[name]) if processor is not None else given[name]
                continue
            values = list(given[name])
            if not values:
                raise ValueError(f"the expanding parameter {name} is empty")
            lengths.append(len(values))
            for number, value in enumerate(values, 1):
                sent[f"{name}_{number}"] = processor(value) if processor is not None else value
        return self._sql(tuple(lengths)), sent

    def _sql(self, lengths: tuple[int, ...]) -> str:
        sql = self._by_length.get(lengths)
        if sql is None:
            sql = self.sql
            for name, length in zip(
                (n for n in self._order if n in self.expanding), lengths, strict=True
            ):
                listed = ", ".join(f"%({name}_{number})s" for number in range(1, length + 1))
                sql = sql.replace(f"__[POSTCOMPILE_{name}]", listed)
            self._by_length[lengths] = sql  # a few lengths: batches are capped
        return sql


class DriverStatement:
    """``statement``, compiled once per dialect, run as driver SQL (see the module)."""

    def __init__(self, statement: ClauseElement) -> None:
        self.statement = statement
        # per engine's dialect, dropped with it (a test process makes many engines)
        self._compiled: weakref.WeakKeyDictionary[Dialect, _Compiled] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def compiled(self, dialect: Dialect) -> _Compiled:
        found = self._compiled.get(dialect)
        if found is None:
            with self._lock:
                found = self._compiled.get(dialect)
                if found is None:
                    found = self._compiled[dialect] = _Compiled(self.statement, dialect)
        return found

    def run(self, connection: Connection, parameters: Mapping[str, Any]) -> CursorResult[Any]:
        """Execute on ``connection`` with ``parameters`` (every bound parameter the statement
        names, by name).

        Raises:
            ValueError: a parameter is missing.
            sqlalchemy.exc.DBAPIError: as :meth:`Connection.execute` raises it.
        """
        sql, sent = self.compiled(connection.dialect).render(parameters)
        return connection.exec_driver_sql(sql, sent)
