"""What a client of `kapc serve` needs, with no engine, torch or HTTP library beyond the standard
one: the request a prior describes, the `vllm_xargs` that carry its plan, and the statistics the
server kept for it.

    from openai import OpenAI
    from kapc.client import chat_messages, plan_xargs, request_stats

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=chat_messages(prior), max_tokens=64,
        temperature=0, extra_body={"vllm_xargs": plan_xargs(prior=prior, tag="q1")})
    request_stats("http://127.0.0.1:8000", "q1")   # proposed, accepted, s, compile_s, ...

The messages must be the prior's (`chat_messages`): the server compiles the prior against the
prompt it renders, and refuses the plan (for that request only) when the two differ.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kapc.errors import KapcError
from kapc.prior import Prior, encode_prior, load_prior
from kapc.runtime.session import OPTS_KEY, PLAN_KEY, PRIOR_KEY, TAG_KEY


class ClientError(KapcError):
    """A prior the chat API cannot carry, or statistics the server does not have."""


def _prior(prior: Prior | str | Path) -> Prior:
    return prior if isinstance(prior, Prior) else load_prior(prior)


def chat_messages(prior: Prior | str | Path) -> list[dict]:
    """The chat messages of a prior's request, as the OpenAI API takes them: each message's
    content is its segments' texts joined with nothing between them (as the compiler renders
    it)."""
    p = _prior(prior)
    if p.request.messages is None:
        raise ClientError(
            f"prior {p.name!r} has a raw request: send `prompt_text(prior)` to the "
            f"completions API instead of chat messages"
        )
    return [
        {"role": m.role, "content": "".join(s.text for s in m.segments)} for m in p.request.messages
    ]


def prompt_text(prior: Prior | str | Path) -> str:
    """The prompt of a prior's raw request, for the completions API."""
    p = _prior(prior)
    if p.request.raw is None:
        raise ClientError(f"prior {p.name!r} has chat messages: send `chat_messages(prior)`")
    return "".join(s.text for s in p.request.raw)


def plan_xargs(
    *,
    prior: Prior | str | Path | None = None,
    kapb: bytes | str | Path | None = None,
    tag: str | None = None,
    accept: str | None = None,
) -> dict:
    """The `vllm_xargs` of a request that carries its prior (compiled by the server, cached by
    content) or a compiled `.kapb` (bytes or a path); `tag` names its statistics; `accept`
    overrides the plan's acceptance rule ("greedy", lossless, or "top3", tolerant)."""
    if (prior is None) == (kapb is None):
        raise ClientError("give a request either its prior or its compiled .kapb")
    xargs: dict = {}
    if prior is not None:
        xargs[PRIOR_KEY] = encode_prior(_prior(prior), indent=0).decode()
    else:
        data = kapb if isinstance(kapb, bytes) else Path(kapb).read_bytes()
        xargs[PLAN_KEY] = base64.b64encode(data).decode()
    if tag is not None:
        xargs[TAG_KEY] = str(tag)
    if accept is not None:
        xargs[OPTS_KEY] = json.dumps({"accept": accept})
    return xargs


def request_stats(base_url: str, tag: str, timeout: float = 10.0) -> dict:
    """The server's statistics for the request tagged `tag` (`GET /kapc/stats/<tag>` on the
    server's root, e.g. http://127.0.0.1:8000): status, reason, source, compile_s, proposed,
    accepted, acceptance_rate, retained_ratio, k, accept. Waits up to `timeout` seconds for a
    request the engine has not seen yet."""
    root = base_url.rstrip("/").removesuffix("/v1")
    url = f"{root}/kapc/stats/{urllib.parse.quote(tag, safe='')}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or time.monotonic() > deadline:
                raise ClientError(
                    f"{url}: {exc.code} {exc.read().decode(errors='replace')}"
                ) from None
        time.sleep(0.2)


def server_stats(base_url: str, timeout: float = 10.0) -> dict:
    """Everything the server's hook reports (`GET /kapc/stats`): `requests` by tag, `live` (the
    requests it holds state for now), `timing` and the step `policy`."""
    root = base_url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/kapc/stats", timeout=timeout) as r:
        return json.loads(r.read())
