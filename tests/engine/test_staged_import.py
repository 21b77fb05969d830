"""Staged KV import (as the decode worker does it): blocks written as they land, then the batch."""

from services.common.request import RequestSpec
from services.common.sampling import SamplingParams
from tests.support.reference import greedy, make_engine, random_prompts, run_all


def prefill_elsewhere(model, prompt):
    source = make_engine(model)
    req = source.add_request("s", prompt, greedy(12))
    while req.num_output < 1:
        source.step()
    return source.transfer.export_kv("s")


def test_blocks_imported_in_pieces_continue_identically(tiny_model):
    prompt = random_prompts(1, seed=31, lo=70, hi=70, vocab=4000)[0]
    expected = run_all(make_engine(tiny_model), [prompt], greedy(12))[0]
    kv = prefill_elsewhere(tiny_model, prompt)
    target = make_engine(tiny_model)
    target.transfer.begin_import(RequestSpec("s", tuple(prompt), greedy(12)))
    assert target.load().blocks_used == len(kv.blocks)
    assert target.transfer.import_blocks("s", 0, b"".join(kv.blocks[:2])) == 2
    assert target.transfer.import_blocks("s", 2, b"".join(kv.blocks[2:])) == len(kv.blocks) - 2
    req = target.transfer.end_import("s", kv.token_ids, kv.num_prompt, kv.num_computed, len(kv.blocks), kv.sample_seed)
    while target.has_unfinished():
        target.step()
        target.kv.check_integrity()
    assert req.output_token_ids == expected
    assert target.load().blocks_used == 0


def test_abort_while_receiving_frees_the_reserved_blocks(tiny_model):
    target = make_engine(tiny_model)
    target.transfer.begin_import(RequestSpec("r", tuple(range(3, 50)), SamplingParams(max_tokens=4)))
    assert target.load().blocks_used > 0 and not target.has_unfinished()
    assert target.abort("r")
    assert target.load().blocks_used == 0
    target.kv.check_integrity()


def test_blocks_from_the_pool_become_a_prefix_cache_hit_with_identical_output(tiny_model):
    """import_cached (the pool's blocks into the prefix cache, as a worker leasing them does): the request then
    computes only its tail, and its tokens equal a cold engine's; a chain with a gap imports nothing."""
    from services.common.block_hash import extra_keys, hash_blocks

    prompt = random_prompts(1, seed=41, lo=90, hi=90, vocab=4000)[0]
    expected = run_all(make_engine(tiny_model), [prompt], greedy(8))[0]
    kv = prefill_elsewhere(tiny_model, prompt)
    hashes = hash_blocks(prompt[:-1], 16, extra_keys("", ""))  # 5 full blocks, the last token left to compute
    target = make_engine(tiny_model)
    assert target.transfer.import_cached(hashes, 1, kv.blocks[1:5]) == 0  # block 0 is not cached here: a gap
    assert target.transfer.import_cached(hashes, 0, kv.blocks[:5]) == 5
    assert target.transfer.import_cached(hashes, 0, kv.blocks[:5]) == 0  # held already
    assert target.load().blocks_used == 0 and target.load().blocks_cached == 5
    req = target.add_request("t", prompt, greedy(8))
    while target.has_unfinished():
        target.step()
        target.kv.check_integrity()
    assert req.num_cached_prompt == 80 and req.output_token_ids == expected


def test_the_core_exports_only_blocks_the_pool_lacks_and_verifies_what_it_imports(tiny_model, tmp_path):
    """EngineCore in-process: a handoff plan with blocks 0-1 present writes only the others into their arena slots,
    with checksums; an import whose checksum does not match is refused (KVTransferFailed) and nothing is used."""
    import pytest

    from services.common.arena import Arena, checksum
    from services.worker.core import EngineCore, ExportPlan, KVTransferFailed

    prompt = random_prompts(1, seed=43, lo=70, hi=70, vocab=4000)[0]  # 5 blocks, the last partial
    source = make_engine(tiny_model)
    arena = Arena("coretest", source.transfer.block_bytes, 16, shm_dir=tmp_path)
    sent = []
    core = EngineCore(source, sent.append)
    core.arenas[arena.generation] = arena  # the kvstore's own mapping stands in for the worker's
    plan = ExportPlan(True, 5, (True, True, False, False, False), tuple(range(5)), arena.generation)
    core.handle(("add", 1, RequestSpec("p", tuple(prompt), greedy(4)), plan, None))
    while core.exports:
        core.step()
    pieces = [p for msg in sent if msg[0] == "kv" for p in msg[1]]
    blocks = [p for p in pieces if not p.last]
    assert [p.first for p in blocks][0] == 2 and sum(len(p.checksums) for p in blocks) == 3
    assert pieces[-1].last and pieces[-1].meta["num_blocks"] == 5
    reference = prefill_elsewhere(tiny_model, prompt).blocks
    for p in blocks:
        for i, crc in enumerate(p.checksums):
            assert bytes(arena.slot(p.first + i)) == reference[p.first + i] and checksum(arena.slot(p.first + i)) == crc
    target = make_engine(tiny_model)
    replies = []
    core = EngineCore(target, replies.append)
    core.arenas[arena.generation] = arena
    target.transfer.begin_import(RequestSpec("d", tuple(prompt), greedy(4)))
    arena.slot(3)[:8] = b"\xff" * 8  # corrupted in the pool
    with pytest.raises(KVTransferFailed, match="block 3"):
        core.import_slots("d", 2, arena.generation, [2, 3], [checksum(reference[2]), checksum(reference[3])])
    meta = pieces[-1].meta  # the end_import already on its way (the worker pipelines it) is refused
    core.handle(("end_import", 7, "d", {k: meta[k] for k in ("token_ids", "num_prompt", "num_computed",
                                                                 "num_blocks", "sample_seed")}))
    assert isinstance(replies[-1][3], KVTransferFailed) and not target.has_unfinished()
    core.handle(("abort", "d"))
    assert target.load().blocks_used == 0
    arena.close()


def test_pooled_blocks_wait_for_room_and_join_the_prefix_cache_when_the_request_is_admitted(tiny_model):
    """engine.add(pooled=...): with the KV pool full of a running request, the pooled blocks are not imported at
    arrival (there is no room; at most what fits), but when the request is admitted: it then computes only its
    tail."""
    from services.common.block_hash import extra_keys, hash_blocks

    prompt = random_prompts(1, seed=45, lo=90, hi=90, vocab=4000)[0]
    expected = run_all(make_engine(tiny_model), [prompt], greedy(6))[0]
    kv = prefill_elsewhere(tiny_model, prompt)
    hashes = hash_blocks(prompt[:-1], 16, extra_keys("", ""))
    target = make_engine(tiny_model, num_blocks=10)
    hog = target.add_request("hog", random_prompts(1, seed=46, lo=140, hi=140, vocab=4000)[0], greedy(10))
    target.step()
    target.step()  # the hog holds 9 of the 10 blocks, then all 10
    req = target.add(RequestSpec("t", tuple(prompt), greedy(6)), pooled=(hashes, 0, kv.blocks[:5]))
    target.step()
    assert req.pooled is not None and target.transfer.pooled_blocks <= 1  # no room yet: waiting (at most a block fits)
    while target.has_unfinished():
        target.step()
        target.kv.check_integrity()
    assert hog.finish_reason == "length" and target.transfer.pooled_blocks >= 5 and req.num_preemptions == 0
    assert req.num_cached_prompt == 80 and req.output_token_ids == expected


def test_a_superseded_arena_is_unmapped_once_no_export_writes_to_it(tiny_model, tmp_path):
    """Issue 36's soak: every kvstore restart left each worker with the dead kvstore's whole segment mapped (and
    resident: mappings are populated), 1 GB more per worker. The old arena now goes once its last export is done."""
    from services.common.arena import Arena
    from services.worker.core import EngineCore, ExportPlan

    engine = make_engine(tiny_model)
    old, new = (Arena(f"retire{i}", engine.transfer.block_bytes, 8, shm_dir=tmp_path) for i in range(2))
    core = EngineCore(engine, lambda msg: None)
    core.arenas[old.generation] = old
    prompt = random_prompts(1, seed=47, lo=40, hi=40, vocab=4000)[0]
    core.handle(("add", 1, RequestSpec("p", tuple(prompt), greedy(3)), ExportPlan(True, 3, (False,) * 3,
                                                                                  (0, 1, 2), old.generation), None))
    core.arenas[new.generation] = new  # the kvstore restarted: its new segment is mapped beside the old
    core.retire_arenas()
    assert list(core.arenas) == [old.generation, new.generation]  # "p" still writes into the old one
    while core.exports:
        core.step()
    assert list(core.arenas) == [new.generation] and old.mm.closed
    new.close()
