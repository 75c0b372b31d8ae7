"""Lower a compacted module to `.kapb` bytes.

The prompt is rendered and tokenized again (memoised in the compile context, so `kapc compile`
tokenizes once) and must hash to what `align-spans` recorded: a `.kap` edited by hand, or one
aligned with another tokenizer, cannot slip through."""

from __future__ import annotations

import numpy as np

from kapc import __version__
from kapc.errors import KapcError
from kapc.ir import Module, present
from kapc.lower.kapb import (
    CostPrediction,
    FallbackPolicy,
    KapbError,
    PlanHeader,
    decode_plan,
    encode_plan,
)
from kapc.passes.base import CompileContext
from kapc.policy import access_policy


class LowerError(KapcError):
    pass


def lower_module(module: Module, ctx: CompileContext) -> bytes:
    if "compact" not in module.kap.passes:
        raise LowerError(
            f"cannot lower module {module.kap.name!r}: it has not been through "
            f"`compact` (passes so far: {', '.join(module.kap.passes) or 'none'})"
        )
    # the checker refuses a module that ran compact without these statements
    target, prompt = present(module.target, "target"), present(module.prompt, "prompt")
    pages, view = present(module.pages, "pages"), present(module.view, "view")
    verify, access = present(module.verify, "verify"), present(module.access, "access")
    f, c = present(module.fallback, "fallback"), present(module.cost, "cost")
    assets = ctx.assets
    if target.fingerprint != assets.fingerprint or target.tokenizer != assets.tokenizer_fingerprint:
        raise LowerError(
            f"module {module.kap.name!r} was aligned for model {target.model} "
            f"({target.fingerprint[:19]}), but the model given is {assets.name} "
            f"({assets.fingerprint[:19]}); pass --model for the model it was made for"
        )
    rendered, tokens = ctx.tokenize.prompt(module)
    name = module.kap.name
    if tokens.hash != prompt.hash or len(tokens.ids) != prompt.tokens:
        raise LowerError(
            f"module {name!r}: the prompt tokenizes to {len(tokens.ids)} tokens "
            f"({tokens.hash[:19]}), not the {prompt.tokens} "
            f"({prompt.hash[:19]}) recorded by align-spans (was it edited?)"
        )
    # Spans are facts about the prompt, not choices: a plan must not rest on edited ones.
    for seg, span, (first, last) in zip(
        module.segment, module.span, tokens.segment_spans(rendered, module)
    ):
        if (span.tokens.start, span.tokens.end) != (first, last):
            raise LowerError(
                f"module {name!r}: span %{span.id} says tokens "
                f"{span.tokens.start}..{span.tokens.end}, the prompt puts segment "
                f"%{seg.id} at {first}..{last} (was it edited?)"
            )

    bs, n = pages.block_size, prompt.tokens
    blocks = np.concatenate([np.arange(r.start, r.end, dtype=np.int32) for r in pages.selected])
    positions = (blocks[:, None] * bs + np.arange(bs, dtype=np.int32)).ravel()
    positions = positions[positions < n]
    header = PlanHeader(
        name=module.kap.name,
        kapc_version=__version__,
        model=target.model,
        model_fingerprint=target.fingerprint,
        tokenizer_fingerprint=target.tokenizer,
        template_fingerprint=target.template,
        block_size=bs,
        prompt_tokens=n,
        prompt_hash=prompt.hash,
        visible_prompt_tokens=pages.visible,
        retained_ratio=pages.retained,
        padded_blocks=view.padded_blocks,
        k=verify.k,
        accept=verify.accept,
        fallback=FallbackPolicy(
            max_retained=f.max_retained,
            min_acceptance=f.min_acceptance,
            acceptance_window=f.acceptance_window,
            on_predicted_loss=f.on_predicted_loss,
            min_separation=f.min_separation,
        ),
        cost=CostPrediction(
            weight_bytes=c.weight_bytes,
            kv_bytes=c.kv_bytes,
            batch=c.batch,
            s=c.s,
            h=c.h,
            k=c.k,
            speedup=c.speedup,
            pays=c.pays,
            basis=c.basis,
            break_even=c.break_even,
            p=c.p,
        ),
        access=access_policy(access),
        prior_separation=(module.select.separation if module.select is not None else None),
    )
    data = encode_plan(header, tokens.ids, blocks, positions)
    try:
        decode_plan(data, f"plan {name!r}")  # the reader's consistency checks, at the writer
    except KapbError as exc:
        raise LowerError(f"module {name!r} lowers to an inconsistent plan: {exc}") from None
    return data
