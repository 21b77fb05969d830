"""Property tests of KV block accounting over random add / step / abort sequences."""

from hypothesis import given
from hypothesis import strategies as st

from services.common.sampling import SamplingParams
from tests.support.reference import make_engine, random_prompts

OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 24), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
), min_size=1, max_size=40)


def check(engine):
    engine.kv.check_integrity()
    c = engine.kv.pool.counts()
    assert c["used"] + c["cached"] + c["free"] == c["total"]


@given(ops=OPS, block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(8, 40))
def test_accounting_holds_under_random_operations(tiny_model, ops, block_size, num_blocks):
    engine = make_engine(tiny_model, block_size=block_size, num_blocks=max(num_blocks, 96 // block_size + 1),
                         budget=32, max_seqs=8)
    shared = random_prompts(1, seed=3, lo=20, hi=20, vocab=4000)[0]
    ids = []
    for n, op in enumerate(ops):
        if op[0] == "add":
            _, length, max_tokens, share = op
            prompt = (shared if share == 0 else []) + random_prompts(1, seed=n, lo=length, hi=length, vocab=4000)[0]
            prompt = prompt[:70]
            ids.append(engine.add_request(f"q{n}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.8,
                                                                          seed=n, ignore_eos=True)).req_id)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                check(engine)
        elif ids:
            engine.abort(ids[op[1] % len(ids)])
        check(engine)
    while engine.has_unfinished():
        engine.step()
        check(engine)
    assert engine.kv.pool.counts()["used"] == 0
    assert not engine.kv.tables
