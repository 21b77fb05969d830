"""`meshserve chat`: talk to a running mesh from a terminal, streaming each answer as it is generated.

It speaks the gateway's OpenAI-compatible HTTP API (/v1/chat/completions with stream=true; the
gateway renders the model's chat template) and keeps the conversation, so each turn sees the earlier
ones. Lines starting with / are commands: /reset forgets the conversation, /exit (or end of input)
leaves. Reading lines from a pipe works too, which is how it is tested.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

COMMANDS = "/reset forgets the conversation, /exit leaves"


class ChatError(Exception):
    """The mesh refused a turn or could not be reached; the message says which."""


def stream_reply(url: str, body: dict, api_key: str | None, timeout_s: float):
    """The text deltas of one streamed chat completion, as they arrive."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        raise ChatError(f"HTTP {e.code}: {_error_message(e.read())}") from None
    except urllib.error.URLError as e:
        raise ChatError(f"cannot reach {url} ({e.reason}); is `meshserve up` running?") from None
    except OSError as e:  # a timeout or a reset before the response began
        raise ChatError(f"cannot reach {url} ({e}); is `meshserve up` running?") from None
    with resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise ChatError(chunk["error"].get("message", "error"))
            for choice in chunk.get("choices", ()):
                if choice.get("delta", {}).get("content"):
                    yield choice["delta"]["content"]


def _error_message(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return data.decode(errors="replace")[:200]


def run_chat(args, read=input, out=sys.stdout) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.url} ({COMMANDS})", file=out, flush=True)
    while True:
        try:
            text = read("> " if interactive else "").strip()
        except EOFError:
            return 0
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        body = {"messages": messages, "stream": True, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p}
        if args.model:
            body["model"] = args.model
        answer = []
        try:
            for delta in stream_reply(args.url, body, args.api_key, args.timeout):
                answer.append(delta)
                print(delta, end="", file=out, flush=True)
        except ChatError as e:
            messages.pop()
            print(f"\nmeshserve chat: {e}", file=sys.stderr, flush=True)
            if not interactive:
                return 1
            continue
        print(file=out, flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})


def add_parser(sub) -> None:
    chat = sub.add_parser("chat", help="talk to a running mesh (streaming, keeps the conversation)")
    chat.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP address")
    chat.add_argument("--model", help="model name (default: the one the mesh serves)")
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, default=512)
    # Greedy by default: the default model is a 4-bit 135M model, near-tied on its first token for
    # "What is the capital of France?" ("The" 25%, "L" 22% at temperature 0.7), and sampled it wanders.
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--api-key", help="a tenant's API key, when the mesh has tenants")
    chat.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for one answer")
    chat.set_defaults(func=run_chat)
