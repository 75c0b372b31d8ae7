"""Decode throughput of plan decoding against full-context decoding, measured in the same run.

    python -m benchmarks.decode                          # 2K/4K/8K x batch 1/4/8 x 128 tokens
    python -m benchmarks.decode --contexts 2048 --batches 1,4 --new-tokens 32   # quick
    python -m benchmarks.decode --plans gold             # oracle plans: the gold passages only
    python -m benchmarks.decode --contexts 8192 --batches 8 --access static,dynamic:query,hybrid:es-mid

For each context length, real HotpotQA prompts (a question's own ten paragraphs plus hard negatives
from other questions, up to the length) are prefilled ONCE into the paged KV cache's prefix cache;
every configuration then forks them, so prefill is not part of what is compared. A context's
prompts stop short of the model's position limit less the output (SmolLM2: 8192 positions, so
"8192" builds ~8000-token prompts; benchmarks.vllm_decode.fit_context). Every request
decodes exactly --new-tokens tokens (EOS ignored), so both sides do the same work. For each batch
size it decodes the batch full-context, then under plans, and prints: decode throughput of both
and their ratio, the executed s, the observed acceptance h, the cost model's prediction (with the
plan's assumed h and with the observed h), whether outputs are identical, and where the time goes.

Plans (--plans):
  frontend  (default) what a user runs: kapc's graph frontend scores the prompt
            (kapc.frontend.hybrid.hotpotqa_prior) and the compiler selects with the default
            pipeline's select (the top passages by prior within --budget-ratio; --select
            changes its options), compiled per batch size;
  gold      oracle plans that keep the gold passages' blocks, the instruction (with the
            attention sink), the question and the tail (runtime/prompts.py's prompts).

Access policies (--access, docs/access.md): `plan` runs each plan's own policy (the default
pipeline's: hybrid at the plan's s), `static` only the plans' own pages; `MODE:PROXY`
(mode dynamic or hybrid, proxy query, es-in, es-mid or es-mix) chooses pages per layer from the
draft's query within --access-budget of the prompt (`plan`: each plan's own s, matched budgets),
against the same full-context run. --accept greedy,top3 runs every policy under each rule. es-mix
needs --mix FILE (`kapc calibrate proxy`). --overlap also scores every proxy's choice against
the true query's (costs time: leave it off when timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.vllm_decode import access_budget, default_select


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--contexts",
        type=_ints,
        default=[2048, 4096, 8192],
        help="context lengths in tokens (comma-separated)",
    )
    ap.add_argument("--batches", type=_ints, default=[1, 4, 8], help="batch sizes")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=6, help="proposal length")
    ap.add_argument(
        "--accept",
        type=lambda v: [x for x in v.split(",") if x],
        default=["greedy"],
        help="comma list of acceptance rules: greedy, topN",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--plans", choices=("frontend", "gold"), default="frontend")
    budget, select = default_select()
    ap.add_argument(
        "--budget-ratio",
        type=lambda v: [float(x) for x in v.split(",") if x],
        default=[budget],
        help="select's budget for --plans frontend; a comma list "
        "sweeps budgets against the same full-context run",
    )
    ap.add_argument("--frontend", default="graph", help="frontend scores for --plans frontend")
    ap.add_argument(
        "--select",
        default=select,
        help="more select options for --plans frontend (default: the default "
        "pipeline's, evidence-driven: --budget-ratio is a ceiling; '' for a fixed "
        "fraction)",
    )
    ap.add_argument(
        "--first-question",
        type=int,
        default=0,
        help="HotpotQA dev index of the first question (the batch takes consecutive)",
    )
    ap.add_argument("--model", default=None, help="local Hugging Face folder (default SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--access",
        default="plan",
        help="comma list of access policies: plan (the plan's own), static, or "
        "MODE:PROXY (dynamic/hybrid, "
        "query/es-in/es-mid/es-mix)",
    )
    ap.add_argument(
        "--access-budget",
        type=access_budget,
        default="plan",
        help="the retained ratio dynamic and hybrid views read, or 'plan' for each plan's own s",
    )
    ap.add_argument("--mix", default=None, help="ES-Mix calibration for es-mix policies")
    ap.add_argument("--overlap", action="store_true", help="measure proxy overlap per layer")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    import torch

    from kapc.runtime.executor import Executor, Request
    from kapc.runtime.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    m = load_model(args.model, device=args.device, dtype=args.dtype)
    policies = _policies(args, m)
    bs, k = args.block_size, args.k
    nb = max(args.batches)
    print(
        f"model {m.name} on {m.device} ({str(m.dtype).replace('torch.', '')}), "
        f"{torch.get_num_threads()} threads; k={k}, accept={','.join(args.accept)}, block {bs}, "
        f"{args.new_tokens} new tokens",
        flush=True,
    )
    rows = []
    for L in args.contexts:
        t0 = time.perf_counter()
        cases = _cases(m, L, nb, args)
        lens = [len(ids) for ids, _ in cases]
        per_seq = -(-(max(lens) + args.new_tokens + k + 2 * bs) // bs)
        ex = Executor(
            m,
            block_size=bs,
            kv_blocks=2 * nb * per_seq + 8,
            prefix_cache=True,
            honor_predicted_loss=False,
        )
        t1 = time.perf_counter()
        _, pst = ex.generate([Request(ids, max_tokens=1) for ids, _ in cases])
        print(
            f"\n== context {L}: prompts of {min(lens)}-{max(lens)} tokens (built in "
            f"{t1 - t0:.1f}s, prefilled once in {pst.prefill_s:.1f}s)",
            flush=True,
        )
        for B in args.batches:
            cs = cases[:B]
            full_res, fst = ex.generate(
                [Request(ids, max_tokens=args.new_tokens, ignore_eos=True) for ids, _ in cs]
            )
            budgets = args.budget_ratio if args.plans == "frontend" else [None]
            for budget in budgets:
                plans = [make_plan(B, budget) for _, make_plan in cs]
                for rule in args.accept:
                    for label, access in policies:
                        ex.measure_overlap = (
                            args.overlap and access is not None and access.mode != "static"
                        )
                        plan_res, pst = ex.generate(
                            [
                                Request(
                                    ids,
                                    plan=pl,
                                    max_tokens=args.new_tokens,
                                    ignore_eos=True,
                                    accept=rule,
                                    access=_matched(access, pl, args.access_budget),
                                )
                                for (ids, _), pl in zip(cs, plans)
                            ]
                        )
                        row = _row(
                            m, L, B, budget, args, cs, plans, full_res, fst, plan_res, pst, rule
                        )
                        row["access"] = label
                        rows.append(row)
                        _print_row(row)
        ex.clear_prefix_cache()
        ex.cache.check_no_leak()
        del ex
    print("\nsummary")
    print(
        f"{'ctx':>6} {'B':>3} {'budget':>6} {'accept':>6} {'access':>14} {'full tok/s':>10} "
        f"{'plan tok/s':>10} "
        f"{'speedup':>8} {'pred':>6} {'pred@h':>7} {'s':>6} {'h':>5} {'tok/cyc':>7} "
        f"{'select ms':>9} {'overlap':>7} identical"
    )
    for r in rows:
        budget = "gold" if r["budget_ratio"] is None else f"{r['budget_ratio']:.2f}"
        p = r["plan"]
        per_cycle = p["select_s"] * 1000 / max(1, p["cycles"])
        ov = p["overlap"]
        print(
            f"{r['context']:>6} {r['batch']:>3} {budget:>6} {r['accept']:>6} {r['access']:>14} "
            f"{r['full_tok_s']:>10.2f} "
            f"{r['plan_tok_s']:>10.2f} {r['speedup_measured']:>7.2f}x "
            f"{r['speedup_predicted_plan']:>5.2f}x {r['speedup_predicted_observed_h']:>6.2f}x "
            f"{r['s']:>6.3f} {r['h']:>5.2f} {r['tokens_per_cycle']:>7.2f} {per_cycle:>9.1f} "
            f"{sum(ov.values()) / len(ov) if ov else float('nan'):>7.2f} {r['identical']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _matched(access, plan, budget):
    """The policy for one request: with --access-budget plan, at its plan's own retained ratio."""
    if access is None or access.mode == "static" or budget != "plan":
        return access
    import msgspec

    return msgspec.structs.replace(access, budget=plan.header.retained_ratio)


def _policies(args, m) -> list:
    """(label, AccessPolicy or None) per --access entry."""
    from kapc.policy import AccessPolicy, access_problem

    mix = ()
    if args.mix:
        from kapc.proxy_mix import load_mix

        mix = load_mix(args.mix).mix
    out = []
    for spec in (x.strip() for x in args.access.split(",") if x.strip()):
        if spec in ("plan", "static"):  # the plan's own policy, or its pages only
            out.append((spec, None if spec == "plan" else AccessPolicy()))
            continue
        mode, _, proxy = spec.partition(":")
        access = AccessPolicy(
            mode=mode,
            budget=0.5 if args.access_budget == "plan" else args.access_budget,
            proxy=proxy or "query",
            mix=mix if proxy == "es-mix" else (),
        )
        problem = access_problem(access, m.num_layers)
        if problem:
            raise SystemExit(f"--access {spec}: {problem}")
        out.append((spec, access))
    return out


def _row(m, L, B, budget, args, cs, plans, full_res, fst, plan_res, pst, rule) -> dict:
    from kapc.policy import predicted_speedup

    k = args.k
    identical = all(a.tokens == b.tokens for a, b in zip(full_res, plan_res))
    prop = sum(r.proposed for r in plan_res)
    acc = sum(r.accepted for r in plan_res)
    s = sum(r.retained_ratio or 0 for r in plan_res) / B
    h = acc / prop if prop else 0.0
    kv = sum(pl.header.cost.kv_bytes for pl in plans) / B
    ftps = fst.decode_tokens / fst.decode_s
    ptps = pst.decode_tokens / pst.decode_s
    return {
        "context": L,
        "prompt_tokens": sum(len(ids) for ids, _ in cs) / B,
        "plans": args.plans,
        "budget_ratio": budget,
        "batch": B,
        "new_tokens": args.new_tokens,
        "k": k,
        "accept": rule,
        "full_tok_s": ftps,
        "plan_tok_s": ptps,
        "speedup_measured": ptps / ftps,
        "s": s,
        "h": h,
        "h_per_request": [r.acceptance_rate for r in plan_res],
        "tokens_per_cycle": sum(r.decode_tokens for r in plan_res)
        / max(1, sum(r.cycles for r in plan_res)),
        "speedup_predicted_plan": plans[0].header.cost.speedup,
        "assumed_h": plans[0].header.cost.h,
        "speedup_predicted_observed_h": predicted_speedup(m.weight_bytes, kv, B, s, h, k),
        "pays": plans[0].header.cost.pays,
        "identical": identical,
        "fallbacks": [r.fallback_reason for r in plan_res if r.fallback_reason],
        "full": fst.as_dict(),
        "plan": pst.as_dict(),
    }


def _cases(m, L: int, n: int, args) -> list:
    """n (prompt ids, (batch, budget) -> Plan) pairs for HotpotQA dev questions
    first..first+n-1."""
    from benchmarks.vllm_decode import fit_context
    from kapc.lower.kapb import decode_plan
    from kapc.runtime.planning import plan_from_blocks
    from kapc.runtime.prompts import build_long_prompt

    bs, k, first = args.block_size, args.k, args.first_question
    if args.plans == "gold":
        out = []
        for i in range(n):
            p = build_long_prompt(
                m.path, first + i, fit_context(L, args.new_tokens, k, bs, args.model)
            )
            blocks = p.instruction_blocks(bs) + p.gold_blocks(bs) + p.question_blocks(bs)

            def make(B, budget, p=p, blocks=blocks, i=i):
                return plan_from_blocks(
                    m,
                    p.token_ids,
                    blocks,
                    block_size=bs,
                    k=k,
                    accept=args.accept[0],
                    batch=B,
                    name=f"hotpotqa-{first + i}-{L}",
                )

            out.append((list(p.token_ids), make))
        return out
    from benchmarks.vllm_decode import compile_prior
    from kapc.frontend.hybrid import hotpotqa_prior
    from kapc.passes import CompileContext

    ctx = CompileContext(args.model)
    out = []
    for i in range(first, first + n):
        t0 = time.perf_counter()
        prior = hotpotqa_prior(
            i,
            context_tokens=fit_context(L, args.new_tokens, k, bs, args.model),
            frontend=args.frontend,
            model=args.model,
        )
        memo = {}

        def make(B, budget, prior=prior, memo=memo):
            if (B, budget) not in memo:
                memo[B, budget] = decode_plan(
                    compile_prior(
                        prior,
                        block_size=bs,
                        budget_ratio=budget,
                        k=k,
                        batch=B,
                        ctx=ctx,
                        accept=args.accept[0],
                        select=args.select,
                    )
                )
            return memo[B, budget]

        ids = [int(t) for t in make(1, args.budget_ratio[0]).prompt_token_ids]
        print(
            f"  prior q{i} at {L}: {len(ids)} tokens ({time.perf_counter() - t0:.1f}s)", flush=True
        )
        out.append((ids, make))
    return out


def _print_row(r: dict) -> None:
    f, p = r["full"], r["plan"]
    budget = "gold passages" if r["budget_ratio"] is None else f"budget {r['budget_ratio']}"
    print(
        f"-- batch {r['batch']}, {budget}, access {r.get('access', 'static')}: full {r['full_tok_s']:.2f} tok/s, plan "
        f"{r['plan_tok_s']:.2f} tok/s -> {r['speedup_measured']:.2f}x measured; predicted "
        f"{r['speedup_predicted_plan']:.2f}x "
        f"(assumed h={r['assumed_h']:.2f}), {r['speedup_predicted_observed_h']:.2f}x at the "
        f"observed h; s={r['s']:.3f} h={r['h']:.3f} tokens/cycle={r['tokens_per_cycle']:.2f} "
        f"identical={r['identical']}; h per request "
        f"{[round(x, 2) if x is not None else None for x in r['h_per_request']]}"
        + (f" fallbacks={r['fallbacks']}" if r["fallbacks"] else ""),
        flush=True,
    )
    print(
        f"   full: {f['decode_s']:.1f}s = {f['verify_forwards']} forwards x "
        f"{f['verify_s'] / max(1, f['verify_forwards']) * 1000:.0f}ms (KV gathers "
        f"{f['gather_s']:.1f}s), other {f['other_s']:.2f}s",
        flush=True,
    )
    print(
        f"   plan: {p['decode_s']:.1f}s = proposal {p['proposal_s']:.1f}s "
        f"({p['draft_forwards']} draft forwards x "
        f"{p['proposal_s'] / max(1, p['draft_forwards']) * 1000:.0f}ms) + verification "
        f"{p['verify_s']:.1f}s ({p['verify_forwards']} x "
        f"{p['verify_s'] / max(1, p['verify_forwards']) * 1000:.0f}ms) + other "
        f"{p['other_s']:.2f}s; KV gathers {p['gather_s']:.1f}s inside",
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
