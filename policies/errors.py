"""The policies layer's user error (``experiments.errors`` reports it in one line, exit code 2)."""


class PolicyError(ValueError):
    """A policy file, name or setting that cannot be used; the message is meant for the user."""
