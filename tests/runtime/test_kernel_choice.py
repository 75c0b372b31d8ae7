"""The kernel each shape of forward runs is the one its trials timed faster."""

from kapc.runtime.kernels.choice import TRIAL_FROM_TOKENS, KernelTrials, forward_shape


def run_step(trials: KernelTrials, shape, layers: int, kapc_s: float, engine_s: float) -> list:
    """One step of `layers` layers, each timed as the kernel it ran takes; the kernels used."""
    used = []
    for layer in range(layers):
        kapc = trials.use_kapc(shape, layer)
        if trials.trying(shape):
            trials.timed(shape, kapc, kapc_s if kapc else engine_s)
        used.append(kapc)
    return used


def test_a_shape_is_split_between_the_kernels_then_runs_the_faster():
    trials = KernelTrials(trials=3)
    decode = forward_shape(1, 8, 7936)
    verify = forward_shape(5, 8, 7936)
    assert decode != verify and decode[1] == 65536
    for _ in range(3):  # even layers kapc's, odd the engine's, on both shapes
        assert run_step(trials, decode, 30, kapc_s=0.0066, engine_s=0.0063) == [
            layer % 2 == 0 for layer in range(30)
        ]
        run_step(trials, verify, 30, kapc_s=0.011, engine_s=0.022)
    # the engine's was faster at one query token, kapc's at five
    assert run_step(trials, decode, 30, 0.0066, 0.0063) == [False] * 30
    assert run_step(trials, verify, 30, 0.011, 0.022) == [True] * 30
    assert not trials.trying(decode)
    summary = trials.summary()
    assert summary["q1 kv65536"] == "engine 0.95x"
    assert summary["q5 kv65536"] == "kapc 2.00x"


def test_small_forwards_are_not_tried():
    """Below TRIAL_FROM_TOKENS either kernel takes microseconds and the timer would decide."""
    trials = KernelTrials()
    small = forward_shape(1, 1, TRIAL_FROM_TOKENS // 2)
    assert all(run_step(trials, small, 30, kapc_s=1.0, engine_s=0.1))
    assert not trials.trying(small) and trials.summary() == {}


def test_shapes_round_up_to_a_power_of_two_of_kv_tokens():
    assert forward_shape(1, 8, 8128) == forward_shape(1, 8, 8176) == (1, 65536)
    assert forward_shape(1, 7, 8128) == (1, 65536)
    assert forward_shape(1, 4, 8128) == (1, 32768)
    assert forward_shape(2, 4, 8128) == (2, 32768)


def test_a_choice_is_tried_again_and_decided_on_every_trial_so_far():
    """A first trial that favoured the engine by a little is tried again after `retry_every`
    forwards of its shape; kapc's kernel, clearly faster in the second trial, wins on the
    two trials' sums, and the shape's forwards run it from then on."""
    trials = KernelTrials(trials=2, retry_every=5)
    shape = forward_shape(1, 32, 3072)
    for _ in range(3):
        run_step(trials, shape, 30, kapc_s=0.0105, engine_s=0.0100)
    assert not trials.trying(shape) and trials.summary()["q1 kv131072"] == "engine 0.95x"
    decided = 0
    while (used := run_step(trials, shape, 30, kapc_s=0.006, engine_s=0.010)) == [False] * 30:
        decided += 1  # every layer on the engine's kernel, until the retry is due
        assert decided <= 5
    assert decided == 5
    while trials.trying(shape):
        assert used == [layer % 2 == 0 for layer in range(30)]  # split again
        used = run_step(trials, shape, 30, kapc_s=0.006, engine_s=0.010)
    assert used == [True] * 30
    # on both trials' calls: kapc (0.0105 + 0.006) / 2 against the engine's 0.0100
    assert trials.summary()["q1 kv131072"] == "kapc 1.21x"


def test_bfloat16_engines_verify_on_kapcs_kernel_and_decode_on_the_engines():
    # a bfloat16 row decodes with the engine's kernel, as plain vLLM does, and only forwards of
    # several query tokens per row (verifications) take kapc's; nothing is tried or timed
    from kapc.runtime.kernels.choice import VerificationsOnly

    policy = VerificationsOnly()
    for tokens in (1024, 65536):
        assert [policy.use_kapc((1, tokens), layer) for layer in range(4)] == [False] * 4
        assert all(policy.use_kapc((q, tokens), 0) for q in (2, 5, 8))
        assert not policy.trying((5, tokens))
    assert set(policy.summary().values()) == {"engine (bfloat16)", "kapc (bfloat16)"}
