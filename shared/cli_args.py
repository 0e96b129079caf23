"""Command-line flags and `SKIFF_*` environment variables derived from the config dataclasses.

Each field of a frozen config dataclass becomes one flag and one variable of its own name:
`max_num_seqs` is `--max-num-seqs` and `SKIFF_MAX_NUM_SEQS`. Precedence: flag, then variable,
then the dataclass default, which is therefore defined in exactly one place. Booleans take
`--x/--no-x` and `true/false` in the environment. The same definitions turn a config back into
flags (`to_argv`), which is how `skiff serve` configures the processes it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import types
import typing
from collections.abc import Callable, Collection, Iterable
from typing import Any, TypeVar

C = TypeVar("C")

ENV_PREFIX = "SKIFF_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def setting(default: Any, help: str, *, cli: bool = True) -> Any:
    """A config field with its help text; `cli=False` keeps it off the command line."""
    return dataclasses.field(default=default, metadata={"help": help, "cli": cli})


def name_value_pairs(text: str, what: str) -> dict[str, str]:
    """`name=value` items separated by spaces or commas (as in vLLM's `--lora-modules`);
    `what` names an item in the errors."""
    pairs: dict[str, str] = {}
    for item in text.replace(",", " ").split():
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{what} {item!r} is not name=path")
        if name in pairs:
            raise ValueError(f"{what} {name!r} is given twice")
        pairs[name] = value
    return pairs


def flag(name: str) -> str:
    """The flag of the field `name`: `--max-num-seqs` for `max_num_seqs`."""
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _scalar_type(hint: Any) -> type:
    """The type of a field annotation such as `int`, `str | None` or `float`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return typing.cast(type, inner)
    return typing.cast(type, hint)


def _cli_fields(
    cls: type, only: Collection[str] | None = None
) -> Iterable[tuple[dataclasses.Field[Any], type]]:
    """Fields with a default and on the command line (of those in `only`, when given), with
    their scalar type."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        if f.metadata.get("cli", True) and f.default is not dataclasses.MISSING:
            yield f, _scalar_type(hints[f.name])


class ConfigParser(argparse.ArgumentParser):
    """An ArgumentParser that adds one flag per config field and builds the configs back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.env_vars: set[str] = set()  # every SKIFF_* variable this command reads
        self._only: dict[type, Collection[str] | None] = {}  # config class -> its flags' fields
        self._built: list[type] = []  # the configs parse_configs builds

    def add_config(
        self, cls: type, *, only: Collection[str] | None = None, build: bool = True
    ) -> None:
        """Flags for the fields of `cls` (those in `only`, when given; the others keep their
        defaults); `parse_configs` builds it unless `build` is False (for a config with
        required fields: build it with `config`)."""
        summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        group = self.add_argument_group(cls.__name__, summary)
        for f, kind in _cli_fields(cls, only):
            self._add(group, f, kind)
        self._only[cls] = only
        if build:
            self._built.append(cls)

    def env(self, name: str, default: Any = None, cast: Callable[[str], Any] = str) -> Any:
        """A variable outside the configs (for a flag added by hand)."""
        self.env_vars.add(env_var(name))
        value = os.environ.get(env_var(name))
        return default if value is None else cast(value)

    def _add(self, group: argparse._ArgumentGroup, f: dataclasses.Field[Any], kind: type) -> None:
        name = f.name
        cast: Callable[[str], Any] = _parse_bool if kind is bool else kind
        try:
            default = self.env(name, f.default, cast)
        except ValueError as exc:
            self.error(f"{env_var(name)}: {exc}")
        help_text = f"{f.metadata.get('help', '')} [env {env_var(name)}]"
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(flag(name), default=default, action=action, help=help_text)
        else:
            group.add_argument(flag(name), type=kind, default=default, help=help_text)

    def parse_configs(
        self, argv: list[str] | None = None
    ) -> tuple[argparse.Namespace, dict[type, Any]]:
        """Parse; returns the namespace and one validated instance per added config class."""
        ns = self.parse_args(argv)
        return ns, {cls: self.config(cls, ns) for cls in self._built}

    def config(self, cls: type[C], ns: argparse.Namespace, **fixed: Any) -> C:
        """An instance of the added config `cls` from the parsed flags `ns` and the `fixed`
        values (fields without a flag keep their default); an invalid one is a usage error."""
        values = {f.name: getattr(ns, f.name) for f, _ in _cli_fields(cls, self._only[cls])}
        try:
            return cls(**{**values, **fixed})
        except ValueError as exc:
            self.error(str(exc))


def to_argv(config: Any) -> list[str]:
    """The flags for the fields of `config` that differ from their defaults. A child process
    resolves the others itself, from the SKIFF_* variables it inherits and the same defaults,
    so `SKIFF_LOG_LEVEL=DEBUG skiff serve` reaches every service."""
    argv: list[str] = []
    for f, kind in _cli_fields(type(config)):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if kind is bool:
            argv.append(flag(f.name) if value else flag("no_" + f.name))
        elif value is not None:
            argv += [flag(f.name), str(value)]
    return argv


async def wait_for_signal() -> None:
    """Return on the first SIGTERM or SIGINT (then the service drains and stops)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
