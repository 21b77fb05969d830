"""The model folder's tokenizer.json through the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from services.common.errors import InvalidRequest, ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{path}: file not found")
        self._tk = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as the tokenizer produces by default (its post-processor decides BOS; a rendered
        chat template carries its own special tokens, so it is encoded with add_special_tokens=False)."""
        if not isinstance(text, str):
            raise InvalidRequest("prompt must be a string")
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ids; ids the tokenizer lacks (a model vocabulary may be larger) are skipped."""
        return self._tk.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """text up to the earliest stop string (excluded), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)
