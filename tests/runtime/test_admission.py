"""The engine-free parts of serving: the request a client builds from a prior (`kapc.client`),
the plans the worker compiles at admission (`kapc.runtime.vllm.admission`), a request's options
as the OpenAI server delivers them, and the log line of a finished request. The server itself is
tested in tests/serve."""

from __future__ import annotations

import base64
import json
import os
import re

import pytest

from kapc.client import ClientError, chat_messages, plan_xargs, prompt_text
from kapc.errors import KapcError
from kapc.lower.kapb import decode_plan
from kapc.prior import load_prior
from kapc.runtime.session import RequestOptions, RunReport, finished_line, remember, request_options
from kapc.runtime.vllm.admission import PlanCompiler, prior_text
from tests.conftest import EXAMPLES

PRIOR_700 = EXAMPLES / "hotpotqa" / "q0000-700.prior.json"
PRIOR_4K = EXAMPLES / "hotpotqa" / "q0000-4k.prior.json"


@pytest.fixture(scope="module")
def compiler(ctx):
    return PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu")


@pytest.mark.parametrize("path", [PRIOR_700, PRIOR_4K], ids=["700", "4k"])
def test_chat_messages_render_to_the_plans_prompt(path, ctx, compiler):
    """What the server tokenises (the messages through the chat template, generation prompt
    added) is exactly the prompt the prior's plan was compiled for: else every plan sent as a
    prior would be refused."""
    plan = decode_plan(compiler.compile(path.read_text()).data)
    assert [int(t) for t in plan.prompt_token_ids] == chat_ids(ctx, path)


def test_a_prior_compiles_once_per_block_size(ctx):
    one = PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu")
    text = PRIOR_700.read_text()
    first, again = one.compile(text), one.compile(text)
    assert not first.cached and first.seconds > 0
    assert again.cached and again.seconds == 0.0 and again.data == first.data
    as_object = one.compile(json.loads(text))  # the same prior sent as an object
    assert (
        decode_plan(as_object.data).header.prompt_hash == decode_plan(first.data).header.prompt_hash
    )
    other = PlanCompiler(str(ctx.assets.path), block_size=64, engine="vllm-cpu")
    assert other.key(text.encode()) != one.key(text.encode())
    assert decode_plan(other.compile(text).data).header.block_size == 64


def test_the_compile_process_prices_plans_with_the_profile_of_the_workers_threads(
    ctx, tmp_path, monkeypatch
):
    """The worker names its thread count to the compile process (the hook takes the profile
    timed with it), so a plan is priced as the hook will run it, not by a newer profile timed
    with another count."""
    import msgspec

    from kapc.profile import machine_cpu, save_profile
    from tests.compiler.test_policy import known_profile

    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))  # the child inherits it
    base = msgspec.structs.replace(known_profile(ctx.assets.fingerprint), cpu=machine_cpu())
    keys = {n: save_profile(msgspec.structs.replace(base, threads=n)).stem for n in (1, 2)}
    for threads in (1, 2):
        one = PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu", threads=threads)
        try:
            plan = decode_plan(one.compile(PRIOR_700.read_text()).data)
        finally:
            one.close()
        assert plan.header.cost.basis == keys[threads]


def test_the_cache_keeps_the_newest_plans(ctx):
    small = PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu", capacity=1)
    a, b = PRIOR_700.read_text(), (EXAMPLES / "hotpotqa" / "q0001-700.prior.json").read_text()
    small.compile(a)
    small.compile(b)
    assert not small.compile(a).cached  # b pushed a out
    assert small.compile(a).cached


def test_priors_compile_off_the_engine_step(ctx):
    """A prior's plan compiles on the compiler's own thread: admission does not wait for it. The
    session decodes plainly (`compiling`) until the plan is ready, then is admitted; the same
    prior in flight twice compiles once; the scheduler's early start joins the same compile."""
    import threading

    from kapc.runtime.planning import PlanTarget
    from kapc.runtime.session import EngineRules, PlanSession
    from kapc.runtime.vllm import admission

    one = PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu")
    gate = threading.Event()
    one._thread.submit(gate.wait)  # the compiler's thread is busy until the gate opens
    extra = {"kapc_prior": PRIOR_700.read_text(), "kapc_opts": {"honor_predicted_loss": False}}
    admission.compile_early(one)
    admission.start_compiling(extra)  # as the request arrives
    running = one.submit(extra["kapc_prior"])
    assert not running.done() and one.submit(extra["kapc_prior"]) is running
    target = PlanTarget(ctx.assets)
    rules = lambda: EngineRules(block_size=32, layers=30, fingerprint=lambda: target.fingerprint)  # noqa: E731
    ids = chat_ids(ctx, PRIOR_700)
    s = PlanSession(tag="early")
    admission.admit_request(s, extra, ids, rules, lambda: one)
    assert s.status == "compiling" and not s.compiled and s.report().status == "compiling"
    gate.set()
    running.result(timeout=120)
    assert s.compiled
    admission.admit_request(s, extra, ids, rules, lambda: one)  # the next step: admitted
    assert s.status == "plan" and s.source == "prior" and s.compile_s > 0
    assert s.compiling_plan is None and not s.compiled
    late = PlanSession(tag="late")  # the plan cached by now: admitted at once
    admission.admit_request(late, extra, ids, rules, lambda: one)
    assert late.status == "plan" and late.compile_cached


def test_a_compile_started_early_is_booked_on_the_request_it_was_started_for(ctx):
    """A prior whose compile started as its request arrived and finished during its prefill is
    that request's compile (seconds reported, not "cached"); the next request with the same
    prior takes the cached plan. The server's compile counts read this."""
    from kapc.runtime.vllm import admission

    one = PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu")
    prior = PRIOR_700.read_text()
    admission.compile_early(one)
    admission.start_compiling({"kapc_prior": prior})  # as the request arrives
    one.submit(prior, early=True).result(timeout=120)  # done before the request is admitted
    first = one.compile(prior)
    assert not first.cached and first.seconds > 0
    again = one.compile(prior)
    assert again.cached and again.seconds == 0.0 and again.data == first.data


def test_priors_compile_in_a_process_of_their_own_on_the_spare_cores(ctx):
    """The compiler is Python: on a thread of the worker it would hold the interpreter lock the
    forward needs. It runs in a child process, on the cores the worker is not bound to."""
    cores = os.sched_getaffinity(0)
    bound = {min(cores)}
    os.sched_setaffinity(0, bound)  # as vLLM-CPU binds its worker's forwards
    try:
        one = PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu")
        one.compile(PRIOR_700.read_text())
    finally:
        os.sched_setaffinity(0, cores)
    child = one.process_id
    assert child is not None and child != os.getpid()
    spare = set(range(os.cpu_count() or 1)) - bound
    assert os.sched_getaffinity(child) == (spare or bound)
    one.close()
    assert not psutil_alive(child)


def test_a_compile_process_that_dies_refuses_its_prior_and_is_started_again(ctx):
    """The child killed while it compiles (a real SIGKILL, as the out-of-memory killer would):
    that prior fails with the reason, not a hang, and the next prior starts a new child."""
    import fcntl
    import signal
    import termios
    import time

    from kapc.runtime.vllm.compile_process import CompilerFailed

    one = PlanCompiler(str(ctx.assets.path), block_size=32, engine="vllm-cpu")
    one.compile(PRIOR_700.read_text())
    first = one.process_id
    os.kill(first, signal.SIGSTOP)  # it cannot read the next prior until killed
    pending = one.submit((EXAMPLES / "hotpotqa" / "q0001-700.prior.json").read_text())
    pipe = one._process._child.stdin.fileno()
    waiting = bytearray(4)
    for _ in range(200):  # until the prior lies in the stopped child's pipe
        fcntl.ioctl(pipe, termios.FIONREAD, waiting)
        if int.from_bytes(waiting, "little"):
            break
        time.sleep(0.05)
    assert int.from_bytes(waiting, "little") > 0 and not pending.done()
    os.kill(first, signal.SIGKILL)
    with pytest.raises(CompilerFailed, match=r"compile process exited \(code -9\)"):
        pending.result(timeout=60)
    again = one.compile((EXAMPLES / "hotpotqa" / "q0002-700.prior.json").read_text())
    assert decode_plan(again.data).header.block_size == 32
    assert one.process_id not in (None, first)
    one.close()


def test_a_compiler_that_cannot_start_refuses_each_prior_with_why(tmp_path):
    from concurrent.futures import wait

    from kapc.runtime.session import PlanSession
    from kapc.runtime.vllm import admission

    broken = PlanCompiler(str(tmp_path / "m"), block_size=32, engine="vllm-cpu")
    extra = {"kapc_prior": PRIOR_700.read_text()}
    s = PlanSession(tag="no-model")
    admission.admit_request(s, extra, [1, 2], lambda: None, lambda: broken)
    if s.status == "compiling":  # as the engine's next step would, once the compile is done
        wait([s.compiling_plan], timeout=120)
        admission.admit_request(s, extra, [1, 2], lambda: None, lambda: broken)
    assert s.status == "refused"
    assert "the compiler failed on it (the compiler cannot start: ModelError:" in s.reason
    assert "not a registered model nor a directory" in s.reason
    broken.close()


def psutil_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def chat_ids(ctx, path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ctx.assets.path))
    ids = tok.apply_chat_template(chat_messages(path), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize(
    "value, where",
    [
        ('{"name": "x", "request": {"messages": 3}}', "$.request.messages"),
        ("{", "prior"),
        (
            '{"format": "kapc.prior", "name": "x", "request": {"raw": [{"text": "hi"}]}, '
            '"units": [{"id": "u", "kind": "passage", "segment": "p9"}]}',
            "$.units[0].segment",
        ),
    ],
)
def test_a_bad_prior_is_refused_with_its_json_path(compiler, value, where):
    with pytest.raises(KapcError) as err:
        compiler.compile(value)
    assert where in str(err.value)


def test_a_prior_must_be_json_text_or_an_object():
    assert prior_text({"b": 1, "a": 2}) == b'{"a":2,"b":1}'
    with pytest.raises(KapcError, match="JSON text or object"):
        prior_text(42)


def test_request_options_from_the_openai_server():
    assert request_options(None) == RequestOptions()
    assert request_options({"accept": "top3"}) == RequestOptions(accept="top3")
    assert request_options('{"k": 3}') == RequestOptions(k=3)  # vllm_xargs carry strings
    for bad, said in (
        ("k=3", "not JSON"),
        ("[1, 2]", "must be an object"),
        ('{"kk": 3}', "unknown field `kk`"),  # a misspelt option is named, not ignored
        ('{"max_view_blocks": "wide"}', "$.max_view_blocks"),
        ('{"max_view_blocks": 0}', "max_view_blocks must be a positive"),
        ('{"access": {"mode": 3}}', "$.access.mode"),
    ):
        with pytest.raises(KapcError, match=re.escape(said)):
            request_options(bad)


def test_plan_xargs_carry_one_plan():
    x = plan_xargs(prior=PRIOR_700, tag="t", accept="top3")
    assert json.loads(x["kapc_prior"])["name"] == load_prior(PRIOR_700).name
    assert x["kapc_tag"] == "t" and json.loads(x["kapc_opts"]) == {"accept": "top3"}
    assert base64.b64decode(plan_xargs(kapb=b"\x01\x02")["kapc_plan"]) == b"\x01\x02"
    with pytest.raises(ClientError):
        plan_xargs()
    with pytest.raises(ClientError):
        plan_xargs(prior=PRIOR_700, kapb=b"x")


def test_chat_and_raw_requests_are_told_apart(tmp_path):
    raw = tmp_path / "raw.prior.json"
    raw.write_text('{"name": "r", "request": {"raw": [{"text": "a"}, {"text": "b"}]}}')
    assert prompt_text(raw) == "ab"
    with pytest.raises(ClientError, match="completions API"):
        chat_messages(raw)
    with pytest.raises(ClientError, match="chat_messages"):
        prompt_text(PRIOR_700)


def test_a_finished_request_is_logged_under_its_tag():
    line = finished_line(
        RunReport(
            tag="q1",
            status="plan",
            source="prior",
            compile_s=0.25,
            compile_cached=False,
            retained_ratio=0.12,
            k=6,
            accept="greedy",
            proposed=40,
            accepted=37,
        )
    )
    assert line == (
        "kapc request q1: plan, plan from prior, compile 0.250s, s 0.120, "
        "k 6 greedy, proposed 40 accepted 37"
    )
    refused = finished_line(
        RunReport(tag="q2", status="refused", source="kapb", reason="plan refused: truncated")
    )
    assert refused.endswith("reason: plan refused: truncated")


def test_a_long_running_server_remembers_the_newest_requests_only():
    from collections import OrderedDict

    finished = OrderedDict()
    for i in range(5):
        remember(finished, f"r{i}", {"i": i}, keep=3)
    assert list(finished) == ["r2", "r3", "r4"]
    remember(finished, "r2", {"i": 9}, keep=3)  # a reused tag is the newest
    assert list(finished) == ["r3", "r4", "r2"] and finished["r2"] == {"i": 9}


def test_what_the_compiler_prints_does_not_break_the_compile_processs_answers(ctx):
    """Frames leave the compile process on a descriptor of their own: a compiler (or a library
    under it) that prints to stdout writes to the engine's log, not into an answer. Nothing in
    kapc prints there today, so the child here runs a compiler wrapped to print first."""
    import subprocess
    import sys

    from kapc.runtime.vllm.compile_process import Answer, Ask, _read, _write

    chatty = (
        "import kapc.compiler as c; f = c.compile_to_kapb; "
        "c.compile_to_kapb = lambda *a, **k: (print('chatter'), f(*a, **k))[1]; "
        "from kapc.runtime.vllm.compile_process import main; "
        f"main([{str(ctx.assets.path)!r}, 'vllm-cpu', '0'])"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", chatty],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _write(child.stdin, Ask(prior=PRIOR_700.read_bytes(), block_size=32))
        answer = _read(child.stdout, Answer)
    finally:
        child.stdin.close()
        err = child.stderr.read().decode()
        child.wait(timeout=60)
    assert answer is not None and not answer.error
    assert decode_plan(answer.plan).header.block_size == 32
    assert "chatter" in err
