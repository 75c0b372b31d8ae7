"""The model the reference executor runs: a Hugging Face Llama-family decoder, layer by layer.

The executor needs attention over its own paged KV cache (and over the compact selected-KV view of a
plan), so it does not call the Hugging Face forward. It runs the model's own modules in order:
embedding, per layer RMSNorm -> q/k/v projections -> (q/k norm for Qwen3) -> rotary embedding with
the model's own rope configuration (transformers' rotary module) -> attention supplied by the
caller -> o projection -> residual -> RMSNorm -> MLP -> residual, then the final norm and lm_head.
Everything except attention is the Hugging Face module itself, so the arithmetic is the model's.

Supported: full-attention decoders of the Llama family (llama, qwen2, qwen3, mistral without a
sliding window). Anything the executor cannot run exactly is refused with the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kapc.models import DEFAULT_MODEL, ModelError, load_assets, resolve

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# attend(layer_index, q [N, heads, head_dim], k [N, kv_heads, head_dim], v [N, kv_heads, head_dim])
#   -> attention output [N, heads * head_dim]; q and k already carry the rotary embedding.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# layer_hook(layer_index, "in" | "mid", hidden [N, hidden]): observes the residual stream
LayerHook = Callable[[int, str, torch.Tensor], None]


class UnsupportedModel(ModelError):
    """A model the reference executor cannot run exactly."""


def check_supported(config) -> None:
    """Raise UnsupportedModel naming why `config` (a transformers PretrainedConfig) cannot run."""
    mt = getattr(config, "model_type", "?")
    name = getattr(config, "_name_or_path", "") or mt
    vision = [
        a
        for a in ("vision_config", "audio_config", "vision_tower", "mm_projector_type")
        if getattr(config, a, None) is not None
    ]
    if vision:
        raise UnsupportedModel(
            f"{name}: multimodal model ({', '.join(vision)}): the reference "
            f"executor runs text-only decoders"
        )
    if (
        mt in ("bloom", "mpt", "baichuan", "falcon")
        or getattr(config, "alibi", False)
        or getattr(config, "position_embedding_type", None) == "alibi"
    ):
        raise UnsupportedModel(
            f"{name}: ALiBi / non-rotary position encoding ({mt}) is not "
            f"supported: the executor needs rotary positions baked into the "
            f"cached keys"
        )
    if mt not in SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"{name}: model type {mt!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_TYPES)}, full attention only)"
        )
    sw = getattr(config, "sliding_window", None)
    uses_sw = getattr(config, "use_sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModel(
            f"{name}: layers with {sorted(set(layer_types))} attention; only "
            f"full attention can be run exactly over a compact KV view"
        )
    if sw is not None and (uses_sw is None or uses_sw):
        raise UnsupportedModel(
            f"{name}: sliding-window attention (window {sw}) is not supported: "
            f"the executor runs full-attention decoders only"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        raise UnsupportedModel(
            f"{name}: dynamic NTK rope rescales with the sequence length; the "
            f"cached keys would change, so it cannot be paged exactly"
        )


@dataclass
class RuntimeModel:
    """A loaded model plus what the executor needs to know about it."""

    hf: torch.nn.Module  # the *ForCausalLM
    tokenizer: object
    path: Path
    name: str
    fingerprint: str
    tokenizer_fingerprint: str
    template_fingerprint: str
    device: torch.device
    dtype: torch.dtype
    num_layers: int = 0
    num_heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    hidden: int = 0
    vocab: int = 0
    eos_ids: frozenset = field(default_factory=frozenset)

    def __post_init__(self):
        c = self.hf.config
        self.num_layers = c.num_hidden_layers
        self.num_heads = c.num_attention_heads
        self.kv_heads = getattr(c, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        self.hidden = c.hidden_size
        self.vocab = c.vocab_size
        eos = set()
        for src in (
            c.eos_token_id,
            getattr(self.hf.generation_config, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
        ):
            if isinstance(src, int):
                eos.add(src)
            elif src:
                eos.update(int(x) for x in src)
        self.eos_ids = frozenset(eos)
        inner = self.hf.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = self.hf.lm_head
        attn = self.layers[0].self_attn
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.has_qk_norm = hasattr(attn, "q_norm")

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.hf.parameters())

    def kv_bytes_per_token(self) -> int:
        return (
            2
            * self.num_layers
            * self.kv_heads
            * self.head_dim
            * torch.empty((), dtype=self.dtype).element_size()
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: AttendFn,
        logits_index: torch.Tensor | None = None,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Run the decoder over packed tokens `input_ids` [N] at logical `positions` [N].
        Returns logits [len(logits_index) or N, vocab] in float32. `layer_hook(i, "in", h)` sees
        layer i's input hidden state and `layer_hook(i, "mid", h)` the state after its attention
        (what EarlySelectKV builds proxy queries from)."""
        n = input_ids.shape[0]
        h = self.embed(input_ids)  # [N, hidden]
        cos, sin = self.rotary(h[None], positions[None])
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, head_dim]
        hd, nh, kvh = self.head_dim, self.num_heads, self.kv_heads
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            if layer_hook is not None:
                layer_hook(i, "in", h)
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(n, nh, hd)
            k = a.k_proj(x).view(n, kvh, hd)
            v = a.v_proj(x).view(n, kvh, hd)
            if self.has_qk_norm:
                q = a.q_norm(q)
                k = a.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            o = attend(i, q, k, v)
            h = h + a.o_proj(o)
            if layer_hook is not None:
                layer_hook(i, "mid", h)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if logits_index is not None:
            h = h.index_select(0, logits_index)
        return self.lm_head(self.norm(h)).float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    spec: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> RuntimeModel:
    """Load a registered model (spec None: the default SmolLM2) or a local Hugging Face folder."""
    return _load_cached(
        str(spec) if spec not in (None, "") else DEFAULT_MODEL,
        str(device),
        str(dtype) if dtype is not None else None,
    )


@functools.lru_cache(maxsize=2)
def _load_cached(spec: str, device: str, dtype: str | None) -> RuntimeModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, _ = resolve(spec, weights=True)  # the compiler's assets need no weights; we do
    assets = load_assets(path)
    path, name = assets.path, assets.name
    config = AutoConfig.from_pretrained(path)
    check_supported(config)
    dev = torch.device(device)
    dt = getattr(torch, dtype.replace("torch.", "")) if dtype else default_dtype(dev)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="sdpa")
    hf.to(dev).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return RuntimeModel(
        hf=hf,
        tokenizer=tok,
        path=Path(path),
        name=name,
        fingerprint=assets.fingerprint,
        tokenizer_fingerprint=assets.tokenizer_fingerprint,
        template_fingerprint=assets.template_fingerprint,
        device=dev,
        dtype=dt,
    )


def random_model(
    config: dict,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    seed: int = 0,
    name: str = "random-llama",
) -> RuntimeModel:
    """A Llama-shaped model with random weights, built from a config dict: for throughput
    measurements where the real weights cannot be had (the GPU machine cannot receive them).
    Its outputs mean nothing; its fingerprint says so ("random:..."), so no real plan matches it."""
    import hashlib
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    dev = torch.device(device)
    dt = getattr(torch, str(dtype).replace("torch.", "")) if dtype else default_dtype(dev)
    cfg = LlamaConfig(**config)
    check_supported(cfg)
    torch.manual_seed(seed)
    with torch.device(dev):
        hf = LlamaForCausalLM(cfg).to(dt)
    hf.eval()
    fp = "random:" + hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return RuntimeModel(
        hf=hf,
        tokenizer=None,
        path=Path("."),
        name=name,
        fingerprint=fp,
        tokenizer_fingerprint=fp,
        template_fingerprint=fp,
        device=dev,
        dtype=dt,
    )
