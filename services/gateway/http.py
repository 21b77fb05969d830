"""The OpenAI-compatible HTTP face of the gateway (Starlette under uvicorn, on the gateway's event loop).

One implementation, two faces: each HTTP request becomes GenerateRequests that go through
GatewayServicer.generate(), the same tenant, admission, routing and streaming path as gRPC.

- POST /v1/completions, POST /v1/chat/completions: stream (Server-Sent Events ending with
  `data: [DONE]`) or not; usage with prompt_tokens_details.cached_tokens; stream_options.include_usage.
  A list of prompts gives n choices per prompt (index = prompt * n + j); each of the n is its own
  request (seed + j when a seed is given), and they share the prompt's prefix in the KV cache.
  Structured outputs: response_format json_object / json_schema, vLLM's structured_outputs and
  guided_json / guided_regex / guided_choice / guided_grammar. Top logprobs (chat top_logprobs,
  completions logprobs: k), echo (completions).
- POST /tokenize, POST /detokenize as vLLM's server names them.
- GET /v1/models, GET /health, GET /metrics (the gateway's metrics as Prometheus text).
- Extensions load generators send are honoured: ignore_eos, min_tokens, top_k, min_p,
  repetition_penalty (1.0 only); meshserve's own: priority, deadline_ms, criticality, slo_ttft_ms,
  slo_tpot_ms (also as headers x-criticality, x-slo-ttft-ms, x-slo-tpot-ms). null means absent.
- A field that would change the result and that we cannot honour (best_of > 1, suffix, tools, a
  non-zero penalty, logit_bias, prompt logprobs) is a 400 in the OpenAI error shape naming the field.
- Authorization: Bearer KEY is the same tenant key as gRPC's. Errors map as in INTERFACES.md
  (429 and 503 carry Retry-After when the mesh can tell when to try again). A client that
  disconnects aborts its request everywhere.
- Traced: a server span per request; the mesh calls it makes are its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass

from opentelemetry import trace
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.common.errors import InvalidRequest, MeshError, NotFound, http_status
from services.common.pb import meshserve_pb2 as pb
from services.common.request import ClientRequest, with_headers
from services.common.telemetry import PROMETHEUS_CONTENT_TYPE, prometheus_text
from services.gateway.chat import ChatTemplate
from services.gateway.openai_models import OpenAIBodyError, parse_body
from services.gateway.tools import ToolOutput, ToolPlan

log = logging.getLogger("meshserve.gateway.http")
tracer = trace.get_tracer("meshserve.gateway.http")

class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_ms: int | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after_ms = status, param, code, retry_after_ms

    @staticmethod
    def of(err: MeshError) -> OpenAIError:
        return OpenAIError(http_status(err), str(err), code=err.code.lower(), retry_after_ms=err.retry_after_ms)

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error",
                503: "service_unavailable_error"}.get(self.status, "internal_error")
        headers = {}
        if self.retry_after_ms is not None and self.status in (429, 503):
            headers = {"Retry-After": str(math.ceil(self.retry_after_ms / 1000)),  # 0 beside 0: the same advice
                       "retry-after-ms": str(self.retry_after_ms)}
        return JSONResponse({"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status, headers=headers)


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def _answered(endpoint):
    """An endpoint whose OpenAIError or MeshError becomes its error response (OpenAI's shape)."""
    @functools.wraps(endpoint)
    async def answer(self, request: Request) -> Response:
        try:
            return await endpoint(self, request)
        except OpenAIError as e:
            return e.response()
        except MeshError as e:
            return OpenAIError.of(e).response()
    return answer


class HttpFront:
    def __init__(self, servicer, model_dir: str):
        self.servicer = servicer
        self.model = servicer.model
        self.chat_template = ChatTemplate.from_model_dir(model_dir)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])

    # ---- simple endpoints ----------------------------------------------------------------------

    @_answered
    async def models(self, request: Request) -> Response:
        self.servicer.auth.authenticate(_bearer(request))
        m = self.model
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "meshserve", "max_model_len": m.max_model_len,
             "parent": parent or None}
            for name, parent in await self.servicer.model_names()]})

    @_answered
    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {"prompt"} or {"messages"} (the chat template; add_generation_prompt as given) ->
        {"count", "max_model_len", "tokens", "token_strs"} (token_strs when return_token_strs)."""
        self.servicer.auth.authenticate(_bearer(request))
        body = await _json(request, self.servicer.bounds.max_body_bytes)
        self._check_model(body.get("model"))
        special = body.get("add_special_tokens")
        if special is not None and not isinstance(special, bool):
            raise bad("add_special_tokens", "add_special_tokens must be a boolean")
        if "messages" in body:
            generation = body.get("add_generation_prompt", True)
            if not isinstance(generation, bool):
                raise bad("add_generation_prompt", "add_generation_prompt must be a boolean")
            ids = self._chat_prompt(body["messages"], generation, bool(special))
        elif isinstance(body.get("prompt"), str):
            ids = self._encode(body["prompt"], "prompt", add_special_tokens=special is not False)
        else:
            raise bad("prompt", "give prompt (a string) or messages (a list)")
        out = {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids, "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = [self._token_text(t) for t in ids]
        return JSONResponse(out)

    @_answered
    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text} (special tokens skipped)."""
        self.servicer.auth.authenticate(_bearer(request))
        body = await _json(request, self.servicer.bounds.max_body_bytes)
        self._check_model(body.get("model"))
        ids = body.get("tokens")
        vocab = self.model.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise bad("tokens", f"tokens must be a list of token ids in [0, {vocab})")
        return JSONResponse({"prompt": self.servicer.tokenizer.decode(ids)})

    def _check_model(self, model) -> None:
        if model is None or model in self.servicer.adapters.known:
            return
        try:
            self.model.check(model if isinstance(model, str) else str(model))
        except NotFound as e:
            raise OpenAIError(404, str(e), param="model", code="model_not_found") from None

    def _token_text(self, token: int) -> str:
        return self.servicer.tokenizer.decode([token])

    # ---- LoRA adapters at run time, as vLLM's server takes them (an admin key) ---------------------

    @_answered
    async def load_lora_adapter(self, request: Request) -> Response:
        name, path = await self._adapter_admin(request, load=True)
        await self.servicer.adapters.load(name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @_answered
    async def unload_lora_adapter(self, request: Request) -> Response:
        name, _ = await self._adapter_admin(request, load=False)
        await self.servicer.adapters.unload(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    async def _adapter_admin(self, request: Request, load: bool) -> tuple[str, str | None]:
        """The admin's checked (lora_name, lora_path)."""
        self.servicer.auth.authenticate(_bearer(request)).check_admin()
        body = await _json(request, 64 * 1024)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise bad("lora_name", "lora_name is required (a string)")
        if load and (not isinstance(path, str) or not path):
            raise bad("lora_path", "lora_path is required (a string)")
        return name, path

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(prometheus_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    # ---- generation ----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        span = tracer.start_span(f"POST {request.url.path}", kind=trace.SpanKind.SERVER,
                                 attributes={"http.request.method": "POST", "url.path": request.url.path})
        try:
            body = await _json(request, self.servicer.bounds.max_body_bytes)
            if isinstance(body.get("user"), str):
                span.set_attribute("enduser.id", body["user"])
            await self._learn_adapter(body.get("model"))
            reqs, opts = self._requests(body, chat)
            try:
                reqs = [with_headers(r, request.headers) for r in reqs]
            except InvalidRequest as e:
                raise bad("headers", str(e)) from None
        except OpenAIError as e:
            span.set_attribute("http.response.status_code", e.status)
            span.end()
            return e.response()
        key = _bearer(request)
        call = _Call(self.servicer, reqs, key, span, group=opts.n)
        first = await call.start()  # errors before the first token (auth, limits, queue) are HTTP statuses
        if isinstance(first, OpenAIError):
            return first.response()
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": reqs[0].model or self.model.name}
        if opts.stream:
            return StreamingResponse(self._sse(call, meta, chat, opts), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._collect(request, call, meta, chat, opts)

    async def _learn_adapter(self, model) -> None:
        """A model that is not the base model may be an adapter the gateway has not heard of yet: ask the mesh."""
        if isinstance(model, str) and model and model not in self.model.names and len(model) <= 256:
            with contextlib.suppress(MeshError):
                await self.servicer.adapters.check(model)

    def _requests(self, body: dict, chat: bool) -> tuple[list, _Options]:
        """The ClientRequests of one HTTP body (n per prompt, prompt-major: choice index = prompt * n + j), and the
        response options."""
        try:
            b = parse_body(body, chat)
            adapter = b.model if b.model and b.model in self.servicer.adapters.known else ""
            if not adapter:
                self._check_model(b.model)
            tools = b.tool_plan() if chat else None
            prompts = [self._chat_prompt(b.messages, tools=tools and tools.prompt_tools)] if chat else b.prompts()
            max_tokens = b.max_completion_tokens if chat and b.max_completion_tokens is not None else b.max_tokens
            out, echoes, n = [], [], b.choices_per_prompt
            for p in prompts:
                mt = max_tokens
                if mt is None:
                    length = len(p) if isinstance(p, list) else len(self._encode(p, "prompt"))
                    mt = 16 if not chat else max(self.model.max_model_len - length, 1)
                for j in range(n):
                    out.append(ClientRequest(
                        client_id=uuid.uuid4().hex,
                        sampling=b.sampling(mt, b.want_logprobs, b.num_top_logprobs, b.choice_seed(j)),
                        text=p if isinstance(p, str) else None, token_ids=tuple(p) if isinstance(p, list) else None,
                        priority=b.priority or 0, deadline_ms=b.deadline_ms or 0, model=adapter,
                        criticality=b.criticality or "", slo_ttft_ms=b.slo_ttft_ms or 0,
                        slo_tpot_ms=b.slo_tpot_ms or 0))
                    if not chat and b.echo:
                        echoes.append(p if isinstance(p, str) else self.servicer.tokenizer.decode(p))
        except OpenAIBodyError as e:
            raise bad(e.param, str(e)) from None
        return out, _Options(bool(b.stream), b.include_usage, b.want_logprobs, echoes, tools, n)

    def _chat_prompt(self, messages: list, add_generation_prompt: bool = True, add_special_tokens: bool = False,
                     tools: list | None = None) -> list:
        if self.chat_template is None:
            raise bad("messages", f"model {self.model.name!r} has no chat template (chat_template.jinja or "
                                  "tokenizer_config.json chat_template); use /v1/completions")
        try:
            text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except InvalidRequest as e:
            raise bad("messages", str(e)) from None
        return self._encode(text, "messages", add_special_tokens=add_special_tokens)

    def _encode(self, text: str, param: str, **kwargs) -> list:
        """The servicer's bounded tokenization (over the prompt limit or invalid Unicode: 400 naming param)."""
        try:
            return self.servicer.encode(text, param, **kwargs)
        except InvalidRequest as e:
            raise bad(param, str(e)) from None

    def _logprobs(self, r, chat: bool) -> dict:
        """The sampled tokens' logprobs, and the most likely alternatives at each when asked (top_logprobs)."""
        text = self._token_text
        tokens = [text(t) for t in r.token_ids]
        tops = [list(zip(top.token_ids, top.logprobs)) for top in r.top_logprobs] or [None] * len(tokens)
        if chat:
            def entry(t, x):
                return {"token": t, "logprob": x, "bytes": list(t.encode())}
            return {"content": [{**entry(t, x), "top_logprobs": [entry(text(i), v) for i, v in top or ()]}
                                for t, x, top in zip(tokens, r.logprobs, tops)]}
        top_logprobs = [_first_per_text((text(i), v) for i, v in top) for top in tops] if r.top_logprobs else None
        return {"tokens": tokens, "token_logprobs": list(r.logprobs), "top_logprobs": top_logprobs,
                "text_offset": None}

    async def _sse(self, call: _Call, meta: dict, chat: bool, opts: _Options):
        kind = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                for i in range(len(call.reqs)):
                    yield _event({**meta, "object": kind, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
            for i, echo in enumerate(opts.echoes):
                yield _event({**meta, "object": kind, "choices": [
                    {"index": i, "text": echo, "logprobs": None, "finish_reason": None}]})
            follow = opts.tool_outputs(len(call.reqs))
            async for index, r in call.responses():
                if isinstance(r, OpenAIError):
                    yield _event({"error": {"message": str(r), "code": r.code}})
                    break
                choice = {"index": index, "logprobs": self._logprobs(r, chat) if opts.want_logprobs else None,
                          "finish_reason": r.finish_reason or None}
                if chat and follow[index] is not None:
                    choice["delta"] = _tool_delta(follow[index], r)
                    choice["finish_reason"] = r.finish_reason and (follow[index].finish_reason or r.finish_reason)
                elif chat:
                    choice["delta"] = {"content": r.text} if r.text or not r.finish_reason else {}
                else:
                    choice["text"] = r.text
                chunk = {**meta, "object": kind, "choices": [choice]}
                if opts.include_usage:
                    chunk["usage"] = None
                yield _event(chunk)
            else:
                if opts.include_usage:
                    yield _event({**meta, "object": kind, "choices": [], "usage": call.usage()})
            yield "data: [DONE]\n\n"
        finally:
            call.cancel()  # a client that went away: abort everywhere

    async def _collect(self, request: Request, call: _Call, meta: dict, chat: bool, opts: _Options) -> Response:
        want_logprobs = opts.want_logprobs
        texts = [[echo] for echo in opts.echoes] or [[] for _ in call.reqs]
        finish = [None] * len(call.reqs)
        lps = [[] for _ in call.reqs]

        async def gather():
            async for index, r in call.responses():
                if isinstance(r, OpenAIError):
                    return r
                texts[index].append(r.text)
                if want_logprobs:
                    lps[index].append(self._logprobs(r, chat))
                finish[index] = r.finish_reason or finish[index]
            return None

        task = asyncio.ensure_future(gather())
        try:
            while not task.done():  # a client that disconnects aborts the request everywhere
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if not done and await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
            error = task.result()
        finally:
            call.cancel()
        if error is not None:
            return error.response()
        choices = []
        for i, follow in enumerate(opts.tool_outputs(len(call.reqs))):
            text = "".join(texts[i])
            lp = _merge_logprobs(lps[i], chat) if want_logprobs else None
            if chat and follow is not None:
                content = follow.push(text)
                rest, calls = follow.finish()
                text = content + rest
                message = {"role": "assistant", "content": (text if text.strip() else None) if calls else text}
                if calls:
                    message["tool_calls"] = calls
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": follow.finish_reason or finish[i]})
            elif chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
        return JSONResponse({**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                             "usage": call.usage()})


@dataclass(frozen=True)
class _Options:
    """How one HTTP request's response is written."""

    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    want_logprobs: bool
    echoes: list  # completions echo: each choice's text starts with its prompt's (empty: no echo)
    tools: ToolPlan | None = None  # chat with tools: each choice's output is followed for tool calls
    n: int = 1  # choices per prompt

    def tool_outputs(self, choices: int) -> list:
        """One ToolOutput per choice (None each where the output is plain text)."""
        return [self.tools.output() if self.tools else None for _ in range(choices)]


class _Call:
    """The mesh calls of one HTTP request, run in one task under the request's span.

    Each prompt's stream is pumped into a queue; start() waits for the first response of every
    prompt, so that errors before any token can still be HTTP statuses. With n choices per prompt
    (group), the first choice of each prompt goes alone and the others follow at its first token:
    by then its prompt's KV blocks are in the prefix cache (and the router's index), so the other
    n - 1 read the prompt instead of computing it n times over in one step."""

    def __init__(self, servicer, reqs: list, key: str | None, span, group: int = 1):
        self.servicer, self.reqs, self.key, self.span = servicer, reqs, key, span
        self.group = group
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: list = []
        self.prompt_tokens = [0] * len(reqs)
        self.cached_tokens = [0] * len(reqs)
        self.completion_tokens = [0] * len(reqs)
        self.task: asyncio.Task | None = None
        self.done = 0

    async def start(self):
        """None when streams are under way (the first responses are held), or the OpenAIError."""
        with trace.use_span(self.span, end_on_exit=False):
            self.task = asyncio.ensure_future(self._run())  # copies the context: the span is the parent
        held, started = [], set()
        while len(started) < len(self.reqs):
            index, r = await self.queue.get()
            if isinstance(r, OpenAIError):
                self.cancel()
                return r
            started.add(index)
            if r is None:  # that prompt's stream has ended already
                self.done += 1
            else:
                held.append((index, r))
        self.pending = held
        return None

    async def _run(self) -> None:
        prefilled = [asyncio.Event() for _ in range(0, len(self.reqs), self.group)]

        async def one(index, req):
            leader = index % self.group == 0
            try:
                if not leader:
                    await prefilled[index // self.group].wait()
                async with contextlib.aclosing(self.servicer.generate(req, self.key)) as responses:
                    async for r in responses:
                        self._account(index, r)
                        await self.queue.put((index, r))
                        if leader:
                            prefilled[index // self.group].set()
            except MeshError as e:
                await self.queue.put((index, OpenAIError.of(e)))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("HTTP generation failed")
                await self.queue.put((index, OpenAIError(500, "internal error", code="internal")))
            finally:
                if leader:
                    prefilled[index // self.group].set()  # it ended before a token: the others go anyway
                await self.queue.put((index, None))

        try:
            await asyncio.gather(*(one(i, r) for i, r in enumerate(self.reqs)))
        finally:
            self.span.end()

    def _account(self, index: int, r) -> None:
        self.prompt_tokens[index] = r.prompt_tokens or self.prompt_tokens[index]
        self.cached_tokens[index] = max(self.cached_tokens[index], r.cached_prompt_tokens)
        self.completion_tokens[index] += len(r.token_ids)

    async def responses(self):
        """(choice index, GenerateResponse or OpenAIError) until every prompt's stream has ended. Responses of one
        choice that queued while the client was being written to come merged as one (one SSE event, not one per
        step: a stream that falls behind catches up in fewer, larger writes)."""
        for item in self.pending:
            yield item
        self.pending = []
        while self.done < len(self.reqs):
            ready = [await self.queue.get()]
            while not self.queue.empty():
                ready.append(self.queue.get_nowait())
            for index, r in _merged(ready):
                if r is None:
                    self.done += 1
                    continue
                yield index, r

    def usage(self) -> dict:
        p, c = sum(self.prompt_tokens), sum(self.completion_tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


def _merged(items: list) -> list:
    """Consecutive (index, GenerateResponse) items of one choice as one response (tokens, logprobs and text joined,
    the last one's finish reason); errors and ends (None) pass as they are."""
    out = []
    for index, r in items:
        last = out[-1] if out else None
        if (last is not None and last[0] == index and isinstance(r, pb.GenerateResponse)
                and isinstance(last[1], pb.GenerateResponse) and not last[1].finish_reason):
            m = last[1]
            m.token_ids.extend(r.token_ids)
            m.logprobs.extend(r.logprobs)
            m.top_logprobs.extend(r.top_logprobs)
            m.text += r.text
            m.finish_reason = r.finish_reason
        else:
            out.append((index, r))
    return out


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _merge_logprobs(parts: list, chat: bool) -> dict:
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    tops = [p["top_logprobs"] for p in parts]
    return {"tokens": [t for p in parts for t in p["tokens"]],
            "token_logprobs": [x for p in parts for x in p["token_logprobs"]],
            "top_logprobs": [x for t in tops for x in t] if all(t is not None for t in tops) and tops else None,
            "text_offset": None}


def _tool_delta(follow: ToolOutput, r) -> dict:
    """A chat stream's delta under tools: content as it becomes safe to send; at the end, the rest and the calls."""
    delta = {}
    content = follow.push(r.text)
    if r.finish_reason:
        rest, calls = follow.finish()
        content += rest
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
    if content:
        delta["content"] = content
    return delta


def _first_per_text(pairs) -> dict:
    """{token text: logprob}, best first; two ids with one text (parts of one UTF-8 character decode alike) keep
    the better logprob."""
    out = {}
    for text, value in pairs:
        out.setdefault(text, value)
    return out


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    if value.lower().startswith("bearer "):
        return value[7:].strip() or None
    return request.headers.get("x-api-key")


async def _json(request: Request, limit: int) -> dict:
    """The body as a JSON object, read only up to limit bytes (413 beyond: nothing larger is buffered). A body that
    declares a type other than JSON is 415 (none, and curl's default form type, are read as JSON, as vLLM does)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind not in JSON_TYPES and not kind.endswith("+json"):
        raise OpenAIError(415, f"the request body must be JSON (Content-Type: application/json), not {kind}",
                          code="unsupported_media_type")
    too_large = OpenAIError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                          code="body_timeout") from None
    except ClientDisconnect:  # it sent less than its Content-Length, then closed
        raise OpenAIError(400, "the request body ended before its Content-Length (the client went away)",
                          code="incomplete_body") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise OpenAIError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise OpenAIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply to parse (arrays or objects inside one "
                               "another)", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")  # the latter: what curl -d sends

BODY_TIMEOUT_S = 30.0  # a request's body must arrive within this long of its head (http_server.py times heads)
