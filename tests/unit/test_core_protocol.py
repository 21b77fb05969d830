"""The servicer <-> engine core pipe is typed and checked at both ends: only the listed methods can be called, a
malformed or unknown message is refused with a clear error (the core replies and keeps serving), never run."""

from types import SimpleNamespace

import pytest

from services.worker import protocol
from services.worker.core import EngineCore, calls

# the engine's transfer and adapters parts, as core.calls() binds them
PARTS = SimpleNamespace(**{name: None for name in (
    "kv_geometry", "begin_import", "cached_hashes", "track_block_events", "block_events", "load", "prefetch", "unload",
    "listing")})


class FakeEngine:
    step_cost = None
    transfer = adapters = PARTS

    def load(self):
        return "load"

    def abort_everything(self):  # an engine method the servicer must not reach
        raise AssertionError("called through the pipe")


def core():
    sent = []
    return EngineCore(FakeEngine(), sent.append), sent


def test_the_core_binds_exactly_the_calls_the_protocol_lists():
    c, _ = core()
    assert set(calls(FakeEngine(), c)) == protocol.ENGINE_CALLS | protocol.CORE_CALLS


def test_a_listed_engine_method_is_called_and_its_result_replied():
    c, sent = core()
    c.handle(("call", 1, "load", ()))
    assert sent == [("reply", 1, "load", None)]
    assert isinstance(sent[0], protocol.Reply) and sent[0].result == "load"


@pytest.mark.parametrize("msg, says", [
    (("call", 2, "abort_everything", ()), "does not serve 'abort_everything'"),
    (("call", 3, "load"), "has 3 field(s), got 2"),
    (("launch", 4), "not a core message"),
])
def test_the_core_refuses_what_the_protocol_does_not_name_and_goes_on(msg, says):
    c, sent = core()
    c.handle(msg)
    c.handle(("call", 9, "load", ()))
    replies = {m.seq: m for m in sent}
    assert 9 in replies and replies[9].error is None  # still serving
    if msg[0] != "launch":
        assert says in str(replies[msg[1]].error)


def test_the_servicer_side_refuses_an_unlisted_method_before_sending():
    from services.worker.core_client import EngineCoreClient

    runner = SimpleNamespace(dead=None)  # call() checks before touching the pipe
    with pytest.raises(ValueError, match="does not serve 'step'"):
        EngineCoreClient.call(runner, "step")
    assert protocol.ENGINE_CALLS.isdisjoint(protocol.CORE_CALLS)
    assert all(hasattr(EngineCore, m) for m in protocol.CORE_CALLS)
    from services.engine.engine import LLMEngine
    from services.engine.kv_transfer import KVTransfer
    from services.engine.lora_adapters import LoRAAdapters

    # what core.calls() binds the ENGINE_CALLS to exists on the engine's real parts (the fake mirrors them)
    assert all(hasattr(KVTransfer, m) or hasattr(LoRAAdapters, m) for m in vars(PARTS) if m != "load")
    assert hasattr(LLMEngine, "load")
