"""Which adapter holds which of the worker's `max_loras` slots: by adapter name, the least
recently used adapter giving its slot up to a new one, never one the current step uses."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from services.worker.lora.errors import LoRAError


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.num_evictions = 0  # adapters that gave their slot up to another

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def names(self) -> list[str]:
        """The adapters held, least recently used first."""
        return list(self._slots)

    def use(self, name: str) -> int:
        """The slot of `name`, which is held, now the most recently used."""
        self._slots.move_to_end(name)
        return self._slots[name]

    def claim(self, name: str, step: Collection[str]) -> int:
        """A slot for `name`, not held yet: a free one, else the least recently used
        adapter's that is not among `step` (the adapters of the current step)."""
        free = set(range(self.max_loras)) - set(self._slots.values())
        if free:
            slot = min(free)
        else:
            victim = next((n for n in self._slots if n not in step), None)
            if victim is None:
                raise LoRAError(
                    f"a step uses more adapters than this worker's max_loras {self.max_loras}"
                )
            slot = self._slots.pop(victim)
            self.num_evictions += 1
        self._slots[name] = slot
        return slot

    def release(self, name: str) -> None:
        """Free `name`'s slot (its weights failed to load)."""
        self._slots.pop(name, None)
