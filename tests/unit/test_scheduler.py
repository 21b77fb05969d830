"""The scheduler alone (no model): token budget, chunked prefill, preemption, block accounting."""

from tests.support.fakes import make_request, make_scheduler


def run(sched, reqs, max_steps=500, check=None):
    """Drive schedule/update as the engine does, 'sampling' token 7; returns the per-step outputs. `check` is called
    before every step."""
    for r in reqs:
        sched.add(r)
    outs = []
    while sched.has_work and len(outs) < max_steps:
        if check is not None:
            check()
        out = sched.schedule()
        sched.update(out)
        for s in out.seqs:
            if s.sample:
                s.request.tokens.append(7)
                if s.request.num_output >= s.request.params.max_tokens:
                    sched.finish(s.request, "length")
        sched.kv.check_integrity()
        outs.append(out)
    return outs


def test_every_step_keeps_to_the_token_budget_and_long_prompts_are_chunked():
    sched = make_scheduler(budget=32, max_num_seqs=4)
    reqs = [make_request(i, prompt_len=70, max_tokens=3) for i in range(3)]
    outs = run(sched, reqs)
    assert all(o.num_tokens <= 32 for o in outs)
    assert max(s.num_new for o in outs for s in o.seqs) == 32  # a 70-token prompt goes in chunks
    assert all(r.num_output == 3 and r.finish_reason == "length" for r in reqs)
    assert sched.kv.pool.counts()["used"] == 0


def test_a_pool_too_small_for_everyone_preempts_and_everyone_still_finishes():
    sched = make_scheduler(num_blocks=7, block_size=4, budget=64, max_num_seqs=8)
    reqs = [make_request(i, prompt_len=10, max_tokens=6) for i in range(4)]
    run(sched, reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert all(r.output_token_ids == [7] * 6 for r in reqs)
    assert sched.kv.pool.counts()["used"] == 0


def test_slots_limit_the_batch():
    sched = make_scheduler(max_num_seqs=2, budget=256)
    outs = run(sched, [make_request(i, prompt_len=5, max_tokens=4) for i in range(5)])
    assert max(len(o.seqs) for o in outs) == 2


def test_the_waiting_queue_stays_in_fcfs_order_and_its_outstanding_tokens_stay_exact_through_preemptions():
    # A tight pool: running requests are preempted back to the queue, which must take them back in arrival order
    # (they go first again) without the scheduler sorting it; the queue's token count is kept, not summed.
    sched = make_scheduler(num_blocks=9, block_size=4, budget=16, max_num_seqs=3)
    reqs = [make_request(i, prompt_len=6 + i % 5, max_tokens=5 + i % 4) for i in range(12)]

    def check():
        assert sched.waiting == sorted(sched.waiting, key=lambda r: (r.arrival_s, r.seq_no))
        assert sched.waiting_tokens == sum(r.num_tokens - r.num_computed + r.params.max_tokens - r.num_output
                                           for r in sched.waiting)

    outs = run(sched, reqs[::-1], check=check)  # added newest first: held by arrival all the same
    assert sum(len(o.preempted) for o in outs) > 0 and sched.waiting_tokens == 0
    assert all(r.num_output == r.params.max_tokens for r in reqs)
