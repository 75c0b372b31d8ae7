"""The one base class of every error kapc reports to a user as a message, not a traceback."""


class KapcError(ValueError):
    pass


def excerpt(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: an error names a bad value, it does not echo a
    100 KB one back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}...({len(text)} chars)"
