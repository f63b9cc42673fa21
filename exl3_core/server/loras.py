"""LoRA adapters over the OpenAI API: which adapters a request runs with, and how ``/v1/models`` lists them.

A request picks adapters loaded on the served model in two ways, which add up:

* ``"model": "BASE:ADAPTER"`` (or the adapter's own name): that adapter at its default weight (the
  ``--lora DIR:WEIGHT`` it was loaded with, else 1.0);
* ``"loras": {"ADAPTER": weight, ...}`` (an extension field; the ``openai`` client sends it through
  ``extra_body``): any loaded adapters with explicit weights (these win over the model field's).

``/v1/models`` lists the base model and ``BASE:ADAPTER`` for every adapter loaded now.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from exl3_core.server.errors import APIError


@runtime_checkable
class LoraNames(Protocol):
    def lora_names(self) -> list[str]: ...


class ServedLoras:
    """The adapter side of one :class:`~exl3_core.server.openai.OpenAIApp`.

    :param model_id: the served model's id (the ``BASE`` of ``BASE:ADAPTER``).
    :param model: the model (asked for the adapters loaded now, so loads and unloads show at once).
    :param weights: default weight per adapter name (1.0 for any other).
    """

    def __init__(self, model_id: str, model: object, weights: Mapping[str, float] | None = None) -> None:
        self.model_id = model_id
        self.model = model
        self.weights = dict(weights or {})

    def names(self) -> list[str]:
        return sorted(self.model.lora_names()) if isinstance(self.model, LoraNames) else []

    def model_ids(self) -> list[str]:
        """The ids ``/v1/models`` lists besides the base model's."""
        return [f"{self.model_id}:{n}" for n in self.names()]

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter a ``model`` field names (None: the base model).

        :raises APIError: 404 for a name that is neither the base model nor a loaded adapter of it."""
        if model is None or model == self.model_id:
            return None
        names = self.names()
        base, sep, adapter = model.partition(":")
        if sep and base == self.model_id and adapter in names:
            return adapter
        if not sep and model in names:
            return model
        if sep and base == self.model_id or names:
            shown = ", ".join([self.model_id, *self.model_ids()])
            raise APIError(404, f"The model '{model}' does not exist; this server serves {shown}",
                           code="model_not_found", param="model")
        return None  # no adapters: any model name means the one served model, as before

    def choice(self, model: str | None, loras: Mapping[str, float] | None) -> dict[str, float] | None:
        """The job's ``{adapter: weight}`` for a request (None: the base model).

        :raises APIError: naming the field, for adapters that are not loaded."""
        out: dict[str, float] = {}
        adapter = self.adapter_of(model)
        if adapter is not None:
            out[adapter] = self.weights.get(adapter, 1.0)
        if loras:
            names = self.names()
            unknown = sorted(set(loras) - set(names))
            if unknown:
                raise APIError.bad("loras", f"'loras' names adapters that are not loaded: {', '.join(unknown)} "
                                            f"(loaded: {', '.join(names) or 'none'})")
            out.update({k: float(v) for k, v in loras.items()})
        return out or None

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response reports: the id the request chose."""
        adapter = self.adapter_of(model)
        return self.model_id if adapter is None else f"{self.model_id}:{adapter}"
