"""The error a malformed or out-of-range dataset file raises."""


class DataError(ValueError):
    """A dataset file that cannot be read as what it claims to be (a ValueError)."""
