"""The LoRA adapters an engine serves: their names, ids and folders (an id is never reused, so a name
loaded again is a new adapter to the prefix cache)."""

from __future__ import annotations

from aioengine.errors import InvalidRequestError


class LoRARegistry:
    def __init__(self, modules: dict[str, str]) -> None:
        self._adapters = {name: (i, path) for i, (name, path) in enumerate(modules.items(), start=1)}
        self._next_id = len(self._adapters) + 1

    @property
    def modules(self) -> dict[str, str]:
        """name -> folder, in load order."""
        return {name: path for name, (_, path) in self._adapters.items()}

    def names_by_id(self) -> dict[int, str]:
        return {adapter_id: name for name, (adapter_id, _) in self._adapters.items()}

    def id_of(self, name: str | None) -> int:
        """The adapter's id (0 for None, the base model); InvalidRequestError for an unknown name."""
        if name is None:
            return 0
        if name not in self._adapters:
            served = ", ".join(self._adapters) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}; served: {served}", param="lora")
        return self._adapters[name][0]

    def new_id(self, name: str, base_name: str) -> int:
        """An id for a name not served yet (InvalidRequestError for a taken or empty one)."""
        if not name or name in self._adapters or name == base_name:
            raise InvalidRequestError(f"the name {name!r} is taken or empty", param="lora_name")
        self._next_id += 1
        return self._next_id - 1

    def add(self, name: str, adapter_id: int, path: str) -> None:
        self._adapters[name] = (adapter_id, path)

    def remove(self, name: str) -> None:
        del self._adapters[name]
