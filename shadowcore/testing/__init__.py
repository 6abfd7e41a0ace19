"""Kit for plugin and backend authors: hypothesis strategies, state machines, a policy conformance check
(``conformance.check_policy``) and the backend contract's check (:func:`check_backend`, the contract of
:mod:`shadowcore.backend`). Needs the ``dev`` extra (hypothesis) for strategies and machines."""

from shadowcore.testing.backend_check import BackendContractError, BackendReport, check_backend

__all__ = ["BackendContractError", "BackendReport", "check_backend"]
