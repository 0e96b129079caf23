"""The LoRA adapters a scheduler serves, by name: those of `--lora-modules` from the start,
and those loaded and unloaded at run time (`POST /v1/load_lora_adapter`), whose directories
must lie under `--lora-root`. A request names an adapter as its `model`; the registry gives
the workers its directory (`LoRARequest`)."""

from __future__ import annotations

import os
import re

from shared.cli_args import name_value_pairs
from shared.wire import LoRARequest

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class LoRARegistryError(ValueError):
    """A load or unload refused: `status` is the HTTP status the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_lora_modules(text: str) -> dict[str, str]:
    """`name=path` pairs separated by spaces or commas (vLLM's `--lora-modules`)."""
    modules = name_value_pairs(text, "lora module")
    for name in modules:
        check_name(name)
    return modules


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(
            f"adapter name {name!r}: 1-128 letters, digits and . _ : / @ + -, starting with a "
            "letter or digit"
        )


class LoRARegistry:
    """Adapter names to `LoRARequest`s. `root`: the directory runtime loads must lie in
    (empty: runtime loading is off); `reserved`: names that are not adapters (the base
    model's)."""

    def __init__(self, modules: dict[str, str], root: str = "", reserved: str = "") -> None:
        self.root = os.path.normpath(root) if root else ""
        self.reserved = reserved
        self._adapters = {
            name: LoRARequest(lora_name=name, lora_path=path) for name, path in modules.items()
        }

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self._adapters)

    @property
    def paths(self) -> dict[str, str]:
        """Each adapter's directory, by name."""
        return {name: self._adapters[name].lora_path for name in self.names}

    def resolve(self, name: str, path: str) -> LoRARequest:
        """The adapter a runtime load of `path` as `name` would add; refuses a bad name, a
        name taken, runtime loading off, or a path outside the root (relative paths are
        relative to it)."""
        if not self.root:
            raise LoRARegistryError(
                403, "loading LoRA adapters at run time is off (the scheduler has no --lora-root)"
            )
        try:
            check_name(name)
        except ValueError as e:
            raise LoRARegistryError(400, str(e)) from None
        if name == self.reserved:
            raise LoRARegistryError(400, f"{name!r} is the base model's name")
        if name in self._adapters:
            raise LoRARegistryError(400, f"The lora adapter '{name}' has already been loaded.")
        full = os.path.normpath(os.path.join(self.root, path))
        if os.path.commonpath([self.root, full]) != self.root or "\0" in path:
            raise LoRARegistryError(400, f"lora_path {path!r} is outside the adapter root")
        return LoRARequest(lora_name=name, lora_path=full, root=self.root)

    def add(self, lora: LoRARequest) -> None:
        self._adapters[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        lora = self._adapters.pop(name, None)
        if lora is None:
            raise LoRARegistryError(404, f"The lora adapter '{name}' cannot be found.")
        return lora
