"""A bfloat16 engine on a CPU with AMX (vLLM-CPU's "amx" kernel and cache layout), with the real
SmolLM2: kapc's kernel verifies drafts and vLLM's decodes, and query-aware pages read keys from
the AMX layout. Run only where the CPU has AMX: elsewhere vLLM-CPU keeps no cache in that layout."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import run_probe

pytest.importorskip("vllm")
pytestmark = pytest.mark.model


def test_bfloat16_engine_verifies_on_kapcs_kernel_and_reads_amx_keys(cases, tmp_path):
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM-CPU runs bfloat16 on another kernel here")
    from kapc.runtime.kernels.choice import VerificationsOnly

    out = run_probe("bfloat16_probe", cases[:3], tmp_path)
    engine = out["engine"]
    assert engine["attention_kernel"] == "kapc's"
    assert engine["kernel_choices"] == VerificationsOnly().summary()
    # without plans no forward has more than one query token a row: vLLM's kernel alone decoded
    assert out["plain"]["timing"].get("kernel_steps", 0) == 0
    # with plans, verifications ran on kapc's kernel, drafts (one token a row) on vLLM's
    timing = engine["timing"]
    assert 0 < timing["kernel_steps"] < timing["draft_forwards"]
    # every plan drafted on query-aware pages: keys were read from the AMX layout
    for r in out["planned"]:
        assert r["status"] == "plan" and r["proposed"] > 0, r
        assert r["access"] != "static" and "static pages" not in (r["note"] or ""), r
