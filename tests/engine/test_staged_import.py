"""Staged KV import (as the decode worker does it): blocks written as they land, then the batch."""

from services.common.request import RequestSpec
from services.common.sampling import SamplingParams
from tests.support.reference import greedy, make_engine, random_prompts, run_all


def prefill_elsewhere(model, prompt):
    source = make_engine(model)
    req = source.add_request("s", prompt, greedy(12))
    while req.num_output < 1:
        source.step()
    return source.export_kv("s")


def test_blocks_imported_in_pieces_continue_identically(tiny_model):
    prompt = random_prompts(1, seed=31, lo=70, hi=70, vocab=4000)[0]
    expected = run_all(make_engine(tiny_model), [prompt], greedy(12))[0]
    kv = prefill_elsewhere(tiny_model, prompt)
    target = make_engine(tiny_model)
    target.begin_import(RequestSpec("s", tuple(prompt), greedy(12)))
    assert target.load().blocks_used == len(kv.blocks)
    assert target.import_blocks("s", 0, b"".join(kv.blocks[:2])) == 2
    assert target.import_blocks("s", 2, b"".join(kv.blocks[2:])) == len(kv.blocks) - 2
    req = target.end_import("s", kv.token_ids, kv.num_prompt, kv.num_computed, len(kv.blocks), kv.sample_seed)
    while target.has_unfinished():
        target.step()
        target.kv.check_integrity()
    assert req.output_token_ids == expected
    assert target.load().blocks_used == 0


def test_abort_while_receiving_frees_the_reserved_blocks(tiny_model):
    target = make_engine(tiny_model)
    target.begin_import(RequestSpec("r", tuple(range(3, 50)), SamplingParams(max_tokens=4)))
    assert target.load().blocks_used > 0 and not target.has_unfinished()
    assert target.abort("r")
    assert target.load().blocks_used == 0
    target.kv.check_integrity()
