"""Errors the core raises. Each names what is wrong: a field and its value, a
plugin and its group, a file and its line."""

from __future__ import annotations


class ShadowError(Exception):
    """Base class of every error shadowprefill raises on purpose."""


class ConfigError(ShadowError, ValueError):
    """A configuration value is invalid. The message starts with the field path."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        super().__init__(f"{field} = {value!r}: {problem}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its three parts when it crosses a process boundary (worker
        # processes of a sweep), not from the formatted message.
        return (type(self), (self.field, self.value, self.problem))


class PluginError(ShadowError, LookupError):
    """A plugin could not be found, was registered twice, or failed to load."""
