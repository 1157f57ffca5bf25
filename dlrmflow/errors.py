"""Errors that mean "the input or the configuration is wrong", not "dlrmflow has a bug".

The CLI prints them as one clear line and exits with status 2; anything else is a bug and
keeps its traceback.
"""


class UserInputError(ValueError):
    """Bad input data, a bad path, or an invalid configuration."""
