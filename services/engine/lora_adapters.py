"""The engine's LoRA adapters as its callers see them: register a PEFT folder under a name, unregister, read ahead,
list with residency. The residency itself (slots, host memory, reads in the background) is lora_residency.py's
AdapterResidency; an engine without LoRA slots (max_loras 0) has none, and refuses adapters with a clear error.
"""

from __future__ import annotations

from pathlib import Path

from services.common.errors import InvalidRequest, NotFound
from services.engine.lora_residency import AdapterResidency


def configured(lc) -> list[tuple[str, str]]:
    """(name, folder) of the config's adapters: lora_dir's subfolders holding an adapter_config.json, then modules."""
    found = []
    if lc.lora_dir:
        root = Path(lc.lora_dir)
        if not root.is_dir():
            raise InvalidRequest(f"lora_dir {root}: not a folder")
        found = [(d.name, str(d)) for d in sorted(root.iterdir()) if (d / "adapter_config.json").is_file()]
    return found + list(lc.modules)


class LoRAAdapters:
    def __init__(self, residency: AdapterResidency | None):
        self.residency = residency

    def load(self, name: str, path: str, prefetch: bool = False) -> dict:
        """Register a PEFT adapter folder under name (validated from its config and header; InvalidRequest naming
        it otherwise, with nothing registered). prefetch: start reading its weights now. Returns its listing."""
        if self.residency is None:
            raise InvalidRequest(f"adapter {name!r}: this engine has no LoRA slots (max_loras 0)")
        self.residency.register(name, path)
        if prefetch:
            self.residency.prefetch(name, warm=True)
        return self.listing_of(name)

    def unload(self, name: str) -> None:
        """Unregister: new requests for it are refused; requests already accepted finish with it."""
        if self.residency is None:
            raise NotFound(f"adapter {name!r} is not loaded")
        self.residency.unregister(name)

    def prefetch(self, name: str) -> bool:
        """Read a registered adapter into host memory (and a free slot) ahead of demand; False if it is not
        registered."""
        return self.residency is not None and self.residency.prefetch(name, warm=True)

    def listing(self) -> list[dict]:
        """Every registered adapter with its residency (slot | host | loading | disk)."""
        return [self.listing_of(n) for n in sorted(self.residency.known)] if self.residency is not None else []

    def listing_of(self, name: str) -> dict:
        lora, info = self.residency, self.residency.known[name]
        where = ("slot" if lora.slot_of(name) is not None else "host" if name in lora.host
                 else "loading" if name in lora.loading else "disk")
        return {"name": name, "path": info.path, "rank": info.rank, "targets": list(info.targets),
                "residency": where}

    def failed_reads(self) -> list[tuple[str, str]]:
        """Join finished reads; (name, why) of each whose read failed, forgotten here (its requests must end)."""
        self.residency.poll()
        failed = []
        while self.residency.failed:
            name, why = self.residency.failed.popitem()
            self.residency.forget(name)
            failed.append((name, why))
        return failed
