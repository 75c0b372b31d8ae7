"""What kapc's hook sets up in a vLLM engine once, at its first proposal: the attention layout,
kapc's attention kernel for decode, draft and verification forwards, bfloat16 copies of the
draft forwards' weights, the model's fingerprint and this machine's calibration profile. Each
says, in words, what it runs and why not the faster choice (`attention_kernel`,
`draft_weights`), for the request statistics and the calibration profile."""

from __future__ import annotations

import logging
import time

import torch

from kapc.runtime.kernels.choice import KernelTrials, VerificationsOnly
from kapc.runtime.vllm import compat, engine_kind
from kapc.runtime.vllm.compat import UnsupportedAttention

log = logging.getLogger("vllm.kapc")

KERNEL_MAX_QUERY = 16  # forwards with at most this many query tokens per row run kapc's kernel


def attention_problems(hf_config) -> list[str]:
    """Why a compact selected-KV view cannot represent this model's attention ([] if it can)."""
    problems = []
    cfgs = [hf_config]
    text = getattr(hf_config, "text_config", None)
    if text is not None:
        cfgs.append(text)
    for c in cfgs:
        sw = getattr(c, "sliding_window", None)
        use_sw = getattr(c, "use_sliding_window", True)
        if sw not in (None, 0, -1) and use_sw:
            problems.append(
                f"sliding-window attention (window {sw}): the window would be taken "
                f"over compact-view indices, not logical positions"
            )
        if getattr(c, "layer_types", None) and any(t != "full_attention" for t in c.layer_types):
            problems.append(
                "layers other than full attention "
                f"({sorted(set(c.layer_types) - {'full_attention'})})"
            )
        if getattr(c, "alibi", False) or getattr(c, "position_embedding_type", "") == "alibi":
            problems.append(
                "ALiBi position biases are computed from KV indices, which the "
                "compact view renumbers"
            )
        if getattr(c, "kv_lora_rank", None):
            problems.append("multi-head latent attention (MLA)")
    return problems


def check_model(vllm_config) -> None:
    problems = attention_problems(vllm_config.model_config.hf_config)
    if problems:
        raise UnsupportedAttention("kapc's vLLM hook cannot run this model: " + "; ".join(problems))


def setup_gist(setup: str) -> str:
    """What an engine setting says without its reasons: "vLLM's: no compiler" -> "vLLM's",
    "the model's (float32): ..." -> "the model's"."""
    return setup.split(":")[0].split(" (")[0]


class EngineSetup:
    """The engine facts and installed parts the hook drafts with (see the module's docstring)."""

    def __init__(self, vllm_config, runner, before_attention, on_kernel_step):
        self.vllm_config = vllm_config
        self.kind = engine_kind(runner.device.type == "cpu")
        self.layout: compat.AttentionLayout = compat.attention_layout(runner)
        self.block_size = self.layout.block_size
        self._fingerprint: str | None = None
        self._fingerprint_error: str | None = None
        # every attention layer calls `before_attention(layer, query, key)` first: page choice
        # and the key-layout probe (kapc.runtime.vllm.keys)
        compat.attention_pre_hooks(vllm_config, self.layout, before_attention)
        # In float32 the kernels agree to 1e-7 and each shape of forward takes the faster one. In
        # bfloat16 they round a row differently by a unit, enough to change a greedy token now
        # and then: kapc's verifies, vLLM's decodes (see VerificationsOnly).
        self.bf16 = vllm_config.model_config.dtype == torch.bfloat16
        self.kernel_trials = VerificationsOnly() if self.bf16 else KernelTrials()
        self.attention_kernel = self._install_attention_kernel(on_kernel_step)
        self.draft_copies: compat.DraftWeights | None = None
        self.draft_weights = self._install_draft_weights(runner)

    # ---- the model -------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """The engine model's fingerprint, as the compiler computes it. Raises `PlanMismatch`
        with the reason when it cannot be computed: a plan is refused, never admitted
        unchecked."""
        from kapc.lower.kapb import PlanMismatch

        if self._fingerprint is None and self._fingerprint_error is None:
            try:
                from kapc.models import load_assets

                model = str(self.vllm_config.model_config.model)
                self._fingerprint = load_assets(model).fingerprint
            except Exception as exc:  # noqa: BLE001 - any failure means: cannot check the model
                self._fingerprint_error = f"{type(exc).__name__}: {exc}"
        if self._fingerprint is None:
            raise PlanMismatch(
                f"cannot fingerprint the engine's model {self.vllm_config.model_config.model} "
                f"to check the plan against it ({self._fingerprint_error})"
            )
        return self._fingerprint

    def find_profile(self):
        """This engine's calibration profile, if `kapc calibrate` measured one for this model on
        this machine (else None): one timed with this worker's thread count where there is one."""
        from kapc.errors import KapcError
        from kapc.profile import find_profile

        try:
            return find_profile(self.kind, self.fingerprint(), threads=torch.get_num_threads())
        except KapcError:
            return None

    def load_profile(self, source: str):
        """A profile by `source`: "auto" (this machine's, if any), "none", or a file's path,
        which must be for this engine's model (else ProfileError)."""
        from kapc.profile import ProfileError, load_profile

        if source == "none":
            return None
        if source == "auto":
            return self.find_profile()
        profile = load_profile(source)
        if profile.model_fingerprint != self.fingerprint():
            raise ProfileError(
                f"{source}: profile calibrated for model {profile.model}, not this engine's; "
                f"run kapc calibrate measure for it"
            )
        return profile

    def check_profile(self, profile) -> None:
        """Warn where no profile prices the steps, or where the profile was measured with another
        attention kernel or other draft weights than this engine runs."""
        if profile is None:
            log.warning(
                "kapc: no calibration profile for %s and this model on this machine: each "
                "plan's compile-time prediction (the paper's memory-bound model unless it was "
                "compiled with a profile) decides alone, and plans that predict a gain can "
                "decode slower than plain vLLM; run `kapc calibrate measure` once so every step "
                "is priced from measured step times",
                self.kind,
            )
            return
        # what a profile from before the field existed was measured with
        for name, unset in (("attention_kernel", "vLLM's"), ("draft_weights", "the model's")):
            measured, running = getattr(profile, name) or unset, getattr(self, name)
            if setup_gist(measured) != setup_gist(running):
                log.warning(
                    "kapc: the calibration profile %s was measured with %s: %s; this engine "
                    "runs %s: its step times do not hold here; run `kapc calibrate` again",
                    profile.key,
                    name.replace("_", " "),
                    measured,
                    running,
                )

    def report(self) -> dict:
        """What the engine runs, for the hook's statistics: the attention kernel and the draft
        forwards' weights (each with why not the faster choice), and the kernel each shape of
        forward was timed onto."""
        return {
            "attention_kernel": self.attention_kernel,
            "draft_weights": self.draft_weights,
            "kernel_choices": self.kernel_trials.summary(),
        }

    # ---- installed parts -------------------------------------------------------------------
    def _install_attention_kernel(self, on_kernel_step) -> str:
        """Decode steps, draft forwards and verification steps (up to KERNEL_MAX_QUERY query
        tokens per row) run kapc's attention kernel (kapc.runtime.kernels): vLLM-CPU's own is
        compute-bound at one query token and pays per query token past the first, which made a
        verification cost 2 to 3 decode steps. Where it cannot run, vLLM's kernel does; the
        returned setting says why."""
        from kapc import settings
        from kapc.runtime import kernels

        problem = None if settings.attention_kernel() else "off (KAPC_ATTENTION_KERNEL=0)"
        if problem is None:
            problem = compat.attention_kernel_problem(self.vllm_config, self.layout)
        if problem is None:
            head_dim = self.vllm_config.model_config.get_head_size()
            try:
                kernels.load_paged_attention(head_dim, self.block_size)
            except kernels.KernelUnavailable as exc:
                problem = str(exc)
            if (
                problem is None
                and self.bf16
                and not kernels.has_bfloat16(head_dim, self.block_size)
            ):
                problem = "kapc's kernel reads bfloat16 caches only on CPUs with AMX-BF16"
        if problem is not None:
            log.info("kapc: attention runs on vLLM's: %s", problem)
            return f"vLLM's: {problem}"

        def refused(reason: str) -> None:
            self.attention_kernel = f"vLLM's: {reason}"
            log.warning("kapc: attention runs on %s", self.attention_kernel)

        def counted(layer: int, max_query: int) -> None:
            if layer == 0:
                on_kernel_step()

        compat.replace_decode_attention(
            self.vllm_config,
            self.layout,
            kernels.paged_attention,
            max_query=KERNEL_MAX_QUERY,
            on_call=counted,
            on_refused=refused,
            trials=self.kernel_trials,
        )
        return "kapc's"

    def _install_draft_weights(self, runner) -> str:
        """Draft forwards read bfloat16 copies of the linear weights where the engine runs
        float32 on a CPU with bfloat16 matmuls (compat.DraftWeights): a draft at batch 1 is
        mostly weight reads. Verification keeps the model's own weights, so outputs do not
        change; only how often drafts are accepted may."""
        from kapc import settings

        dtype = self.vllm_config.model_config.dtype
        problem = None if settings.reduced_draft_weights() else "KAPC_DRAFT_WEIGHTS=float32"
        if problem is None:
            problem = compat.DraftWeights.problem(runner.model, dtype)
        if problem is not None:
            return f"the model's ({str(dtype).removeprefix('torch.')}): {problem}"
        t0 = time.perf_counter()
        self.draft_copies = compat.DraftWeights(runner.model)
        log.info(
            "kapc: drafts read bfloat16 copies of %d linear layers (%.0f MiB, made in %.1f s)",
            self.draft_copies.layers,
            self.draft_copies.bytes / 2**20,
            time.perf_counter() - t0,
        )
        return "bfloat16 copies"
