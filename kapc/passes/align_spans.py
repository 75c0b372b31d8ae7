"""align-spans: the complete logical prompt, rendered and tokenized by the target model itself.

Renders the request with the model's chat template (or verbatim for raw requests), tokenizes it
with the model's tokenizer, and maps every segment's character span to the token span that covers
it (tokens that straddle a boundary belong to both sides). Writes `target` (model, tokenizer and
template fingerprints, the sizes the cost model needs), `prompt` and one `span` per segment.
"""

from __future__ import annotations

import dataclasses

import msgspec

from kapc import ir
from kapc.passes.base import CompileContext, Pass, PassError


@dataclasses.dataclass(frozen=True)
class AlignSpans(Pass):
    name = "align-spans"

    def run(self, module: ir.Module, ctx: CompileContext) -> ir.Module:
        assets = ctx.assets
        rendered, tokens = ctx.tokenize.prompt(module)
        n = len(tokens.ids)
        if n == 0:
            raise PassError(
                "align-spans: the prompt is empty (no segment has any text, and a raw "
                "request adds no template)"
            )
        limit = assets.config.get("max_position_embeddings")
        if limit and n > limit:
            raise PassError(
                f"align-spans: the prompt is {n} tokens, longer than {assets.name}'s "
                f"context of {limit}"
            )
        spans = tuple(
            ir.Span(
                id=seg.id,
                chars=ir.Range(*rendered.segment_chars[seg.id]),
                tokens=ir.Range(first, last),
            )
            for seg, (first, last) in zip(module.segment, tokens.segment_spans(rendered, module))
        )
        target = ir.Target(
            model=assets.name,
            fingerprint=assets.fingerprint,
            tokenizer=assets.tokenizer_fingerprint,
            template=assets.template_fingerprint,
            parameters=assets.parameter_count(),
            kv_elements_per_token=assets.kv_elements_per_token(),
        )
        prompt = ir.Prompt(chars=len(rendered.text), tokens=n, hash=tokens.hash)
        return msgspec.structs.replace(module, target=target, prompt=prompt, span=spans)
