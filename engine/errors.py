"""Errors that mean "the input or the configuration is wrong", not "dlrmflow has a bug".

The engine raises them (each module its own subclass, named for what was wrong); the CLI prints
one as a single clear line and exits with status 2. Anything else is a bug and keeps its traceback.
"""


class UserInputError(ValueError):
    """Bad input data, a bad path, or an invalid configuration."""
