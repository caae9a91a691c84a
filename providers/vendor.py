"""The base of the vendor providers (e2b, modal, daytona, vercel, agentrun): the common work.

A vendor provider reaches a cloud API with one credential per org. What every one of them
does the same way lives here, once:

* what an HTTP status from the vendor means (:data:`STATUS_ANSWERS`, one answer per status
  for every built-in provider; the kubernetes and docker providers read the same table)
  and the error that answer becomes (:meth:`VendorProvider.status_error`);
* the message for a rejected credential, which names the one to fix;
* the key lookup: the org's stored credential, else ``CORRAL_<ID>_API_KEY``
  (:mod:`corral.providers.credentials`); without an org, the environment's alone;
* the health check: find the key, make one authenticated read-only call, say whose key the
  vendor answered to.

A vendor fills in a few primitives: its names (``vendor``, ``api_name``), what its
credential is called, and :meth:`VendorProvider._probe`; its SDK error translation reads
the status its SDK carries and asks :meth:`VendorProvider.status_error` for the answer.
"""

from __future__ import annotations

import enum
from abc import abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from pydantic import SecretStr

from corral.providers.base import ProviderHealth, SandboxProvider
from corral.providers.credentials import CredentialResolver, credential_env_var, resolve_credential
from corral.providers.errors import (
    CredentialMissingError,
    CredentialRejectedError,
    ProviderError,
    ProviderTimeoutError,
    ProviderUnavailableError,
    RateLimitedError,
    SandboxCreateError,
    SandboxNotRunningError,
)

RATE_LIMITED = 429  # a transient answer of its own: a paced provider's items wait for it


class StatusAnswer(enum.Enum):
    """What an HTTP status from a provider's API means to corral."""

    CREDENTIAL_REJECTED = "credential rejected"  # permanent: the message names the key
    NOT_FOUND = "not found"  # permanent: the sandbox (or what was asked for) is gone
    TRANSIENT = "transient"  # retry later
    REFUSED = "refused"  # permanent: the request itself was refused

    def error(self, *, creating: bool = False) -> type[ProviderError]:
        """The provider error this answer becomes. What is not found while a sandbox is
        being made is what it is made from (a template, an image): it cannot be made."""
        if creating and self is StatusAnswer.NOT_FOUND:
            return SandboxCreateError
        return _ERRORS[self]


_ERRORS: Mapping[StatusAnswer, type[ProviderError]] = {
    StatusAnswer.CREDENTIAL_REJECTED: CredentialRejectedError,
    StatusAnswer.NOT_FOUND: SandboxNotRunningError,
    StatusAnswer.TRANSIENT: ProviderUnavailableError,
    StatusAnswer.REFUSED: SandboxCreateError,
}

# One answer per HTTP status, for every built-in provider. A status not listed is transient
# from 500 up and refused below. Answers a caller expects (a 404 on a delete, a 409 from a
# second delivery of the same create) are caught by that caller before it asks the table.
STATUS_ANSWERS: Mapping[int, StatusAnswer] = {
    401: StatusAnswer.CREDENTIAL_REJECTED,
    403: StatusAnswer.CREDENTIAL_REJECTED,
    404: StatusAnswer.NOT_FOUND,
    410: StatusAnswer.NOT_FOUND,  # gone: deleted
    408: StatusAnswer.TRANSIENT,  # the vendor stopped waiting for our request: send it again
    # 409 is transient: the conflicts a caller can foresee (a name already taken by its own
    # earlier attempt) are caught by the caller, so what reaches the table is the resource
    # changing state under the call (a sandbox starting, pausing or being deleted; a
    # Kubernetes object's resourceVersion moved on), which passes once the change is over.
    # Failing the work for it would turn a race into a lost item; a retry is bounded.
    409: StatusAnswer.TRANSIENT,
    429: StatusAnswer.TRANSIENT,  # rate limited, or no capacity for now
}


def status_answer(status: int) -> StatusAnswer:
    """The one answer for an HTTP ``status`` (a real one: no status is the caller's to
    judge, as a transport failure)."""
    answer = STATUS_ANSWERS.get(status)
    if answer is not None:
        return answer
    return StatusAnswer.TRANSIENT if status >= 500 else StatusAnswer.REFUSED


class VendorProvider(SandboxProvider):
    """A cloud vendor's sandboxes, one credential per org: error answers, key, health.

    Subclasses set ``vendor`` and ``api_name`` and implement :meth:`_probe`.
    """

    vendor: ClassVar[str]  # the vendor's name in messages, e.g. "E2B"
    api_name: ClassVar[str]  # what the health check reached, e.g. "the E2B API"
    credential_noun: ClassVar[str] = "API key"
    credential_form: ClassVar[str] = ""  # how a stored one is written, e.g. " (id:secret)"
    credential_hint: ClassVar[str] = ""  # more to check when one is rejected
    # The errors of the probe that make the provider unhealthy rather than raise.
    unhealthy_errors: ClassVar[tuple[type[ProviderError], ...]] = (
        ProviderUnavailableError,
        ProviderTimeoutError,
        CredentialRejectedError,
    )

    # -- the key lookup ----------------------------------------------------------------------

    def _api_key(self, org_id: str) -> SecretStr:
        """The org's stored credential, else ``CORRAL_<ID>_API_KEY``.

        Raises:
            CredentialMissingError: neither is set; says how to set either.
        """
        return resolve_credential(org_id, self.id, resolver=self.credentials)

    def _deployment_key(self) -> SecretStr | None:
        """``CORRAL_<ID>_API_KEY`` alone, for calls that belong to no org."""
        return (self.credentials or CredentialResolver()).environment_credential(self.id)

    def _key(self, org_id: str | None) -> SecretStr:
        """The org's key; without an org, the deployment's.

        Raises:
            CredentialMissingError: there is none; says where to set it.
        """
        if org_id is not None:
            return self._api_key(org_id)
        key = self._deployment_key()
        if key is None:
            raise CredentialMissingError(
                f"{credential_env_var(self.id)} is not set; check an org's stored one with "
                f"`corral providers check {self.id} --org ORG`"
            )
        return key

    def _inventory_key(self) -> SecretStr:
        """The deployment's key, which listing its sandboxes (no org) needs.

        Raises:
            CredentialMissingError: ``CORRAL_<ID>_API_KEY`` is not set.
        """
        key = self._deployment_key()
        if key is None:
            raise CredentialMissingError(
                f"listing this deployment's {self.vendor} sandboxes needs "
                f"{credential_env_var(self.id)} in the maintenance worker's environment"
            )
        return key

    # -- errors ----------------------------------------------------------------------------------

    def status_error(
        self,
        status: int,
        action: str,
        org_id: str | None,
        detail: str,
        *,
        said: str = "",
        creating: bool = False,
    ) -> ProviderError:
        """corral's error for an HTTP ``status`` the vendor answered while ``action`` ran.

        ``detail`` is the vendor's words (never a credential); ``said`` how the status is
        shown, when the vendor's protocol has a name of its own for it; ``creating`` whether
        the call was making the sandbox.
        """
        code = said or str(status)
        words = f": {detail}" if detail else ""
        answer = status_answer(status)
        if answer is StatusAnswer.CREDENTIAL_REJECTED:
            return CredentialRejectedError(self.rejected_message(action, org_id, code))
        if status == RATE_LIMITED:
            return RateLimitedError(
                f"{self.vendor} refused {action} for its rate limit or quota ({code}){words}"
            )
        if answer is StatusAnswer.TRANSIENT:
            return ProviderUnavailableError(
                f"{self.vendor} is busy or failing while {action} ({code}); retry later{words}"
            )
        if answer is StatusAnswer.NOT_FOUND:
            error = answer.error(creating=creating)
            return error(f"{self.vendor}: not found while {action} ({code}){words}")
        return SandboxCreateError(f"{self.vendor} refused {action} ({code}){words}")

    def rejected_message(self, action: str, org_id: str | None, status: str) -> str:
        """What to fix when the vendor rejected the credential: the org's stored one, else
        the environment's."""
        variable = credential_env_var(self.id)
        rejected = f"{self.vendor} rejected the {self.credential_noun}"
        if org_id is None:
            text = f"{rejected} in {variable} ({status}) while {action}: fix {variable}"
        else:
            text = (
                f"{rejected} for org {org_id!r} ({status}) while {action}: store a valid "
                f"one{self.credential_form} with `corral credentials set --org {org_id} "
                f"--provider {self.id}`, or fix {variable} if the org has none stored"
            )
        return text + self.credential_hint

    # -- the health check ----------------------------------------------------------------------

    def health_check(self, org_id: str | None = None) -> ProviderHealth:
        """One authenticated, read-only call with the org's key (without an org, the
        deployment's); unhealthy with the reason when there is no key or the call fails."""
        problem = self._config_problem()
        if problem:
            return ProviderHealth(healthy=False, message=problem)
        try:
            key = self._key(org_id)
        except CredentialMissingError as exc:
            return ProviderHealth(healthy=False, message=f"no credential: {exc.message}")
        try:
            self._probe(key, org_id)
        except self.unhealthy_errors as exc:
            return ProviderHealth(healthy=False, message=exc.message)
        whose = f"org {org_id}'s credential" if org_id is not None else credential_env_var(self.id)
        return ProviderHealth(healthy=True, message=f"{self._api_description()} answers to {whose}")

    def _config_problem(self) -> str | None:
        """What the configuration lacks for any call, if anything."""
        return None

    def _api_description(self) -> str:
        return self.api_name

    @abstractmethod
    def _probe(self, key: SecretStr, org_id: str | None) -> None:
        """One authenticated, read-only call with ``key``.

        Raises:
            CredentialRejectedError: the vendor rejected the key.
            ProviderUnavailableError, ProviderTimeoutError: the vendor could not answer.
        """
