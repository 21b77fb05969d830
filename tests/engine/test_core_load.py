"""The engine core's load as the servicer sees it (heartbeats, the running gauge) is never left stale: it comes
with the core's ready message, after every step, and after an abort that leaves the engine idle (no step follows
one; the running gauge read 1 on idle workers after cancels, issue 43)."""

import multiprocessing
import threading

from services.common.request import RequestSpec
from services.common.sampling import SamplingParams
from services.worker.core import EngineCore
from tests.support.reference import make_engine


def test_an_abort_that_empties_the_engine_reports_the_load(tiny_model):
    ours, theirs = multiprocessing.Pipe(duplex=True)
    core = EngineCore(make_engine(tiny_model), theirs.send)
    runner = threading.Thread(target=core.run, args=(theirs,), daemon=True)
    runner.start()
    try:
        spec = RequestSpec("r1", (5, 6, 7, 8), SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0))
        ours.send(("add", 0, spec, None, None))
        steps = 0
        while steps < 2:  # running: its tokens come step by step
            msg = ours.recv()
            assert msg[0] != "reply" or msg[3] is None, msg
            if msg[0] == "step" and msg[1]:
                steps += 1
                assert msg[2].load.running == 1
        ours.send(("abort", "r1"))
        while True:  # step messages may still be in the pipe; the last one after the abort has the engine idle
            assert ours.poll(30), "no load came after the abort: the servicer's stays at running 1"
            msg = ours.recv()
            if msg[0] == "step" and not msg[1] and msg[2].load.running == 0:
                break
        assert msg[2].load.waiting == 0 and msg[2].load.blocks_used == 0
    finally:
        ours.send(("stop",))
        runner.join(timeout=60)

