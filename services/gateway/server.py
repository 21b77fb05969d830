"""The gateway's Generation servicer: validate, route, drive prefill and decode, stream tokens.

Disaggregated: the prefill and decode calls start together; the first token comes from the
prefill worker and goes to the client at once, the rest from the decode worker. Unified: one
call to a unified worker. The client's deadline (gRPC deadline and deadline_ms, whichever is
sooner) bounds every hop; a client cancel cancels every hop, and the workers free the blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import secrets
import time
import uuid
from dataclasses import replace

import grpc
from google.protobuf.message_factory import GetMessageClass
from opentelemetry import metrics

from services.common import rpc
from services.common.block_hash import pack_tokens, prompt_hashes
from services.common.convert import client_request_from_pb, utf8, work_from_spec
from services.common.errors import (
    DeadlineExceeded,
    InvalidRequest,
    MeshError,
    NotFound,
    NoWorker,
    OutOfRange,
    Unavailable,
)
from services.common.pb import meshserve_pb2 as pb
from services.common.pb import meshserve_pb2_grpc as pb_grpc
from services.common.request import ClientRequest, RequestSpec, with_headers
from services.common.telemetry import WAITING_FOR_WORKER
from services.common.tokenizer import Tokenizer
from services.gateway.adapters import AdapterCatalog
from services.gateway.admission import Admission
from services.gateway.requests import BadMessage, ModelInfo, SizeBounds, bounded, tolerant
from services.gateway.streams import Held, TextStream, drain_events
from services.policy.admission_core import Slo
from services.policy.bands import band_of
from services.policy.progress import ProgressWatch, Watched
from services.policy.tenants import Authenticator, wire_salt

log = logging.getLogger("meshserve.gateway")


MAX_ID_BYTES = 256  # request ids, model and adapter names
MAX_STOP_STRINGS, MAX_STOP_BYTES = 16, 256  # stop strings per request, and bytes each
MAX_ATTEMPTS, RESUME_BACKOFF_S, MAX_BACKOFF_S = 9, 0.1, 2.0  # a request failed by a dead service is resumed 8
# times at most, after 0.1, 0.2, 0.4 ... 2 s (9.1 s in all, bounded by its deadline): under `meshserve up` a killed
# service is back within ~5 s
ROUTE_TIMEOUT_S = 5.0  # a Route call unanswered this long: the router is hung; the next router, or a resume
STALL_POLL_S = 0.25  # how often the watchdog checks every stream's progress (services.policy.progress)
KVSTORE_PROBE_S = 2.0  # a stalled handoff asks the kvstore for its stats within this; silent: passed by for a while
RELEASE_RETRY_S = 60.0  # a transfer's release is retried this long while the kvstore does not answer (it may be hung)


def api_key(context) -> str | None:
    """The caller's key: metadata x-api-key, or authorization: Bearer KEY."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-api-key":
            return value
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return None


def _left(deadline_s: float | None, where: str) -> float | None:
    """Seconds left until the request's one absolute deadline (None = no deadline); every hop gets only that."""
    if deadline_s is None:
        return None
    left = deadline_s - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"the deadline passed {where}")
    return left


class GatewayServicer(pb_grpc.GenerationServicer):
    def __init__(self, model: ModelInfo, tokenizer: Tokenizer, routers: list[str], kvstore: str,
                 auth: Authenticator | None = None, admission: Admission | None = None,
                 bounds: SizeBounds | None = None,
                 cache_secret: bytes = b"", no_worker_grace_s: float = 30.0,
                 progress: ProgressWatch | None = None):
        self.model, self.tokenizer, self.kvstore = model, tokenizer, kvstore
        self.progress = progress or ProgressWatch()  # every stream's bound on its next event; fed by watch_mesh
        self._watchdog: asyncio.Task | None = None
        self._checking: asyncio.Task | None = None  # the watchdog's check of overdue handoffs
        self._probe: asyncio.Task | None = None  # the kvstore probe in flight
        self.kvstore_silent_until = 0.0  # a stalled handoff found the kvstore silent: decode workers compute prompts
        self.no_worker_grace_s = no_worker_grace_s  # how long a request is held while no worker can take it
        self.cache_secret = cache_secret or secrets.token_bytes(32)
        self.bounds = bounds or SizeBounds.for_model(model.max_model_len)
        self.auth = auth or Authenticator([])
        self.admission = admission or Admission()
        self.recorder = None  # a TraceRecorder (services/gateway/record.py), with --record-trace
        self.channels = rpc.ChannelPool()
        self.routers = list(routers)
        self._route_turn = itertools.count()
        self.adapters = AdapterCatalog(self._list_workers, self.worker, model.name)
        meter = metrics.get_meter("meshserve.gateway")
        self.resumes = meter.create_counter(
            "meshserve.gateway.resumes", description="requests resumed on another worker after a failure")
        self.stalls = meter.create_counter(
            "meshserve.gateway.stalls", description="streams cancelled because their worker made no progress")
        self.waiting_for_worker: dict[str, int] = {}  # pool -> requests held because it has no worker at all
        meter.create_observable_gauge(
            WAITING_FOR_WORKER, [self._observe_waiting], unit="{request}",
            description="requests held because their pool has no worker (the autoscaler scales it from zero)")

    def _observe_waiting(self, options):
        for pool, n in list(self.waiting_for_worker.items()):
            yield metrics.Observation(n, {"pool": pool})

    def worker(self, address: str) -> pb_grpc.WorkerStub:
        return pb_grpc.WorkerStub(self.channels.get(address))

    # ---- validation ------------------------------------------------------------------------

    def _validate(self, req: ClientRequest) -> list:
        """The prompt's token ids, once every field of the client's request is checked (sizes first)."""
        for field, value in (("request_id", req.client_id), ("model", req.model), ("adapter", req.adapter)):
            bounded(value, field, MAX_ID_BYTES)
        if len(req.sampling.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.sampling.stop)}")
        for stop in req.sampling.stop:
            bounded(stop, "stop", MAX_STOP_BYTES)
        self.model.check(req.model)
        band_of(req.criticality, req.priority)  # a known criticality, and one that a negative priority allows
        for field, value in (("deadline_ms", req.deadline_ms), ("slo_ttft_ms", req.slo_ttft_ms),
                             ("slo_tpot_ms", req.slo_tpot_ms)):
            if value < 0:
                raise InvalidRequest(f"{field} must be >= 0, got {value}")
        req.sampling.validate()
        ids = self._prompt_ids(req)
        total = len(ids) + req.sampling.max_tokens
        if total > self.model.max_model_len:
            raise OutOfRange(f"prompt ({len(ids)} tokens) + max_tokens ({req.sampling.max_tokens}) = {total} exceeds "
                             f"the model's context of {self.model.max_model_len}")
        return ids

    def _prompt_ids(self, req: ClientRequest) -> list:
        if (req.text is None) == (req.token_ids is None):
            raise InvalidRequest("prompt is required: text or token_ids")
        if req.text is not None and not req.text:
            raise InvalidRequest("prompt is empty")  # the tokenizer's BOS alone would make it look non-empty
        ids = self.encode(req.text) if req.text is not None else list(req.token_ids)
        if not ids:
            raise InvalidRequest("prompt is empty")
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        return ids

    def encode(self, text: str, field: str = "prompt", **kwargs) -> list:
        """Token ids of a client's text, refused before any work if it is over the prompt limit."""
        return self.tokenizer.encode(bounded(text, field, self.bounds.max_prompt_bytes), **kwargs)

    @staticmethod
    def _timeout(req: ClientRequest, time_remaining: float | None) -> float | None:
        limits = [t for t in (time_remaining, req.deadline_ms / 1000 if req.deadline_ms else None)
                  if t is not None]
        timeout = min(limits) if limits else None
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("the deadline has already passed")
        return timeout

    # ---- the API ---------------------------------------------------------------------------

    @rpc.mapped
    async def Generate(self, request, context):
        key = api_key(context)
        self.auth.authenticate(key)  # who asks comes before what is asked, for malformed requests too
        if isinstance(request, BadMessage):
            raise InvalidRequest(request.error)
        # aclosing: a cancelled call closes generate() at once (its finally returns the admission slot), not
        # whenever the garbage collector gets to a suspended generator.
        req = with_headers(client_request_from_pb(request), dict(context.invocation_metadata() or ()))
        async with contextlib.aclosing(self.generate(req, key, context.time_remaining())) as responses:
            async for response in responses:
                yield response

    def generate(self, req: ClientRequest, key: str | None, time_remaining: float | None = None):
        """The one generation path of both faces (gRPC and HTTP, each converting its request once): the
        tenant by its key, validation, admission, routing, and the token stream as GenerateResponses.
        Raises MeshError. With a trace recorder, each request also becomes a line of the trace."""
        if self.recorder is None:
            return self._generate(req, key, time_remaining, {})
        return self._recorded(req, key, time_remaining)

    async def _recorded(self, req: ClientRequest, key: str | None, time_remaining: float | None):
        arrival_s, answered = time.monotonic(), {}
        try:
            async with contextlib.aclosing(self._generate(req, key, time_remaining, answered)) as responses:
                async for resp in responses:  # closed at once when the caller closes this one (a cancelled call)
                    yield resp
        finally:
            try:  # never fails the request
                ids = answered.get("ids") or list(req.token_ids or ())
                self.recorder.record(arrival_s, ids, answered.get("output_tokens", req.sampling.max_tokens),
                                     answered.get("tenant", ""), req.adapter, answered.get("deadline_s"), req.priority,
                                     self.admission.view.block_size)
            except Exception:
                log.exception("recording the request trace failed")

    async def _generate(self, req: ClientRequest, key: str | None, time_remaining: float | None, answered: dict):
        """generate()'s body; `answered` collects what a trace line records."""
        tenant = self.auth.authenticate(key)
        answered["tenant"] = tenant.name
        req = await self._select_adapter(req)
        ids = answered["ids"] = self._validate(req)
        params = req.sampling
        band = band_of(req.criticality, req.priority)
        tenant.check_request(len(ids), params.max_tokens, req.priority, req.adapter, band)
        if req.adapter:
            await self.adapters.check(req.adapter)
        timeout = self._timeout(req, time_remaining)
        client_id = req.client_id or uuid.uuid4().hex
        req_id = f"{client_id}.{uuid.uuid4().hex[:12]}"
        deadline_s = answered["deadline_s"] = time.monotonic() + timeout if timeout is not None else None
        slo = Slo.of_ms(req.slo_ttft_ms, req.slo_tpot_ms)
        ticket = await self.admission.admit(tenant, req_id, len(ids), params.max_tokens, req.priority, deadline_s,
                                            band, slo)
        if params.seed is None and not params.greedy:
            params = replace(params, seed=secrets.randbits(63))  # drawn here, so that a resume draws the same
        spec = RequestSpec(req_id, tuple(ids), params, priority=req.priority, band=band, tenant=tenant.name,
                           weight=tenant.weight, deadline_s=deadline_s, predicted_s=ticket.predicted_s,
                           adapter=req.adapter, cache_salt=wire_salt(self.cache_secret, tenant.cache_salt))
        streamed: list = []  # output tokens the client has
        first_s = last_s = counts = None
        finished = False
        try:
            text = TextStream(self.tokenizer, params.stop)
            queue_ms = (ticket.dispatched_s - ticket.arrival_s) * 1e3
            async for ev in self._resumable(spec, streamed, ticket):
                if ev.token_ids:
                    last_s = time.monotonic()
                    if not streamed:
                        first_s = last_s
                        self.admission.metrics.ttft.record((first_s - ticket.arrival_s) * 1e3, {"tenant": tenant.name})
                streamed.extend(ev.token_ids)
                counts = counts or (ev.prompt_tokens, ev.cached_prompt_tokens)  # the first attempt's prompt
                finished = bool(ev.finish_reason)
                yield pb.GenerateResponse(request_id=client_id, token_ids=ev.token_ids, logprobs=ev.logprobs,
                                          top_logprobs=ev.top_logprobs,
                                          text=text.push(ev.token_ids, bool(ev.finish_reason)),
                                          finish_reason=ev.finish_reason, prompt_tokens=counts[0],
                                          cached_prompt_tokens=counts[1], queue_wait_ms=queue_ms)
                queue_ms = 0.0
                if ev.finish_reason:
                    return
        finally:  # a completed request's times teach the admission cost model; a cut-short one's first token, how
            # far a deadline request got by its deadline (services.policy.admission_queue)
            self.admission.done(ticket, len(streamed), first_s, last_s if finished else None)
            if finished:
                answered["output_tokens"] = len(streamed)

    async def _resumable(self, spec: RequestSpec, streamed: list, ticket=None):
        """The request's token events, resumed on another worker when a worker, the kvstore or the router fails
        it (UNAVAILABLE): the next attempt prefills the prompt and the tokens already streamed (`streamed`, kept by
        the caller) with sampling counting them as outputs, so greedy and seeded requests continue exactly and the
        client sees no duplicated and no missing token. Bounded by MAX_ATTEMPTS and the deadline. Each attempt goes
        to a worker holding one of this gateway's credits when one does (the router avoids the others), and uses
        it up (the admission ticket's). While the router has no live worker for it (NoWorker), the request is held
        and routed again, without using an attempt (see Held)."""
        avoid: set = set()
        attempt, held = 0, Held(self.no_worker_grace_s, self.waiting_for_worker)
        try:
            while True:
                done = len(streamed)
                p = spec.sampling
                now = replace(spec, request_id=spec.request_id + (f".r{attempt}" if attempt else ""),
                              prompt_token_ids=spec.prompt_token_ids + tuple(streamed), resumed_outputs=done,
                              sampling=replace(p, max_tokens=p.max_tokens - done,
                                               min_tokens=max(p.min_tokens - done, 0)))
                try:
                    work = work_from_spec(now, uuid.uuid4().hex, self.kvstore)
                    packed, bs = pack_tokens(now.prompt_token_ids), self.admission.view.block_size
                    hashes = prompt_hashes(packed, bs, work.adapter, work.cache_salt) if bs else []
                    decision = await self._route(pb.RouteRequest(
                        request_id=now.request_id, prompt_tokens=len(now.prompt_token_ids),
                                                                 max_tokens=now.sampling.max_tokens,
                        prompt_u32=packed, block_hashes=b"".join(hashes), hash_block_size=bs if hashes else 0,
                        adapter=work.adapter, cache_salt=work.cache_salt,
                        avoid=sorted(avoid.union(self.admission.avoid(), self.progress.avoid(time.monotonic())))),
                        _left(spec.deadline_s, "in the admission queue"))
                    held.leave()  # routed: a worker is there
                    if ticket is not None:
                        work.credit_from = self.admission.routed(ticket, decision.decode_worker)
                    try:
                        async for ev in self._events(decision, work, _left(spec.deadline_s, "while routing")):
                            yield ev
                            if ev.finish_reason:
                                return
                        raise Unavailable("a worker's stream ended before the request finished")
                    except BaseException:  # cancelled too: the call may have ended before the worker saw it
                        self.admission.give_back(decision.decode_worker, work.credit_from, work.request_id)
                        raise
                except NoWorker as e:
                    await held.wait(e, spec.request_id, spec.deadline_s)
                    continue
                except MeshError as e:
                    held.since = None
                    delay = min(RESUME_BACKOFF_S * 2 ** attempt, MAX_BACKOFF_S)
                    if (e.code != "UNAVAILABLE" or attempt + 1 == MAX_ATTEMPTS
                            or (spec.deadline_s is not None and time.monotonic() + delay >= spec.deadline_s)):
                        raise
                    avoid.add(e.peer)
                    self.resumes.add(1, {"after_tokens": "0" if not streamed else "some"})
                    log.warning("request %s: %s (from %s); attempt %d in %.2f s, resuming after %d streamed tokens",
                                spec.request_id, e, e.peer or "the gateway", attempt + 2, delay, len(streamed))
                    await asyncio.sleep(delay)
                    attempt += 1
        finally:
            held.leave()  # it no longer waits for a worker, however it ended

    async def _route(self, request: pb.RouteRequest, timeout: float | None) -> pb.RouteDecision:
        """Route calls spread over the routers (stateless: each sees every worker's heartbeats and the Redis
        index); an unavailable router fails over to the next at once."""
        start = next(self._route_turn)
        limit = ROUTE_TIMEOUT_S if timeout is None else min(timeout, ROUTE_TIMEOUT_S)
        for i in range(len(self.routers)):
            address = self.routers[(start + i) % len(self.routers)]
            try:
                return await pb_grpc.RouterStub(self.channels.get(address)).Route(request, timeout=limit)
            except grpc.aio.AioRpcError as e:
                hung = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and limit == ROUTE_TIMEOUT_S
                if (e.code() != grpc.StatusCode.UNAVAILABLE and not hung) or i + 1 == len(self.routers):
                    if hung:  # the request's own deadline is not what ran out: resumable, as a dead router
                        log.warning("router %s did not answer a Route call within %g s", address, ROUTE_TIMEOUT_S)
                        self.stalls.add(1, {"role": "router", "reason": "no answer"})
                        err = Unavailable(f"the router made no progress (no answer within {ROUTE_TIMEOUT_S:g} s)")
                        err.peer = address
                        raise err from None
                    raise rpc.forward_rpc_error(e, address) from None
                if hung:
                    log.warning("router %s did not answer a Route call within %g s; trying the next",
                                address, ROUTE_TIMEOUT_S)
                    self.stalls.add(1, {"role": "router", "reason": "no answer"})

    async def _list_workers(self) -> list:
        """The live workers (ListWorkers, failing over between routers like Route)."""
        for i, address in enumerate(self.routers):
            try:
                reply = await pb_grpc.RouterStub(self.channels.get(address)).ListWorkers(pb.ListWorkersRequest(),
                                                                                          timeout=5.0)
                return list(reply.workers)
            except grpc.aio.AioRpcError as e:
                if i + 1 == len(self.routers):
                    raise rpc.forward_rpc_error(e, address) from None
        return []

    async def _events(self, decision, work, timeout):
        prompt_tokens = len(work.prompt_token_ids)
        if decision.mode == "unified" or time.monotonic() < self.kvstore_silent_until:
            # unified; or the kvstore was found silent: the decode worker computes the prompt itself
            if decision.mode != "unified":
                work.transfer_id = ""
                call = self.worker(decision.decode_worker).Decode(work, timeout=timeout)
            else:
                call = self.worker(decision.decode_worker).Generate(work, timeout=timeout)
            async for ev in self._stream(call, decision.decode_worker, decision.mode, prompt_tokens):
                yield ev
            return
        prefill = self.worker(decision.prefill_worker).Prefill(work, timeout=timeout)
        decode = self.worker(decision.decode_worker).Decode(work, timeout=timeout)
        prefill_events = self._stream(prefill, decision.prefill_worker, "prefill", prompt_tokens)
        try:
            first = await anext(prefill_events)
            drain = asyncio.ensure_future(drain_events(prefill_events))  # the call ends once its KV has landed
            drain.add_done_callback(lambda f: self._handoff_ended(f, work.transfer_id))
            prompt = first
            yield first
            if first.finish_reason:
                return
            # A handoff that fails after the first token (the kvstore died, or refused the rest) is the decode
            # side's to see: its pull fails and it computes the prompt itself (services/worker/server.py Decode).
            # Its first event waits for the handoff: its bound runs from the handoff's end (and the prompt's cost,
            # for a decode side that recomputes it).
            async for ev in self._stream(decode, decision.decode_worker, "decode", prompt_tokens, after=drain):
                ev.prompt_tokens, ev.cached_prompt_tokens = prompt.prompt_tokens, prompt.cached_prompt_tokens
                yield ev
            try:
                await drain
            except MeshError as e:
                log.info("request %s: the prefill side's KV handoff failed (%s); the decode side recomputed",
                         work.request_id, e)
        except MeshError as e:
            if e.stalled and not await self._kvstore_answers():  # a stalled attempt through a silent kvstore: the
                self.progress.absolve(e.peer)  # kvstore hung, not the worker (it waited on it)
            raise
        finally:
            for call in (prefill, decode):
                call.cancel()
            asyncio.ensure_future(self._release(work.transfer_id))

    def _kvstore_answers(self) -> asyncio.Future:
        """Whether the kvstore answers its stats within KVSTORE_PROBE_S (one probe at a time, shared). A silent one
        is passed by for progress.suspect_s: decode workers compute prompts themselves."""
        if time.monotonic() < self.kvstore_silent_until:
            done = asyncio.get_running_loop().create_future()
            done.set_result(False)
            return done
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_kvstore())
        return asyncio.shield(self._probe)

    async def _probe_kvstore(self) -> bool:
        try:
            await pb_grpc.KVStoreStub(self.channels.get(self.kvstore)).Stats(pb.StatsRequest(),
                                                                              timeout=KVSTORE_PROBE_S)
            return True
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                return True  # it answered
            self.kvstore_silent_until = time.monotonic() + self.progress.suspect_s
            self.stalls.add(1, {"role": "kvstore", "reason": "no answer"})
            log.warning("the kvstore %s did not answer within %g s (%s): decode workers compute prompts themselves "
                        "for %g s", self.kvstore, KVSTORE_PROBE_S, e.code().name, self.progress.suspect_s)
            return False

    def _handoff_ended(self, drain: asyncio.Future, transfer_id: str) -> None:
        """The prefill call ended. If it failed (its worker died after the first token), its KV may never reach the
        kvstore, which then never hears of the transfer: abandon it now, so that the decode side's pull fails at once
        (NOT_FOUND) and it computes the prompt itself, instead of waiting out its 60 s for blocks nobody sends. A
        transfer already complete is left to the decode side, which may be copying its slots."""
        if not drain.cancelled() and drain.exception() is not None:
            asyncio.ensure_future(self._release(transfer_id, abandoned=True))

    async def _release(self, transfer_id: str, abandoned: bool = False) -> None:
        """Drop the transfer; waits up to 5 s a try for a kvstore that is coming back (its new incarnation may already
        hold blocks a prefill put there while this gateway's channel was still reconnecting), and tries again for up
        to RELEASE_RETRY_S while it does not answer (coming back, or hung)."""
        give_up = time.monotonic() + RELEASE_RETRY_S
        while True:
            try:
                await pb_grpc.KVStoreStub(self.channels.get(self.kvstore)).Release(
                    pb.ReleaseRequest(transfer_id=transfer_id, abandoned=abandoned), timeout=5, wait_for_ready=True)
                return
            except grpc.aio.AioRpcError as e:
                # a hung kvstore: again until it answers (its TTL would hold the transfer's blocks a minute)
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= give_up:
                    return  # the kvstore's TTL drops an unclaimed transfer anyway

    async def _stream(self, call, peer: str, role: str = "", prompt_tokens: int = 0, after=None):
        """The call's events, each held to the progress bound (services.policy.progress): a stream whose worker sends
        nothing within it is cancelled by the watchdog and fails as UNAVAILABLE from `peer` (resumed elsewhere). The
        first event's bound counts the prompt; with `after` (a future: the KV handoff it waits on), it runs only from
        when that is done."""
        watch, now = self.progress, time.monotonic()
        first = watch.first_s(peer, role, prompt_tokens)
        waits = after is not None and not after.done()
        watched = watch.open(peer, role, math.inf if waits else first, now, call, handoff=after is not None,
                             prompt_tokens=prompt_tokens)
        if waits:
            def start(_) -> None:
                if not watched.events:  # the handoff is over: the first event is due within its bound from now
                    watch.waiting(watched, first, time.monotonic())
            after.add_done_callback(start)
        self._watch_streams()
        try:
            async for ev in call:
                watch.event(watched, time.monotonic())
                watched.handoff = role == "prefill"  # after its first event, a prefill stream is its KV handoff
                yield ev
                watch.waiting(watched, watch.next_s(peer), time.monotonic())
        except grpc.aio.AioRpcError as e:
            raise rpc.forward_rpc_error(e, peer) from None
        except asyncio.CancelledError:
            if not watched.reason:
                raise
            who = "the kvstore" if watched.kvstore else f"the {role or 'worker'} worker {peer}"
            err = Unavailable(f"{who} made no progress: {watched.reason}")
            err.peer, err.stalled = self.kvstore if watched.kvstore else peer, True
            raise err from None
        finally:
            watch.close(watched)

    def _watch_streams(self) -> None:
        """Start the watchdog (one task for every stream) if it is not running."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watchdog_loop())

    async def _watchdog_loop(self) -> None:
        while self.progress.streams:
            await asyncio.sleep(STALL_POLL_S)
            stalled, overdue = self.progress.stalled(time.monotonic())
            for watched in stalled:
                self._stalled(watched)
            if overdue and (self._checking is None or self._checking.done()):
                self._checking = asyncio.ensure_future(self._check_handoffs(overdue))

    async def _check_handoffs(self, overdue: list) -> None:
        """Handoffs past their bound on workers that step: stalled if the kvstore is silent, else their bound runs
        again."""
        if await self._kvstore_answers():
            self.progress.extend(overdue, time.monotonic())
            return
        for watched in self.progress.stall_on_kvstore(overdue, f"no answer within {KVSTORE_PROBE_S:g} s"):
            self._stalled(watched)

    def _stalled(self, watched: Watched) -> None:
        who = "the kvstore" if watched.kvstore else f"the {watched.role} worker {watched.address}"
        log.warning("%s made no progress: %s; cancelling its stream to resume it elsewhere", who, watched.reason)
        self.stalls.add(1, {"role": "kvstore" if watched.kvstore else watched.role or "worker",
                            "reason": "forgotten" if "heartbeats" in watched.reason else "no progress"})
        watched.handle.cancel()

    @rpc.mapped
    async def ListModels(self, request, context):
        self.auth.authenticate(api_key(context))  # behind the key when tenants are configured, as /v1/models
        m = self.model
        return pb.ListModelsResponse(models=[pb.ModelInfo(name=name, max_model_len=m.max_model_len,
                                                          vocab_size=m.vocab_size,
                                                          parent=parent) for name, parent in await self.model_names()])

    async def model_names(self) -> list[tuple[str, str]]:
        """(name, parent) of every model a request may name: the base model's names, then the adapters (parent: the
        base model), as vLLM lists them."""
        try:
            await self.adapters.refresh()
        except MeshError as e:
            log.warning("listing adapters: %s", e)
        return [(name, "") for name in self.model.names] + [(a, self.model.name) for a in sorted(self.adapters.known)]

    async def _select_adapter(self, req: ClientRequest) -> ClientRequest:
        """A model field naming an adapter selects it, as in vLLM: the request as the rest of the path sees it (model
        empty, adapter set). A name neither the base model nor an adapter has is NOT_FOUND."""
        if not req.model or req.model in self.model.names:
            return req
        bounded(req.model, "model", MAX_ID_BYTES)
        try:
            await self.adapters.check(req.model)
        except NotFound:
            self.model.check(req.model)  # NOT_FOUND naming the model
        if req.adapter and req.adapter != req.model:
            raise InvalidRequest(f"model {req.model!r} names an adapter and adapter {req.adapter!r} another")
        return replace(req, adapter=req.model, model="")

    # ---- LoRA adapters at run time (admin) ----------------------------------------------------------

    def _admin(self, request, context) -> None:
        """An admin call: the caller's key must be an admin's, the message well-formed, the name bounded."""
        self.auth.authenticate(api_key(context)).check_admin()
        if isinstance(request, BadMessage):
            raise InvalidRequest(request.error)
        bounded(request.name, "name", MAX_ID_BYTES)

    @rpc.mapped
    async def LoadAdapter(self, request, context):
        self._admin(request, context)
        return await self.adapters.load(request.name, request.path)

    @rpc.mapped
    async def UnloadAdapter(self, request, context):
        self._admin(request, context)
        return await self.adapters.unload(request.name)

    @rpc.mapped
    async def ListAdapters(self, request, context):
        self.auth.authenticate(api_key(context))
        await self.adapters.refresh()
        return await self.adapters.listing()

    @rpc.mapped
    async def Tokenize(self, request, context):
        self.auth.authenticate(api_key(context))
        if isinstance(request, BadMessage):
            raise InvalidRequest(request.error)
        bounded(request.model, "model", MAX_ID_BYTES)
        self.model.check(request.model)
        return pb.TokenizeResponse(token_ids=self.encode(utf8(request.text, "text"), "text"))


def add_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    """Register every RPC of the Generation service, the table built from the proto's descriptor (a new
    RPC without a servicer method fails here, at start), with tolerant request parsing (invalid UTF-8
    becomes INVALID_ARGUMENT, not INTERNAL)."""
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    handlers = {}
    for method in service.methods:
        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            getattr(servicer, method.name), request_deserializer=tolerant(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
