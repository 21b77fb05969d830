"""The gateway's incremental detokenizer equals a whole decode, cut at stop strings, however tokens arrive."""

import random

import pytest

from services.common.tokenizer import Tokenizer, cut_at_stop
from services.gateway.streams import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer(tiny_model)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stops", [(), ("e",), ("ab", "xyz q"), ("  ",)])
def test_incremental_text_equals_the_whole_decode(tokenizer, seed, stops):
    rng = random.Random(seed)
    text = " ".join(rng.choice(["hello", "wörld", "ab", "xyz", "q", "émoji 🙂", "12", "  ", "e"]) for _ in range(40))
    ids = tokenizer.encode(text)
    stream, out, i = TextStream(tokenizer, stops), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(stream.push(ids[i:i + n], final=i + n >= len(ids)))
        i += n
    assert "".join(out) == cut_at_stop(tokenizer.decode(ids), stops)[0]
