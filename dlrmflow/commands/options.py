"""A command's options, built from its config model (:class:`~dlrmflow.engine.config_model.ConfigModel`).

One option per field that the model's ``cli_option`` names (a name without ``--`` is a positional
argument), with the field's type, choices, default and description: the model declares each setting
once, and ``dlrmflow COMMAND --help`` shows what the model says.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from types import UnionType
from typing import Any, Literal, get_args, get_origin


def sizes(text: str) -> list[int]:
    """Layer sizes written ``512-256-64-16``."""
    try:
        values = [int(x) for x in text.split("-")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer sizes like 512-256-64-16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"layer sizes must be positive, got {text!r}")
    return values


def shown(value: Any) -> str:
    """A default as the help text shows it (layer sizes as ``512-256-1``)."""
    return "-".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def add_config_options(parser: argparse.ArgumentParser, model: Any, metavars: Mapping[str, str] | None = None,
                       *, fields: Iterable[str] | None = None) -> None:
    """Add an option (or positional) for every field of ``model`` that ``model.cli_option`` names, or for
    those of ``fields`` only. ``metavars``: the metavar of fields whose value is not a plain word.

    A ``Literal`` field offers its choices; a ``bool`` one is a flag; a list of words is a positional
    taking one or more (``INPUT...``) or a repeatable option; a tuple of ints reads ``512-256-64``."""
    metavars = metavars or {}
    wanted = None if fields is None else set(fields)
    for name, info in model.model_fields.items():
        option = model.cli_option(name)
        if option is None or (wanted is not None and name not in wanted):
            continue
        annotation = info.annotation
        optional = get_origin(annotation) is UnionType  # X | None
        scalar = next(t for t in get_args(annotation) if t is not type(None)) if optional else annotation
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        kwargs: dict[str, Any] = {"help": info.description, "metavar": metavars.get(name)}
        if get_origin(scalar) is Literal:
            kwargs.update(choices=get_args(scalar), metavar=None)
        elif scalar is bool:
            del kwargs["metavar"]
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif get_origin(scalar) in (tuple, list) and get_args(scalar)[0] is int:
            kwargs.update(type=sizes)
        elif get_origin(scalar) in (tuple, list) and option.startswith("--"):  # words: a repeatable option
            kwargs["action"] = "append"
        elif get_origin(scalar) in (tuple, list):  # words: INPUT...
            kwargs["nargs"] = "+"
        else:
            kwargs.update(type=scalar)
        if not option.startswith("--"):  # a positional: its name in the usage line is the option's
            kwargs["metavar"] = kwargs["metavar"] or option
            parser.add_argument(name, **kwargs)
            continue
        kwargs["dest"] = name
        if info.is_required():
            kwargs["required"] = True
        else:
            kwargs["default"] = [] if kwargs.get("action") == "append" else default
            if default is not None and default is not False and default not in ((), []):
                kwargs["help"] += f" (default {shown(default)})"
        parser.add_argument(option, **kwargs)


def config_values(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """The values of ``model``'s fields that the options hold."""
    return {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}


def config_from_args(args: argparse.Namespace, model: Any) -> Any:
    """The ``model`` the options say (its error names a bad field)."""
    return model(**config_values(args, model))


def checked_config(args: argparse.Namespace, model: Any) -> Any:
    """The ``model`` the options say, made once (``args.config``): a command's ``check`` makes it before any
    heavy import, its ``run`` uses it."""
    if not isinstance(getattr(args, "config", None), model):
        args.config = config_from_args(args, model)
    return args.config
