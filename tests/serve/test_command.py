"""`kapc serve`'s command line, without starting a server: what it asks vLLM for, and the clear
errors for what the engine cannot run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kapc.policy import MAX_AUTO_K
from kapc.runtime.vllm import PROPOSER_CLASS, SCHEDULER_CLASS, WORKER_EXTENSION_CLASS
from kapc.runtime.vllm.serve import MIDDLEWARE, ServeError, server_command


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_default_server_runs_kapcs_hook_on_the_cached_model():
    cmd = server_command(port=8123)
    a = cmd.argv
    assert a[1:3] == ["-m", a[2]] and a[2].startswith("vllm.entrypoints")
    spec = json.loads(_opt(a, "--speculative-config"))
    assert spec == {
        "method": "custom_class",
        "model": PROPOSER_CLASS,
        "num_speculative_tokens": MAX_AUTO_K,
    }
    assert _opt(a, "--scheduler-cls") == SCHEDULER_CLASS
    assert _opt(a, "--worker-extension-cls") == WORKER_EXTENSION_CLASS
    assert _opt(a, "--middleware") == MIDDLEWARE
    assert _opt(a, "--block-size") == "32"  # vLLM's CPU attention
    # sized, or vLLM's CPU worker asks for 92% of the machine and refuses to start
    assert int(_opt(a, "--kv-cache-memory-bytes")) == 4 * 2**30
    assert cmd.url == "http://127.0.0.1:8123/v1" and cmd.model_name == "smollm2-135m-instruct"


def test_options_pass_through_and_the_baseline_has_no_hook():
    cmd = server_command(
        hook=False, extra=["--max-num-seqs", "32", "--kv-cache-memory-bytes", "1000000000"]
    )
    assert "--speculative-config" not in cmd.argv and "--middleware" not in cmd.argv
    assert cmd.argv[-4:] == ["--max-num-seqs", "32", "--kv-cache-memory-bytes", "1000000000"]
    assert cmd.argv.count("--kv-cache-memory-bytes") == 1  # the caller's size, not ours


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"block_size": 16}, "multiple of 32"),
        ({"k": 0}, "at least 1"),
        ({"model": "/nonexistent/model"}, "not a registered model nor a directory"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_before_it_starts(kwargs, says):
    with pytest.raises(ServeError, match=says):
        server_command(**kwargs)


def test_the_command_line_reports_a_bad_option_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "kapc", "serve", "--block-size", "48"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert "multiple of 32" in r.stderr and "Traceback" not in r.stderr


def test_the_documented_server_command_is_the_one_kapc_serve_runs():
    """docs/serving.md gives the raw vLLM command for starting the server by hand: every option
    it sets must be what `kapc serve` sets, so the two cannot drift apart."""
    import shlex
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    block = doc.split("```sh\npython -m ", 1)[1].split("```", 1)[0]
    words = shlex.split("python -m " + block.replace("\\\n", " "))
    cmd = server_command()
    assert words[2] == cmd.argv[2]  # the module
    for i, word in enumerate(words[3:], start=3):
        if word.startswith("--") and word not in ("--model", "--enforce-eager"):
            assert word in cmd.argv, f"{word} is documented but kapc serve does not set it"
            assert _opt(cmd.argv, word) == words[i + 1], word
    assert "--enforce-eager" in words and "--enforce-eager" in cmd.argv


def test_kapcs_routes_are_an_asgi_class_that_passes_other_requests_through():
    """vLLM adds a `--middleware` class with `add_middleware`, and wraps a function as
    Starlette's BaseHTTPMiddleware, which relays every streamed chunk of every response through
    a task of its own. kapc's routes are a class: a streamed response reaches the client as its
    endpoint sent it, and `/kapc/stats` of an app with no engine says why it cannot answer."""
    import importlib
    import inspect

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from fastapi.testclient import TestClient

    module, name = MIDDLEWARE.rsplit(".", 1)
    routes = getattr(importlib.import_module(module), name)
    assert inspect.isclass(routes)
    app = FastAPI()

    @app.get("/v1/stream")
    async def stream():
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app.add_middleware(routes)
    with TestClient(app) as client:
        with client.stream("GET", "/v1/stream") as r:
            assert list(r.iter_text()) == [f"data: {i}\n\n" for i in range(3)]
        down = client.get("/kapc/stats")
        assert down.status_code == 503 and "the workers did not report" in down.json()["error"]
        assert client.post("/kapc/stats").status_code == 405
