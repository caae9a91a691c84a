"""An unreachable or misconfigured database or broker, said in one line.

Whatever command or process meets one (the CLI's commands, ``corral api`` and its children,
the scheduler and workers as they start), it ends with one line naming the setting to fix and
the address it used, never the password, and a non-zero status (:data:`EXIT_UNREACHABLE`),
instead of the driver's traceback.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kombu.utils.url import sanitize_url
from sqlalchemy.engine import make_url

from corral.shared.logs import redact

EXIT_UNREACHABLE = 3


def _first_line(exc: BaseException, *, secret: str | None) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    text = text.removeprefix("connection failed: ")
    line = next((part.strip() for part in text.splitlines() if part.strip()), type(exc).__name__)
    if secret:
        line = line.replace(secret, "***")
    return redact(line)


def explain(exc: BaseException) -> str | None:
    """One line for a database or broker that cannot be reached or refuses corral; None for
    any other error."""
    from corral.shared.settings import CoreSettings

    try:
        settings = CoreSettings()
    except Exception:  # the settings themselves are wrong: said elsewhere
        return None
    database = settings.resolved_database_url()
    if _is_database_error(exc):
        why = _first_line(exc, secret=urlsplit(database).password)
        return (
            f"cannot use the database at {make_url(database).render_as_string()} "
            f"(CORRAL_DATABASE_URL): {why}"
        )
    if _is_broker_error(exc):
        broker = settings.broker_url
        why = _first_line(exc, secret=urlsplit(broker).password)
        return f"cannot use the broker at {sanitize_url(broker)} (CORRAL_BROKER_URL): {why}"
    return None


def _is_database_error(exc: BaseException) -> bool:
    from sqlalchemy.exc import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)


def _is_broker_error(exc: BaseException) -> bool:
    import amqp.exceptions
    import kombu.exceptions
    import redis.exceptions

    return isinstance(
        exc,
        kombu.exceptions.OperationalError
        | redis.exceptions.ConnectionError
        | redis.exceptions.AuthenticationError
        | redis.exceptions.ResponseError
        | amqp.exceptions.AccessRefused
        | amqp.exceptions.ConnectionError,
    )
