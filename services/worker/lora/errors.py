"""The one error of an adapter the worker cannot run."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot run on this worker: its files, options or shapes, or a step
    that needs more adapters at once than the worker has slots."""
