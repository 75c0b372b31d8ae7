"""The one base class of every error kapc reports to a user as a message, not a traceback."""


class KapcError(ValueError):
    pass
