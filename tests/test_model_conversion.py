"""The default model's one-time conversion: read once, from memory, and run in the background
while a first run goes on, without changing what it produces or saying it twice."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.model


def test_reading_the_gguf_once_from_memory_reads_what_gguf_reads():
    import gguf

    from kapc.convert import _gguf_read_once
    from kapc.models import gguf_path

    path = gguf_path()
    plain = gguf.GGUFReader(path)
    with _gguf_read_once():
        fast, again = gguf.GGUFReader(path), gguf.GGUFReader(path)
        arch, blocks = gguf.MODEL_ARCH.LLAMA, 30
        assert gguf.get_tensor_name_map(arch, blocks) is gguf.get_tensor_name_map(arch, blocks)
        mapped = gguf.get_tensor_name_map(arch, blocks).mapping
    assert not isinstance(fast.data, np.memmap) and again.fields is fast.fields  # parsed once
    assert list(fast.fields) == list(plain.fields)
    tokens = plain.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]) for i in tokens.data[:50]] == [
        bytes(fast.fields["tokenizer.ggml.tokens"].parts[i]) for i in tokens.data[:50]
    ]
    assert [(t.name, t.tensor_type, bytes(t.data)) for t in plain.tensors[:5]] == [
        (t.name, t.tensor_type, bytes(t.data)) for t in fast.tensors[:5]
    ]
    # outside the conversion, gguf is itself again
    assert isinstance(gguf.GGUFReader(path).data, np.memmap)
    assert gguf.get_tensor_name_map(arch, blocks) is not gguf.get_tensor_name_map(arch, blocks)
    assert gguf.get_tensor_name_map(arch, blocks).mapping == mapped


def test_a_conversion_started_in_the_background_is_waited_for_not_repeated(
    tmp_path, monkeypatch, capfd
):
    from kapc import models

    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))
    models.prepare_model()
    dest = models.ensure_model()  # waits for the background extraction
    assert (dest / "tokenizer.ok").exists() and (dest / "tokenizer.json").exists()
    assert capfd.readouterr().err.count("(once)") == 1
    models.prepare_model()  # cached: nothing starts
    assert models.ensure_model() == dest
    assert "(once)" not in capfd.readouterr().err
