"""The LoRA adapters of a shard's requests in flight: never more than the engine's max_loras (its
adapter slots), so a request of one more adapter waits until an adapter has nothing left in flight
instead of making vLLM swap adapters in and out step by step (the feed queues a window's requests
adapter by adapter, feed.adapter_rank)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional


def engine_loads(engine: Any) -> Optional[int]:
    """The adapters a LoRA engine has moved into one of its slots so far (vllm_engine.Engine.lora_loads);
    None for an engine without LoRA adapters or one that does not count them."""
    if not getattr(engine, "max_loras", None) or not hasattr(engine, "lora_loads"):
        return None
    return int(engine.lora_loads())


class LoraSlots:
    """Requests in flight per adapter (None, the base model, takes no slot)."""

    def __init__(self, max_loras: Optional[int]):
        """max_loras: the engine's adapter slots; None: no LoRA (everything is admitted)."""
        self.max_loras = max_loras
        self.in_flight: Counter[str] = Counter()

    def admits(self, adapter: Optional[str]) -> bool:
        """Whether a request of this adapter may be sent now."""
        if adapter is None or not self.max_loras or adapter in self.in_flight:
            return True
        return len(self.in_flight) < self.max_loras

    def sent(self, adapter: Optional[str]) -> None:
        """A request of this adapter went to the engine."""
        if adapter is not None:
            self.in_flight[adapter] += 1

    def done(self, adapter: Optional[str]) -> None:
        """A request of this adapter finished."""
        if adapter is not None:
            self.in_flight[adapter] -= 1
            if self.in_flight[adapter] <= 0:
                del self.in_flight[adapter]
