"""The models one gateway serves, each a `GatewayContext` of its own (engine client on its
schedulers' subjects, tokenizer, limits), and the model a request's `model` names: a served
model, or a LoRA adapter of one (the adapter's schedulers announce it)."""

from __future__ import annotations

from collections.abc import Iterator

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError


class ServedModels:
    """The gateway's models by name, the first the default (of requests that name none)."""

    def __init__(self, contexts: list[GatewayContext]) -> None:
        if not contexts:
            raise ValueError("a gateway serves at least one model")
        self._by_name = {ctx.served_model_name: ctx for ctx in contexts}
        if len(self._by_name) != len(contexts):
            raise ValueError("two served models have the same name")
        self.default = contexts[0]

    def __iter__(self) -> Iterator[GatewayContext]:
        return iter(self._by_name.values())

    def resolve(self, name: str | None) -> tuple[GatewayContext, str | None]:
        """The model a request's `model` names and the LoRA adapter it runs with (None: the
        base model); no name is the default model; an unknown one a 404. An adapter name two
        models serve goes to the first of them."""
        if name is None:
            return self.default, None
        ctx = self._by_name.get(name)
        if ctx is not None:
            return ctx, None
        ctx = self.adapter_owner(name)
        if ctx is not None:
            return ctx, name
        raise APIError(404, f"The model `{name}` does not exist.", "model")

    def adapter_owner(self, lora_name: str) -> GatewayContext | None:
        """The first model whose schedulers serve the LoRA adapter `lora_name`."""
        return next((ctx for ctx in self if lora_name in ctx.engine.lora_adapters), None)

    def base(self, name: str | None) -> GatewayContext:
        """The served model called `name` (no name: the default); unknown: 404 on `model`."""
        ctx = self.default if name is None else self._by_name.get(name)
        if ctx is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return ctx

    @property
    def ready(self) -> bool:
        """Some model has a scheduler with ready workers."""
        return any(ctx.engine.ready for ctx in self)

    @property
    def draining(self) -> bool:
        return self.default.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        for ctx in self:
            ctx.draining = value
