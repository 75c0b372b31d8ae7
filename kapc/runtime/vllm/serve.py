"""`kapc serve`: vLLM's OpenAI-compatible server with kapc's proposer, scheduler and worker
extension, and one route of kapc's own.

- The server is vLLM's (`python -m <compat.api_server_module()>`), started with the three classes
  by name and a block size the engine supports; every option kapc does not set passes through.
- `GET /kapc/stats` (everything the hook reports) and `GET /kapc/stats/<tag>` (one request's
  figures: status, reason, plan source, compile time, proposed, accepted, s) are served by
  `KapcRoutes`, an ASGI middleware vLLM loads through its own `--middleware` option: no fork.
  It also adds kapc's counters (`kapc_*`, `kapc_metrics`) to vLLM's Prometheus `GET /metrics`.
- Each finished request with a plan is also logged by the worker (`kapc request <tag>: ...`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kapc.errors import KapcError
from kapc.policy import MAX_AUTO_K

STATS_PATH = "/kapc/stats"
METRICS_PATH = "/metrics"  # vLLM's Prometheus endpoint; kapc's counters are added to it
CPU_KV_CACHE_GIB = 4.0  # SmolLM2-135M in fp32: 93K tokens, 22 requests of 4K at once
MIDDLEWARE = "kapc.runtime.vllm.serve.KapcRoutes"


class ServeError(KapcError):
    """A server that cannot be started as asked."""


@dataclass(frozen=True)
class ServerCommand:
    argv: list[str]
    url: str  # the OpenAI API root, http://host:port/v1
    model_name: str
    k: int
    block_size: int
    hook: bool  # False: plain vLLM


def server_command(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    k: int = MAX_AUTO_K,
    block_size: int | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    kv_cache_gib: float | None = None,
    hook: bool = True,
    extra: tuple[str, ...] | list[str] = (),
) -> ServerCommand:
    """The command that starts vLLM's server on `model` (default: the cached SmolLM2 folder)
    with kapc's hook (`hook=False`: plain vLLM, the baseline a load test compares with). `k` is
    the most a plan may propose (the default lets `k=auto` plans take their own). Raises
    ServeError for options the engine cannot run.

    On a CPU the KV cache gets `kv_cache_gib` (default CPU_KV_CACHE_GIB) unless the caller sizes
    it: left to vLLM, the CPU worker asks for 92% of the machine's memory and refuses to start
    whenever slightly less is free, which on a small machine is most of the time."""
    from kapc.runtime.vllm import default_dtype
    from kapc.runtime.vllm.compat import api_server_module

    model_dir = _server_model(model, hook)
    on_cpu, block_size = _server_blocks(block_size)
    if k < 1:
        raise ServeError(f"--k {k}: the proposal length must be at least 1")
    name = served_model_name or model_dir.name
    dtype = dtype or default_dtype(on_cpu, model_dir)
    argv = [sys.executable, "-m", api_server_module(), "--model", str(model_dir)]
    argv += ["--served-model-name", name, "--host", host, "--port", str(port)]
    argv += ["--block-size", str(block_size), "--dtype", dtype]
    if on_cpu:
        argv.append("--enforce-eager")
        argv += _cpu_kv_cache(model_dir, dtype, max_model_len, kv_cache_gib, hook, extra)
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if hook:
        argv += _hook_arguments(k)
    argv += list(extra)
    return ServerCommand(
        argv=argv,
        url=f"http://{_url_host(host)}:{port}/v1",
        model_name=name,
        k=int(k),
        block_size=int(block_size),
        hook=hook,
    )


def _server_model(model: str | None, hook: bool):
    """The model folder a server runs, checked for this vLLM and (with the hook) for kapc."""
    from kapc.models import ModelError, resolve
    from kapc.runtime.vllm import VLLMUnsupported, check_model_supported, check_vllm_version

    try:
        check_vllm_version()
        model_dir = resolve(model, weights=True)[0]
        if not (model_dir / "config.json").is_file():
            raise ServeError(f"{model}: not a model folder (no config.json)")
        if hook:
            check_model_supported(model_dir)
    except (VLLMUnsupported, ModelError) as exc:
        raise ServeError(str(exc)) from None
    return model_dir


def _server_blocks(block_size: int | None) -> tuple[bool, int]:
    """(whether the engine runs on a CPU, its KV block size)."""
    from kapc.policy import CPU_BLOCK_MULTIPLE, ENGINE_BLOCK_SIZE
    from kapc.runtime.vllm import engine_kind

    kind = engine_kind()
    on_cpu = kind == "vllm-cpu"
    if block_size is None:
        block_size = ENGINE_BLOCK_SIZE[kind]
    if on_cpu and block_size % CPU_BLOCK_MULTIPLE:
        raise ServeError(
            f"--block-size {block_size}: vLLM's CPU attention needs a multiple of "
            f"{CPU_BLOCK_MULTIPLE}. Plans compiled for smaller blocks still run "
            f"(a {CPU_BLOCK_MULTIPLE}-token block is visible when any of its tokens "
            f"is), so keep the default"
        )
    return on_cpu, block_size


def _cpu_kv_cache(model_dir, dtype, max_model_len, kv_cache_gib, hook, extra) -> list[str]:
    """The CPU KV cache's size argument, checked against the memory free, unless the caller
    sized it (`--kv-cache-memory-bytes` in `extra`, or VLLM_CPU_KVCACHE_SPACE)."""
    from kapc.memory import EngineMemoryError
    from kapc.runtime.vllm import size_cpu_engine

    sized = any(a.startswith("--kv-cache-memory-bytes") for a in extra) or os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE"
    )
    if kv_cache_gib is None and sized:
        return []
    gib = CPU_KV_CACHE_GIB if kv_cache_gib is None else kv_cache_gib
    try:  # checked here, so a server that cannot fit says so instead of being killed
        size_cpu_engine(
            model_dir,
            dtype,
            max_model_len,
            1,
            requested_gib=gib,
            draft_copies=hook,
            what="kapc serve",
        )
    except EngineMemoryError as exc:
        raise ServeError(str(exc)) from None
    return ["--kv-cache-memory-bytes", str(int(gib * 2**30))]


def _hook_arguments(k: int) -> list[str]:
    from kapc.runtime.vllm import PROPOSER_CLASS, SCHEDULER_CLASS, WORKER_EXTENSION_CLASS

    spec = {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": int(k)}
    return [
        "--speculative-config",
        json.dumps(spec),
        "--scheduler-cls",
        SCHEDULER_CLASS,
        "--worker-extension-cls",
        WORKER_EXTENSION_CLASS,
        "--middleware",
        MIDDLEWARE,
    ]


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout: float | None = None,
    interval: float = 1.0,
) -> None:
    """Block until the server at `url` (its /v1 root) answers /health. Raises ServeError when
    `proc` exits first or `timeout` seconds pass."""
    health = url.removesuffix("/v1") + "/health"
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServeError(
                f"the server exited with status {proc.returncode} before it was up "
                f"(its log above says why)"
            )
        try:
            with urllib.request.urlopen(health, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if deadline is not None and time.monotonic() > deadline:
            raise ServeError(f"the server at {url} did not answer /health within {timeout:.0f} s")
        time.sleep(interval)


@contextlib.contextmanager
def running(
    argv: list[str],
    url: str,
    log: Path | None = None,
    timeout: float | None = 300.0,
    env: dict | None = None,
):
    """A server process started from `argv` (its output to `log`, or to this process's), once it
    answers /health at `url`; terminated (then killed) on exit. Raises ServeError, with the log's
    tail, when it exits first or does not come up within `timeout` seconds (None: no limit)."""
    env = {**os.environ, **(env or {})}
    if log is None:
        proc = subprocess.Popen(argv, env=env)
    else:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        try:
            wait_healthy(url, proc, timeout=timeout)
        except ServeError as exc:
            if log is None:
                raise
            tail = Path(log).read_text(errors="replace")[-6000:]
            raise ServeError(f"{exc}\n--- server log ---\n{tail}") from None
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for tests and benchmarks that start servers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def usage(cmd: ServerCommand) -> str:
    root = cmd.url.removesuffix("/v1")
    if not cmd.hook:
        return (
            f"kapc serve: plain vLLM (no kapc hook) on {cmd.url}, model {cmd.model_name}, "
            f"block size {cmd.block_size}"
        )
    return "\n".join(
        [
            f"kapc serve: vLLM's OpenAI-compatible API with kapc's hook on {cmd.url}",
            f"  model {cmd.model_name}, k = {cmd.k}, KV block size {cmd.block_size}",
            "  plans travel in each request's vllm_xargs (kapc.client.plan_xargs builds them):",
            '    {"kapc_prior": "<prior.json text>"}          compiled here, cached by content',
            '    {"kapc_plan": "<base64 of a .kapb>"}         compiled by you',
            '    {"kapc_tag": "<name>"}                        names the request\'s statistics',
            "  the messages must be the prior's (kapc.client.chat_messages); requests without a plan",
            "  decode normally, and a plan that does not match is refused for its own request only",
            f"  statistics: GET {root}{STATS_PATH}/<tag>   (all: GET {root}{STATS_PATH})",
            f"  try: python examples/serve_client.py --url {cmd.url} "
            "examples/hotpotqa/q0000-700.prior.json",
        ]
    )


def serve(cmd: ServerCommand, echo=print) -> int:
    """Run the server in the foreground until it exits or this process is interrupted or
    terminated (the server is then stopped too); prints how to call it once it answers. Returns
    its exit status."""
    # SIGTERM unwinds like Ctrl-C, so `running` stops the server rather than orphaning it
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with running(cmd.argv, cmd.url, timeout=None) as proc:
            echo(usage(cmd))
            return proc.wait()
    except ServeError as exc:
        echo(f"kapc serve: {exc}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- inside the server -----------------------------------------------------------------------


class KapcRoutes:
    """`GET /kapc/stats[/<tag>]`, answered from the workers' `kapc_stats`; `GET /metrics` gets
    kapc's counters after vLLM's own; every other request goes to vLLM's app with its own
    `receive` and `send`, untouched.

    A plain ASGI class, not a function: vLLM installs a function as Starlette's
    BaseHTTPMiddleware, which relays every chunk of every response, each streamed token of
    every request included, through a stream and a task of its own, in the API server process
    that shares its core with the engine's scheduler on vLLM-CPU."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == METRICS_PATH and scope["method"] == "GET":
            return await self._metrics(scope, receive, send)
        if path == STATS_PATH or path.startswith(STATS_PATH + "/"):
            from starlette.requests import Request

            response = await _stats_response(Request(scope, receive))
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _metrics(self, scope, receive, send):
        """vLLM's /metrics with kapc's counters after it (unchanged if the workers do not
        answer, or the engine runs without kapc's hook); asked uncompressed, to append to."""
        from kapc.runtime.vllm.compat import server_engine_client

        plain = [(k, v) for k, v in scope["headers"] if k.lower() != b"accept-encoding"]
        start: dict = {}
        body: list[bytes] = []

        async def keep(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))

        await self.app({**scope, "headers": plain}, receive, keep)
        data = b"".join(body)
        try:
            results = await server_engine_client(scope["app"]).collective_rpc("kapc_metrics")
            data += kapc_metrics(results[0])
        except Exception:  # noqa: BLE001, S110 - vLLM's own metrics still answer
            pass
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(data)).encode()))
        await send(
            {"type": "http.response.start", "status": start.get("status", 200), "headers": headers}
        )
        await send({"type": "http.response.body", "body": data})


async def _stats_response(request):
    """The JSON answer to `GET /kapc/stats[/<tag>]` (405 for other methods, 404 for a tag not
    seen, 503 when the workers do not answer)."""
    from urllib.parse import unquote

    from fastapi.responses import JSONResponse

    from kapc.runtime.vllm.compat import server_engine_client

    path = request.url.path
    if request.method != "GET":
        return JSONResponse({"error": f"{path} answers GET only"}, status_code=405)
    tag = unquote(path[len(STATS_PATH) :].strip("/")) or None
    try:
        results = await server_engine_client(request.app).collective_rpc(
            "kapc_stats", kwargs={"tag": tag}
        )
    except Exception as exc:  # noqa: BLE001 - report, do not take the server down
        return JSONResponse(
            {"error": f"the workers did not report: {type(exc).__name__}: {exc}"}, status_code=503
        )
    stats = results[0]  # every rank drafts the same batch; rank 0 speaks for them
    if len(results) > 1:  # tensor parallel: say whether the ranks' requests agree
        stats["ranks"] = len(results)
        stats["ranks_agree"] = all(_drafts(r) == _drafts(stats) for r in results[1:])
    if tag is None:
        return JSONResponse(stats)
    found = stats.get("requests", {}).get(tag)
    if found is None:
        return JSONResponse(
            {
                "error": f"no request tagged {tag!r} (yet): send it with "
                f'vllm_xargs {{"kapc_tag": "{tag}"}}'
            },
            status_code=404,
        )
    return JSONResponse(found)


def _drafts(stats: dict) -> dict:
    """What every rank must agree on: each request's drafting (compile times differ by rank)."""
    keys = ("status", "proposed", "accepted", "accepted_per_pos", "retained_ratio", "k")
    return {tag: tuple(str(r.get(k)) for k in keys) for tag, r in stats.get("requests", {}).items()}


def kapc_metrics(totals: dict) -> bytes:
    """Prometheus text of the workers' counters (`kapc_metrics` of rank 0)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def labelled(name, doc, label, values):
        family = CounterMetricFamily(name, doc, labels=[label])
        for value, count in sorted(values.items()):
            family.add_metric([value], count)
        return family

    def counter(name, doc, value):
        return CounterMetricFamily(name, doc, value=value)

    class Collector:
        def collect(self):
            t = totals
            yield labelled(
                "kapc_requests",
                "Requests that left the batch, by how their plan ran "
                "(plan, fallback, refused, compiling, none).",
                "status",
                t["requests"],
            )
            yield labelled(
                "kapc_fallbacks",
                "Plans that stopped or never drafted, by cause.",
                "cause",
                t["fallbacks"],
            )
            yield counter("kapc_draft_tokens", "Draft tokens verified.", t["proposed"])
            yield counter("kapc_accepted_tokens", "Draft tokens accepted.", t["accepted"])
            yield counter("kapc_draft_cycles", "Draft cycles run.", t["draft_cycles"])
            yield counter(
                "kapc_held_steps",
                "Steps a row that could draft was held by the step policy.",
                t["held_steps"],
            )
            yield counter(
                "kapc_prefill_held_steps",
                "Engine steps in which no row drafted because the next step prefills.",
                t["prefill_held_steps"],
            )
            yield counter("kapc_prior_compiles", "Priors compiled into plans.", t["compiles"])
            yield counter(
                "kapc_prior_compile_seconds", "Seconds spent compiling priors.", t["compile_s"]
            )
            yield GaugeMetricFamily(
                "kapc_live_requests",
                "Requests in the batch the hook holds sessions for.",
                value=t["live"],
            )

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)
