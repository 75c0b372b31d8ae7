"""compact: the selected-KV view in access order, and the policies that govern running it.

Reads `pages`, `target`, `prompt`. The view lists the selected blocks in ascending logical order
(the order attention reads them); every block before the tail is full and the tail starts on a
block boundary, which is what a paged-attention kernel needs to read a compact block table as one
sequence. Generated tokens continue the tail: the token at logical position p >= prompt length
sits at compact index `tail_slot + (p - tail_block * block_size)`. The table width is padded to
a power of two so that runtimes see few distinct shapes.

Also writes the verification policy (`k`, `accept` greedy or top{N}), the fallback conditions
(retained ratio, acceptance, predicted loss, prior confidence: `min-separation`), the cost model's
prediction for this prompt (`kapc.policy.predict`) and the prompt length from which a plan like
this one pays (`pays_from`, the paper's KV_crit). With a calibration
profile of the target engine (`profile=auto` finds the one `kapc calibrate` wrote for
`kapc compile --engine ...`; `profile=PATH` names one) the prediction uses measured step times and
the profile's acceptance model for this s (for a dynamic or hybrid access policy, its model of
query-chosen pages at the access budget, which is what the drafts read, and the measured cost of
choosing them each cycle); without one, the
paper's memory-bound model with `expect-acceptance` as the per-draft acceptance p. `k=auto` takes
the k with the best predicted speedup. With a profile, the runtime's acceptance floor
(`fallback.min_acceptance`) is raised to the break-even acceptance, so a request whose drafts are
rejected too often to pay stops drafting.
"""

from __future__ import annotations

import dataclasses

import msgspec

from kapc import ir
from kapc.errors import excerpt
from kapc.limits import MAX_BATCH, MAX_K
from kapc.passes.base import CompileContext, Pass, PassError
from kapc.policy import (
    MAX_TOPN,
    AccessPolicy,
    PolicyError,
    access_problem,
    critical_context,
    padded_view,
    parse_accept,
    plan_speedup,
    predict,
)


@dataclasses.dataclass(frozen=True)
class Compact(Pass):
    name = "compact"
    requires = ("resolve-pages",)
    k: int | str = 6  # or "auto"
    accept: str = "greedy"
    expect_acceptance: float = 0.8  # per-draft acceptance p, where no profile says better
    batch: int = 1
    dtype_bytes: int = 4
    max_retained: float = 0.6  # select keeps at most half the prompt; pages round it up
    min_acceptance: float = 0.3
    acceptance_window: int = 32
    on_predicted_loss: bool = True
    # prior confidence: a plan whose priors set its passages apart from the dropped ones by less
    # than this (`select`'s separation, mean prior kept minus dropped) decodes with the full
    # context. The graph frontend's HotpotQA priors separate by 0.13-0.40; flat priors by 0
    min_separation: float = 0.05
    profile: str = "auto"  # auto, none, or the path of a profile file
    # static, dynamic or hybrid (kapc.policy.AccessPolicy). Hybrid by default: at the plan's
    # own s it accepted 0.91 against static's 0.69 at 8K x 8, and as much or more at 2K and 4K
    # but for one row (docs/access.md)
    access: str = "hybrid"
    # dynamic and hybrid: the retained ratio of the prompt the view reads, or "plan" for the
    # plan's own, so that s still falls as the context grows around the same evidence
    access_budget: float | str = "plan"
    proxy: str = "query"  # query, es-in, es-mid or es-mix
    mix: str = ""  # es-mix: the calibration file (`kapc calibrate proxy`)

    def option_problem(self) -> str | None:
        if self.k != "auto" and not (isinstance(self.k, int) and 1 <= self.k <= MAX_K):
            return f"k must be auto or within 1..{MAX_K}, not {excerpt(self.k)}"
        try:
            parse_accept(self.accept)
        except PolicyError:
            return f"accept must be greedy or top2..top{MAX_TOPN}, not {excerpt(self.accept)}"
        for name in ("expect_acceptance", "max_retained", "min_acceptance", "min_separation"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                return f"{name.replace('_', '-')} must be within [0, 1], not {getattr(self, name)}"
        if not 1 <= self.batch <= MAX_BATCH:
            return f"batch must be within 1..{MAX_BATCH}, not {self.batch}"
        if self.dtype_bytes not in (1, 2, 4, 8):
            return f"dtype-bytes must be 1, 2, 4 or 8, not {self.dtype_bytes}"
        if not 1 <= self.acceptance_window <= 1_000_000:
            return f"acceptance-window must be within 1..1000000, not {self.acceptance_window}"
        if self.proxy == "es-mix" and not self.mix:
            return "proxy=es-mix needs mix=FILE (a proxy calibration, `kapc calibrate proxy`)"
        if isinstance(self.access_budget, str) and self.access_budget != "plan":
            return f"access-budget must be a ratio or plan, not {excerpt(self.access_budget)}"
        budget = 0.5 if isinstance(self.access_budget, str) else self.access_budget
        return access_problem(
            AccessPolicy(
                mode=self.access, budget=budget, proxy=self.proxy, mix=("in",) if self.mix else ()
            )
        )

    def run(self, module: ir.Module, ctx: CompileContext) -> ir.Module:
        pages, target = ir.present(module.pages, "pages"), ir.present(module.target, "target")
        n = ir.present(module.prompt, "prompt").tokens
        width = sum(len(r) for r in pages.selected)
        tail_block = pages.blocks - 1
        view = ir.View(
            blocks=width,
            padded_blocks=padded_view(width),
            tail_block=tail_block,
            tail_slot=(width - 1) * pages.block_size,
        )

        weights = target.parameters * self.dtype_bytes
        kv = n * target.kv_elements_per_token * self.dtype_bytes
        s = pages.retained
        # a query-aware proposal reads its budget of the prompt, whatever the plan's pages are
        budget = s if self.access_budget == "plan" else float(self.access_budget)
        drafted = s if self.access == "static" else budget
        profile = self._profile(ctx, target.fingerprint)
        p, fit = self.expect_acceptance, None
        if profile is not None:
            # a profile without a query-aware model: the plan's pages' model at the same s, which
            # measured lower (benchmarks/records/access-pages/), so the prediction errs towards full context
            fit = profile.acceptance_fit(self.accept, self.access) or profile.acceptance_fit(
                self.accept
            )
            p = fit.p(drafted, n) if fit is not None else p
        pred = predict(
            s=drafted,
            p=p,
            k=None if isinstance(self.k, str) else self.k,
            batch=self.batch,
            context=n,
            profile=profile,
            weight_bytes=weights,
            kv_bytes=kv,
            chooses_pages=self.access != "static",
            tolerant=parse_accept(self.accept) > 1,
        )
        speedup = round(pred.speedup, 4)
        # Memory-bound predictions are wrong on compute-bound hardware (docs/cost-model.md): only a
        # measured profile's break-even may stop a runtime.
        floor = self.min_acceptance
        if profile is not None:
            floor = max(floor, pred.break_even if pred.break_even is not None else 1.0)
        pays_from = self._pays_from(ctx, profile, fit, pred, drafted, p, kv / n, weights)
        cost = ir.Cost(
            dtype_bytes=self.dtype_bytes,
            batch=self.batch,
            weight_bytes=weights,
            kv_bytes=kv,
            s=s,
            h=round(pred.h, 6),
            k=pred.k,
            speedup=speedup,
            pays=speedup > 1.0,
            p=round(p, 6),
            basis=pred.basis,
            break_even=pred.break_even,
            by_k=pred.by_k,
            pays_from=pays_from,
        )
        return msgspec.structs.replace(
            module,
            view=view,
            verify=ir.Verify(k=pred.k, accept=self.accept),
            access=self._access(target.fingerprint, budget),
            fallback=ir.Fallback(
                max_retained=self.max_retained,
                min_acceptance=round(floor, 6),
                acceptance_window=self.acceptance_window,
                on_predicted_loss=self.on_predicted_loss,
                min_separation=self.min_separation,
            ),
            cost=cost,
        )

    def _pays_from(
        self,
        ctx: CompileContext,
        profile,
        fit,
        pred,
        s: float,
        p: float,
        kv_per_token: float,
        weights: float,
    ) -> int:
        """The shortest prompt from which this plan's s, k and batch pay (the paper's KV_crit),
        with the profile's acceptance at each length where it has a model; 0: at no length up to
        the model's positions."""

        def speedup_at(context: int) -> float:
            return plan_speedup(
                s=s,
                p=fit.p(s, context) if fit is not None else p,
                k=pred.k,
                batch=self.batch,
                context=context,
                profile=profile,
                weight_bytes=weights,
                kv_bytes=kv_per_token * context,
                chooses_pages=self.access != "static",
                tolerant=parse_accept(self.accept) > 1,
            )

        return critical_context(speedup_at, ctx.assets.context_tokens()) or 0

    def _access(self, fingerprint: str, budget: float) -> ir.Access:
        if self.access == "static":
            return ir.Access(mode="static")
        mix = file = digest = None
        if self.proxy == "es-mix":
            from kapc.errors import KapcError
            from kapc.proxy_mix import load_mix

            try:
                found = load_mix(self.mix)
            except KapcError as exc:
                raise PassError(f"compact: {exc}") from None
            if found.model_fingerprint != fingerprint:
                raise PassError(
                    f"compact: proxy calibration {self.mix} was made for another "
                    f"model ({found.model}, {found.model_fingerprint[:19]})"
                )
            mix, file, digest = found.mix, self.mix, found.digest
        return ir.Access(
            mode=self.access,  # type: ignore[arg-type]  # check() allows only AccessMode's values
            budget=round(budget, 6),
            proxy=self.proxy,  # type: ignore[arg-type]  # and Proxy's
            mix=mix or (),  # type: ignore[arg-type]  # a proxy calibration holds in/mid only
            mix_file=file,
            mix_digest=digest,
        )

    def _profile(self, ctx: CompileContext, fingerprint: str):
        from kapc.profile import ProfileError, find_profile, load_profile

        if self.profile == "none":
            return None
        if self.profile != "auto":
            profile = load_profile(self.profile)
            if profile.model_fingerprint != fingerprint:
                raise PassError(
                    f"compact: profile {self.profile} was calibrated for another model "
                    f"({profile.model}, {profile.model_fingerprint[:19]})"
                )
            return profile
        if ctx.engine is None:
            return None
        try:
            return find_profile(ctx.engine, fingerprint, threads=ctx.threads)
        except ProfileError:
            return None
