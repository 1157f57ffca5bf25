"""A step's configuration, declared once: :class:`ConfigModel`, the base of every step's config model.

A config model (``TrainConfig``, ``PreprocessConfig``, ``ProfileConfig``, ``PlanConfig``) is a frozen
pydantic model that refuses unknown fields; each field carries its type, default, bounds and help text.
It is what the engine runs, the step's flow parameter, the source of the step's ``dlrmflow`` options
(:meth:`ConfigModel.cli_option` names them; ``dlrmflow/commands/options.py`` builds them) and of the
pipeline's fields. Constructing one validates it: a bad value raises the model's own
``UserInputError`` subclass (the CLI prints one line and exits 2) whose message starts with the
field's name, e.g. ``batch_size: --batch-size must be >= 1, got 0``.

This module imports neither torch nor Prefect: the CLI builds its parser from the models.
"""

from __future__ import annotations

from typing import Any, ClassVar

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, ValidationError

from dlrmflow.engine.errors import UserInputError


class ConfigModel(BaseModel):
    """Frozen; unknown fields are refused; ``Model(**values)`` raises :attr:`error` naming every invalid field.

    A subclass says how its errors and options read: :attr:`error` (the exception), :attr:`setting` (the
    noun of ``x: not a training setting``), :attr:`option_names` (fields whose option is not
    ``--field-name``; a name without ``--`` is a positional argument) and :attr:`no_option` (fields no
    option sets)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: ClassVar[type[UserInputError]] = UserInputError
    setting: ClassVar[str] = "setting"
    option_names: ClassVar[dict[str, str]] = {}
    no_option: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise config_error(exc, type(self)) from None

    @classmethod
    def cli_option(cls, field: str) -> str | None:
        """The ``dlrmflow`` option (or positional) that sets ``field``; None for a field no option sets."""
        if field in cls.no_option:
            return None
        return cls.option_names.get(field, "--" + field.replace("_", "-"))

    @classmethod
    def default(cls, field: str) -> Any:
        """The default of ``field``: what every caller that leaves it out gets (declared once, here)."""
        return cls.model_fields[field].default


# ---- one line naming the field -------------------------------------------------------------------------


def config_error(exc: ValidationError, model: type[ConfigModel]) -> UserInputError:
    """The error to raise for ``exc``: the rule's own error when a validator raised one, else
    ``model.error`` with one ``field: problem`` part per invalid field."""
    errors = exc.errors()
    for error in errors:
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, UserInputError):
            return cause
    return model.error("; ".join(_problem(error, model) for error in errors))


def _problem(error: dict[str, Any], model: type[ConfigModel]) -> str:
    field = ".".join(str(part) for part in error["loc"]) or "config"
    name = str(error["loc"][0]) if error["loc"] else ""
    info = model.model_fields.get(name)
    value = error.get("input")
    if error["type"] == "extra_forbidden":
        return f"{field}: not a {model.setting}"
    if error["type"] == "missing":
        return f"{field}: required"
    what = " ".join(filter(None, [f"{field}:", model.cli_option(name) if info is not None else None]))
    if info is not None and info.title:  # "batch_size: --batch-size: the batch size must be >= 1, got 0"
        what = f"{what}: the {info.title}"
    if error["type"] == "literal_error":
        choices = ", ".join(info.annotation.__args__) if info is not None else error["ctx"]["expected"]
        return f"{field}: unknown {name.replace('_', ' ')} {value!r}; choose one of {choices}"
    if error["type"] in ("greater_than_equal", "greater_than", "less_than_equal", "less_than") and info is not None:
        unit = (info.json_schema_extra or {}).get("unit")
        return f"{what} must be {bounds(info.metadata)}{' ' + unit if unit else ''}, got {value!r}"
    message = error["msg"]
    return f"{what} {message[:1].lower()}{message[1:]}, got {value!r}"


def bounds(metadata: list[Any]) -> str:
    """A field's range in words: ``>= 1``, ``> 0``, ``between 0 and 4``, ``in [0, 1)``."""
    bound = {type(m): m for m in metadata if isinstance(m, (Ge, Gt, Le, Lt))}
    low = f"{bound[Ge].ge}" if Ge in bound else (f"{bound[Gt].gt}" if Gt in bound else None)
    if Le in bound and Ge in bound:
        return f"between {low} and {bound[Le].le}"
    if Lt in bound and low is not None:
        return f"in {'[' if Ge in bound else '('}{low}, {bound[Lt].lt})"
    if Ge in bound:
        return f">= {bound[Ge].ge}"
    if Gt in bound:
        return f"> {bound[Gt].gt}"
    return f"<= {bound[Le].le}" if Le in bound else f"< {bound[Lt].lt}"
