"""Every vLLM internal kapc's proposer touches, in one file: supporting another vLLM version means
changing this file (and the scheduler subclass, which is vLLM's own class by nature).

What the proposer needs from vLLM, and where it is in 0.32 (`vllm/v1/...`):

- the model runner it was built by (`GPUModelRunner`, the CPU runner subclasses it): found from
  the call stack on the first `propose`, since `custom_class` proposers are built with the config
  only;
- the attention layout: one full-attention KV cache group (`kv_cache_config.kv_cache_groups`),
  its layer names, block size, and the attention group's metadata builder (`runner.attn_groups`);
- the batch: row order (`runner.input_batch.req_ids`) and each request's block table, prompt and
  sampling parameters (`runner.requests[req_id]`);
- a forward over a custom block table: `CommonAttentionMetadata` ->
  `builder.build_for_drafting` -> `set_forward_context` -> `runner.model` -> `compute_logits`;
- the linear layers' matmuls on vLLM-CPU (`layer.cpu_linear`, a oneDNN handle), to give draft
  forwards bfloat16 copies of the weights;
- the rejection sampler's inputs, to adjust target logits for top-N tolerant acceptance
  (`runner.rejection_sampler.forward(metadata, draft_probs, logits, sampling_metadata)`, with
  `metadata.num_draft_tokens`, `.target_logits_indices`, `.draft_token_ids`);
- the step's `SchedulerOutput` (a local of `propose_draft_token_ids` on the call stack), which
  carries what kapc's scheduler attached (`kapc_load`) across the executor's process boundary,
  and the `extra_args` of the requests it schedules for the first time;
- on vLLM-CPU, a correct `rejection_sampler.expand_batch_to_tokens` in place of 0.32's, whose
  CPU kernel never writes its output (`sampled_verification_on_cpu`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from kapc.runtime.kernels.choice import forward_shape


class UnsupportedAttention(RuntimeError):
    """The model's attention cannot be read through a compact block table."""


def on_stack(name: str, test, depth: int = 2):
    """The nearest caller's local `name` (from `depth` frames up) for which `test(value)` holds,
    or None: how the hook reaches what vLLM does not hand it."""
    f = sys._getframe(depth)
    while f is not None:
        value = f.f_locals.get(name)
        if value is not None and test(value):
            return value
        f = f.f_back
    return None


def find_runner(drafter, depth: int = 3):
    """The model runner whose `drafter` is `drafter`, from the call stack of `propose` (vLLM calls
    it from `GPUModelRunner.propose_draft_token_ids`, whose `self` is the runner)."""
    runner = on_stack("self", lambda obj: getattr(obj, "drafter", None) is drafter, depth)
    if runner is None:
        raise RuntimeError("kapc KapProposer: cannot find the vLLM model runner")
    return runner


def step_schedule(depth: int = 3):
    """The scheduler's output for the step whose drafts `propose` makes (a local of vLLM's
    `GPUModelRunner.propose_draft_token_ids` on the call stack), or None."""
    return on_stack("scheduler_output", lambda so: hasattr(so, "scheduled_new_reqs"), depth)


def new_request_args(scheduler_output) -> list[dict]:
    """The `extra_args` of the requests a step schedules for the first time."""
    out = []
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        sp = getattr(r, "sampling_params", None)
        if sp is not None and sp.extra_args:
            out.append(sp.extra_args)
    return out


@dataclass
class AttentionLayout:
    layer_names: list[str]
    block_size: int
    builder: object  # the attention group's metadata builder


def attention_layout(runner) -> AttentionLayout:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = runner.kv_cache_config.kv_cache_groups
    if (
        len(groups) != 1
        or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec)
        or getattr(groups[0].kv_cache_spec, "sliding_window", None)
    ):
        raise UnsupportedAttention(
            "kapc's vLLM hook needs one full-attention KV cache group; this model has "
            f"{[type(g.kv_cache_spec).__name__ for g in groups]}"
        )
    attn_groups = runner.attn_groups[0]
    if len(attn_groups) != 1:
        raise UnsupportedAttention("kapc's vLLM hook needs a single attention backend group")
    return AttentionLayout(
        layer_names=list(groups[0].layer_names),
        block_size=int(groups[0].kv_cache_spec.block_size),
        builder=attn_groups[0].get_metadata_builder(),
    )


def batch_request_ids(runner) -> list[str]:
    """Request ids in the batch's row order (the order `propose` must answer in)."""
    return runner.input_batch.req_ids


def batch_request(runner, req_id: str):
    """The runner's state of one request: `.block_ids[0]` (its KV blocks, in logical order),
    `.prompt_token_ids`, `.sampling_params` (whose `extra_args` carry the plan). None if gone."""
    return runner.requests.get(req_id)


def request_ends(sampling_params, prompt_tokens: int) -> tuple[int | None, frozenset[int]]:
    """What ends a request, as vLLM's scheduler checks it (`check_stop`): the tokens it holds at
    its `max_tokens` (None: no limit), and the token ids whose sampling stops it (its EOS, None
    where `ignore_eos`, and its stop token ids)."""
    sp = sampling_params
    limit = getattr(sp, "max_tokens", None)
    eos = getattr(sp, "eos_token_id", None)
    ids = set(getattr(sp, "stop_token_ids", None) or ()) | ({eos} if eos is not None else set())
    return (prompt_tokens + int(limit) if limit is not None else None), frozenset(ids)


def live_request_ids(runner) -> set[str]:
    return set(runner.requests)


def draft_logits(
    runner,
    vllm_config,
    layout: AttentionLayout,
    x,
    step: int,
    on_block_table=None,
    weights: DraftWeights | None = None,
) -> torch.Tensor:
    """One forward of the target model for one query token per row, each row attending over its
    own block table (a compact view of `x.seq_lens` tokens) at its true logical position,
    writing its K/V to its slot (`x`: kapc.runtime.vllm.draft_inputs.StepInputs, on the
    device). Returns logits [rows, vocab]. `on_block_table(t)` receives the block table tensor
    the attention kernel will read (the metadata holds it, not a copy), for per-layer edits from
    `attention_pre_hooks`. `weights`: the reduced-precision copies the forward reads instead of
    the engine's own."""
    from vllm.forward_context import set_forward_context

    n = len(x.seq_lens_host)
    meta = _draft_metadata(layout, x, step)
    if on_block_table is not None:
        if getattr(meta, "block_table", None) is not x.block_table:
            raise UnsupportedAttention(
                "this attention backend copies the block table into its "
                "metadata; per-layer page choice cannot edit it"
            )
        on_block_table(x.block_table)
    per_layer = {name: meta for name in layout.layer_names}
    # a layer missing from slot_mapping silently skips its KV write: name every one
    if weights is not None:
        weights.active = True
    try:
        with set_forward_context(
            per_layer,
            vllm_config,
            num_tokens=n,
            slot_mapping={name: x.slots for name in layout.layer_names},
        ):
            hidden = runner.model(
                input_ids=x.token_ids,
                positions=x.positions,
                intermediate_tensors=None,
                inputs_embeds=None,
            )
        return runner.model.compute_logits(hidden)
    finally:
        if weights is not None:
            weights.active = False


def _draft_metadata(layout: AttentionLayout, x, step: int):
    """The attention metadata of one draft forward: one query token per row. Lengths the
    builder reads on the host come from `x.seq_lens_host`, never from the device."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(x.seq_lens_host)
    qsl_cpu = torch.arange(n + 1, dtype=torch.int32)
    qsl = qsl_cpu if x.seq_lens.device.type == "cpu" else qsl_cpu.to(x.seq_lens.device)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=x.seq_lens,
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max(x.seq_lens_host),
        block_table_tensor=x.block_table,
        slot_mapping=x.slots,
        causal=True,
        positions=x.positions,
        seq_lens_cpu_upper_bound=torch.tensor(x.seq_lens_host, dtype=torch.int32),
    )
    return layout.builder.build_for_drafting(common_attn_metadata=cam, draft_index=step)


class DraftWeights:
    """Reduced-precision copies of the model's linear weights, read by draft forwards only.

    A draft forward at batch 1 spends most of its time streaming the weights from memory (on a
    2-core AVX-512 machine, 25 of 42 ms for SmolLM2 in float32); bfloat16 copies halve those
    bytes. Verification, decode and prefill keep the engine's own weights and dtype, so outputs
    stay exactly those of plain decoding; a draft that differs is rejected like any other.

    vLLM-CPU gives every linear layer a `cpu_linear(x, weight, bias)` closure over a oneDNN
    handle holding its weights (and drops `weight`); each is wrapped to call a bfloat16 handle
    while `active` is set."""

    def __init__(self, model, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self.active = False
        self.layers = 0  # linear layers given a copy
        self.bytes = 0  # what the copies hold
        self.calls = 0  # matmuls that read a copy
        self._install(model)

    @staticmethod
    def problem(model, model_dtype: torch.dtype) -> str | None:
        """Why drafts cannot read reduced-precision weights on this engine (None if they can)."""
        from vllm import _custom_ops as ops

        if model_dtype != torch.float32:
            return f"the model already runs in {str(model_dtype).removeprefix('torch.')}"
        if not getattr(ops, "_supports_onednn", False):
            return "this vLLM build has no oneDNN matmul"
        if not cpu_has_bf16():
            return "this CPU has no bfloat16 matmul instructions (AVX512-BF16 or AMX)"
        if not any(_draft_linear_size(m) for m in model.modules()):
            return "the model's linear layers are not vLLM-CPU's oneDNN layers"
        return None

    def _install(self, model) -> None:
        from vllm import _custom_ops as ops

        for module in model.modules():
            k = _draft_linear_size(module)
            if not k or getattr(module.cpu_linear, "kapc_draft_copy", False):
                continue
            full = module.cpu_linear
            # the layer's own matmul of the identity gives back its weight, transposed, exactly
            # (each output is one weight times 1.0 plus zeros), whatever layout oneDNN keeps
            with torch.inference_mode():
                wt = full(torch.eye(k, dtype=torch.float32), None, None)  # [k, n]
                weight = wt.t().contiguous().to(self.dtype)  # [n, k], as vLLM hands it over
            handle = ops.create_onednn_mm(weight.t(), 32)
            self.layers += 1
            self.bytes += weight.numel() * weight.element_size()

            def cpu_linear(x, w, bias, _full=full, _handle=handle, _dt=self.dtype):
                if not self.active:
                    return _full(x, w, bias)
                self.calls += 1
                y = ops.onednn_mm(_handle, x.to(_dt), None).to(x.dtype)
                return y if bias is None else y + bias

            cpu_linear.kapc_draft_copy = True
            module.cpu_linear = cpu_linear


def _draft_linear_size(module) -> int:
    """The input size of a vLLM-CPU oneDNN linear layer that forwards call (0 for anything else:
    other layers, and the token embedding, whose matmul is never called)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    if (
        not callable(getattr(module, "cpu_linear", None))
        or module.cpu_linear is torch.nn.functional.linear
    ):
        return 0
    if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
        return 0
    return int(getattr(module, "input_size_per_partition", 0) or 0)


def before_rejection_sampling(runner, adjust) -> None:
    """Call `adjust(draft_rows, logits)` before vLLM's rejection sampler compares drafts with
    target logits; `draft_rows` is a list of (row, target_logit_indices, draft_token_ids). Once
    per runner."""
    rs = getattr(runner, "rejection_sampler", None)
    if rs is None or getattr(rs, "_kapc_wrapped", False):
        return
    forward = rs.forward

    def wrapped(metadata, draft_probs, logits, sampling_metadata, *a, **kw):
        if logits is not None:
            rows, start = [], 0
            for row, n in enumerate(metadata.num_draft_tokens):
                if n:
                    rows.append(
                        (
                            row,
                            metadata.target_logits_indices[start : start + n],
                            metadata.draft_token_ids[start : start + n],
                        )
                    )
                start += n
            if rows:
                adjust(rows, logits)
        return forward(metadata, draft_probs, logits, sampling_metadata, *a, **kw)

    rs.forward = wrapped
    rs._kapc_wrapped = True


def sampled_verification_on_cpu() -> None:
    """Make vLLM-CPU's rejection sampling of sampled requests read their own temperature, top-k
    and top-p. vLLM 0.32 spreads each request's values over its draft positions with
    `expand_batch_to_tokens`, whose CPU kernel fills an int64 temporary and never the float or
    int32 buffer it returns (vLLM issue #55005): the rejection sampler then divides by
    uninitialised memory and sampled output is biased (ngram's too). The same expansion in torch
    replaces it, on CPU only. Once per process."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu() or getattr(
        rejection_sampler.expand_batch_to_tokens, "_kapc", False
    ):
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(values, counts, output_size=int(num_tokens))

    expand_batch_to_tokens._kapc = True  # type: ignore[attr-defined]
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


def attention_modules(vllm_config, layout: AttentionLayout) -> list:
    """The attention layer modules, in layer order (they hold each layer's KV cache)."""
    ctx = vllm_config.compilation_config.static_forward_context
    return [ctx[name] for name in layout.layer_names]


def attention_pre_hooks(vllm_config, layout: AttentionLayout, hook) -> None:
    """Call `hook(layer_index, query, key)` before every attention layer runs (query [tokens,
    heads * head_dim], key [tokens, kv_heads * head_dim], rotary applied): the model calls each
    `Attention` module with (q, k, v), so a forward pre-hook sees the layer's true query without a
    fork of vLLM. Once per engine."""
    for i, module in enumerate(attention_modules(vllm_config, layout)):
        if getattr(module, "_kapc_hooked", False):
            continue
        module.register_forward_pre_hook(lambda mod, args, i=i: hook(i, args[0], args[1]))
        module._kapc_hooked = True


# The caches kapc's kernel reads: vLLM-CPU's kernel (ISA) and the dtype it keeps the cache in.
KERNEL_LAYOUTS = {("vec", torch.float32), ("amx", torch.bfloat16)}


def attention_kernel_problem(vllm_config, layout: AttentionLayout) -> str | None:
    """Why kapc's attention kernel cannot stand in for this engine's (None if it can): it reads
    vLLM-CPU's float32 "vec" and bfloat16 "amx" cache layouts, with plain causal attention."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    for module in attention_modules(vllm_config, layout):
        impl = module.impl
        if type(impl) is not CPUAttentionBackendImpl:
            return f"the attention backend is {type(impl).__name__}, not vLLM-CPU's"
        isa, dtype = getattr(module, "isa", None), vllm_config.model_config.dtype
        if impl.kv_cache_dtype != "auto":
            return f"the KV cache is quantised ({impl.kv_cache_dtype})"
        if (isa, dtype) not in KERNEL_LAYOUTS:
            return (
                f"vLLM-CPU keeps a {str(dtype).removeprefix('torch.')} cache for its {isa!r} "
                f"kernel (kapc's reads float32 for 'vec' and bfloat16 for 'amx')"
            )
        if (
            impl.alibi_slopes is not None
            or impl.sliding_window != -1
            or impl.logits_soft_cap
            or impl.sinks is not None
        ):
            return "the attention has ALiBi, a sliding window, a soft cap or sinks"
    return None


def replace_decode_attention(
    vllm_config,
    layout: AttentionLayout,
    kernel,
    max_query: int,
    on_call=None,
    on_refused=None,
    trials=None,
) -> None:
    """Run `kernel(query, kv_cache, output, query_start_loc, seq_lens, block_table, scale)` instead
    of vLLM-CPU's attention kernel in every forward whose rows have at most `max_query` query
    tokens: decode steps, draft forwards and verification steps. Prefill chunks keep vLLM's. The
    KV write is not touched: vLLM does it before the attention call. `on_call(layer_index,
    max_query_len)` is told of each replaced call. `trials` (kapc.runtime.kernels.choice.
    KernelTrials) picks, per shape of forward, which kernel runs each layer, and is told how long
    each call took while it is still trying that shape. A kernel that raises a `KapcError` is not
    called again: that call and every later one run vLLM's kernel, and `on_refused(reason)` is
    told once. Once per engine; check `attention_kernel_problem` first."""
    from kapc.errors import KapcError

    refused: list[str] = []
    for i, module in enumerate(attention_modules(vllm_config, layout)):
        impl = module.impl
        if getattr(impl, "_kapc_forward", None) is not None:
            continue
        original = impl.forward

        def forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output,
            *args,
            _original=original,
            _impl=impl,
            _i=i,
            **kwargs,
        ):
            m = attn_metadata
            if refused or not _kernel_fits(m, max_query):
                return _original(layer, query, key, value, kv_cache, m, output, *args, **kwargs)
            on_kapc, tried = _kernel_choice(trials, m, _i)
            t0 = time.perf_counter()
            if not on_kapc:
                _original(layer, query, key, value, kv_cache, m, output, *args, **kwargs)
                if tried is not None:
                    trials.timed(tried, False, time.perf_counter() - t0)
                return output
            n = m.num_actual_tokens
            try:
                kernel(
                    query[:n],
                    kv_cache,
                    output[:n],
                    m.query_start_loc,
                    m.seq_lens,
                    m.block_table,
                    _impl.scale,
                )
            except KapcError as exc:
                refused.append(str(exc))
                if on_refused is not None:
                    on_refused(str(exc))
                return _original(layer, query, key, value, kv_cache, m, output, *args, **kwargs)
            if tried is not None:
                trials.timed(tried, True, time.perf_counter() - t0)
            if on_call is not None:
                on_call(_i, m.max_query_len)
            return output

        impl.forward = forward
        impl._kapc_forward = forward


def _kernel_fits(m, max_query: int) -> bool:
    """Whether kapc's kernel can run a forward of these attention metadata: plain causal
    attention of at most `max_query` query tokens per row."""
    return (
        m is not None
        and m.max_query_len <= max_query
        and m.causal is True
        and getattr(m, "dynamic_causal", None) is None
    )


def _kernel_choice(trials, m, layer: int) -> tuple[bool, tuple[int, int] | None]:
    """Whether kapc's kernel runs `layer`'s forward under `trials` (always, without them), and
    the forward's shape while `trials` still times it (else None)."""
    if trials is None:
        return True, None
    shape = forward_shape(m.max_query_len, m.query_start_loc.numel() - 1, m.max_seq_len)
    on_kapc = trials.use_kapc(shape, layer)
    return on_kapc, shape if trials.trying(shape) else None


# A key reader gives a layer's keys as a view [num_blocks, kv_heads, T1, T2, D1, D2]: token t of a
# block at (t // T2, t % T2), dim d of a key at (d // D2, d % D2). Two axes each, because a cache
# packed for a matrix unit (vLLM-CPU's AMX layout) splits tokens and dims across its memory.


def _cpu_packed_keys(kv: torch.Tensor) -> torch.Tensor:
    """vLLM-CPU (its "vec" kernels): a layer's cache [num_blocks, kv_heads, block_size, 2 *
    head_dim] is packed by its kernel with each block's keys first, head_dim-major (a key is a
    column), then its values; the memory is read as such, so the tensor must be the contiguous
    one the kernel writes."""
    if kv.device.type != "cpu" or not kv.is_contiguous():
        raise ValueError("not vLLM-CPU's contiguous cache")
    n, kvh, bs, two_hd = kv.shape
    keys = kv.view(n, kvh, 2, two_hd // 2, bs)[:, :, 0].transpose(2, 3)
    return keys[:, :, None, :, :, None]


def _cpu_amx_keys(kv: torch.Tensor) -> torch.Tensor:
    """vLLM-CPU's bfloat16 cache for its AMX kernel: each block's keys first, in halves of 16
    tokens, each half pairs of dims (key t, dim d at ((t // 16) * head_dim / 2 + d // 2) * 32 +
    (t % 16) * 2 + d % 2), the operand tiles AMX multiplies; then its values."""
    if kv.device.type != "cpu" or not kv.is_contiguous() or kv.dtype != torch.bfloat16:
        raise ValueError("not vLLM-CPU's contiguous bfloat16 cache")
    n, kvh, bs, two_hd = kv.shape
    hd = two_hd // 2
    if bs % 16 or hd % 2:
        raise ValueError("not a block of whole 16-token halves")
    keys = kv.view(n, kvh, 2, bs * hd)[:, :, 0].view(n, kvh, bs // 16, hd // 2, 16, 2)
    return keys.permute(0, 1, 2, 4, 3, 5)


def _content_keys(kv: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's GPU backends (FlashAttention, FlashInfer, Triton, FlexAttention): the layer's
    view is logically [num_blocks, kv_heads, block_size, 2 * head_dim] with a token's key in the
    first head_dim of its content, whatever physical order the cache layout (LBHNC, BLNHC, ...)
    gives its strides; indexing the view reads through them."""
    return kv[..., : kv.shape[-1] // 2][:, :, None, :, :, None]


# Where a layer's keys live, by name: each maps the layer's KV cache tensor to its keys (the view
# above), or raises ValueError if it cannot apply. The engine's is found by `find_key_reader`
# before any bound is read.
KEY_READERS = {
    "vllm-cpu packed": _cpu_packed_keys,
    "vllm-cpu amx": _cpu_amx_keys,
    "vLLM's logical view": _content_keys,
}


def _layer_cache(module) -> torch.Tensor:
    kv = module.kv_cache
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
        raise UnsupportedAttention(
            "per-page key bounds read a 4-D KV cache per layer; this engine keeps another shape"
        )
    return kv


def layer_key_bounds(caches: list[torch.Tensor], reader: str, blocks: list[int]):
    """Element-wise min and max of the keys in KV `blocks` of each layer's cache, read through
    `KEY_READERS[reader]`, per layer and KV head: two tensors [layers, kv_heads, len(blocks),
    head_dim]."""
    lo, hi = [], []
    for kv in caches:
        index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        # [n, kvh, T1, T2, D1, D2], a view in whatever order memory holds
        k = KEY_READERS[reader](kv)
        # gather and reduce in memory order: vLLM-CPU keeps a block's keys head-dim-major, and
        # gathering them as [bs, hd] transposes every block first (3x the time at 8K x 30 layers)
        inner = sorted(range(1, 6), key=lambda d: -k.stride(d))
        g = k.permute(0, *inner).index_select(0, index)
        tokens = [1 + inner.index(d) for d in (2, 3)]
        kept = [d for d in inner if d not in (2, 3)]  # kvh, D1 and D2, in memory order
        order = [0] + [1 + kept.index(d) for d in (1, 4, 5)]  # back to [m, kvh, D1, D2]
        shape = (len(blocks), k.shape[1], k.shape[4] * k.shape[5])
        lo.append(g.amin(dim=tokens).permute(*order).reshape(shape).transpose(0, 1))
        hi.append(g.amax(dim=tokens).permute(*order).reshape(shape).transpose(0, 1))
    return torch.stack(lo), torch.stack(hi)


def key_bounds(vllm_config, layout: AttentionLayout, reader: str, blocks: list[int]):
    """`layer_key_bounds` of this engine's attention layers."""
    caches = [_layer_cache(m) for m in attention_modules(vllm_config, layout)]
    return layer_key_bounds(caches, reader, blocks)


def cache_blocks(vllm_config, layout: AttentionLayout, reader: str) -> int:
    """How many KV blocks this engine's cache holds (block ids run from 0 to this less one)."""
    kv = _layer_cache(attention_modules(vllm_config, layout)[0])
    return int(KEY_READERS[reader](kv).shape[0])


def layer_block_stamps(kv: torch.Tensor, reader: str, blocks: list[int]) -> torch.Tensor:
    """The keys of each of `blocks`' first and last token in cache `kv`: [len(blocks), 2,
    kv_heads, head_dim]. Read from the last layer, whose keys depend on every token before, two
    vectors a block say whether a block still holds what it held when its bounds were read."""
    k = KEY_READERS[reader](kv)
    index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    shape = (len(blocks), k.shape[1], k.shape[4] * k.shape[5])
    # each token is a view of every block; only `blocks`' rows of it are copied
    ends = (k[:, :, 0, 0], k[:, :, -1, -1])
    return torch.stack([t.index_select(0, index).reshape(shape) for t in ends], dim=1)


def block_stamps(vllm_config, layout: AttentionLayout, reader: str, blocks: list[int]):
    """`layer_block_stamps` of this engine's last attention layer."""
    last = attention_modules(vllm_config, layout)[-1]
    return layer_block_stamps(_layer_cache(last), reader, blocks)


def reader_of(kv: torch.Tensor, slot: int, key: torch.Tensor) -> str:
    """The name of the `KEY_READERS` entry through which `key` [kv_heads, head_dim], known to
    be written at `slot` of cache `kv`, reads back; UnsupportedAttention if none does (another
    kernel, ISA or dtype may pack keys in a way kapc does not know)."""
    for name, read in KEY_READERS.items():
        try:
            keys = read(kv)
        except ValueError:
            continue
        t2 = keys.shape[3]
        block_size = keys.shape[2] * t2
        t = slot % block_size
        got = keys[slot // block_size, :, t // t2, t % t2]
        got = got.reshape(got.shape[0], -1)
        if got.shape == key.shape and torch.allclose(
            got.float().cpu(), key.float().cpu(), rtol=1e-2, atol=1e-3
        ):
            return name
    raise UnsupportedAttention(
        "the engine's KV cache does not hold keys where kapc can read them (tried: "
        + ", ".join(KEY_READERS)
        + "): query-aware pages are off"
    )


def find_key_reader(vllm_config, layout: AttentionLayout, slot: int, key: torch.Tensor) -> str:
    """`reader_of` layer 0's cache, for `key` [kv_heads, head_dim] that layer 0 just wrote at
    `slot`: checked once per engine, before any key bound is read."""
    return reader_of(_layer_cache(attention_modules(vllm_config, layout)[0]), slot, key)


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 matmul instructions (AVX512-BF16 or AMX): vLLM-CPU's
    bfloat16 kernels and kapc's draft-weight copies need them."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_kv_room_gib(node: int = 0) -> float | None:
    """GiB free on the NUMA node vLLM-CPU allocates its KV cache on (it refuses to start when asked
    for more), or None where vLLM cannot say."""
    try:
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        return get_memory_node_info(node).available_memory / 2**30
    except Exception:  # noqa: BLE001 - another vLLM layout: let vLLM's own check speak
        return None


# ---- the OpenAI-compatible server (kapc serve) -----------------------------------------------


def api_server_module() -> str:
    """The module `python -m` starts vLLM's OpenAI-compatible server from. `vllm serve` itself
    cannot be used with the vllm-cpu package: its command line asks for the version of a
    distribution named `vllm` and finds none (PackageNotFoundError)."""
    import importlib.util

    for name in (
        "vllm.entrypoints.launchers.api_server.entry",  # 0.32
        "vllm.entrypoints.openai.api_server",
    ):  # earlier
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            continue
    raise RuntimeError("this vLLM has no OpenAI-compatible API server module")


def server_engine_client(app):
    """The engine client of a running vLLM server's FastAPI app (its `collective_rpc` reaches
    the workers)."""
    return app.state.engine_client
