"""`kapc.errors.bounded`: messages other libraries write keep their shape, long quoted values are cut."""

from kapc.errors import bounded


def test_short_messages_are_unchanged():
    msg = 'Expected `float`, got `str` - at `$.units[0].scores["dense"]`'
    assert bounded(msg) == msg


def test_a_long_quoted_value_is_cut_and_its_length_said():
    out = bounded(f"Invalid enum value '{'x' * 5000}' - at `$.units[0].kind`")
    assert out.startswith("Invalid enum value 'xxx") and "...' (5000 chars)" in out
    assert out.endswith("- at `$.units[0].kind`") and len(out) < 120


def test_a_path_keeps_its_steps_when_its_key_is_cut():
    out = bounded(f'Expected `float`, got `str` - at `$.units[3].scores["{"k" * 5000}"]`')
    assert out.endswith('..." (5000 chars)]`') and "$.units[3].scores[" in out


def test_a_long_path_alone_is_cut():
    out = bounded("at `$" + ".a" * 2000 + "`", limit=60)
    assert len(out) < 300 and "(4001 chars)" in out
