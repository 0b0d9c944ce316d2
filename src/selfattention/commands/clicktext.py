"""click's own words (usage lines, usage errors) in the interface language.

The click that typer uses writes its messages as plain English f-strings (typer ≥ 0.2x vendors click as
``typer._click`` and dropped click's gettext calls; a plain click calls gettext on the default domain,
which no catalog of ours can serve). So they are translated here, through our own catalog:

- the ``Usage:`` prefix, by a help formatter whose ``write_usage`` asks the catalog
  (:func:`translated_context_class`, set on every command by ``cli._tidy_help``);
- the usage errors, by matching click's English message against the templates it is built from
  (:data:`MESSAGES`, each with its translation in the catalog) and filling the translation with what
  the message held (:func:`translate`); the reasons typer gives for a bad value (``Input should be a
  valid integer``, ``greater than or equal to 1`` ...) the same way (:data:`REASONS`);
- the frame around them (``Try '... --help' for help.``, ``Error:``) by :func:`show_error`.

A message no template matches is shown as click wrote it (English), inside the translated frame.

>>> from selfattention.i18n import use_language
>>> with use_language("zh"):
...     translate("No such option: --decimal (Possible options: --decimals)")
'没有这个选项：--decimal（可能是：--decimals）'
>>> with use_language("zh"):
...     translate("Invalid value for '--top': Input should be a valid integer, unable to parse string as an integer")
"'--top' 的值无效：应为整数"
>>> translate("Missing argument 'NAME'.")
"Missing argument 'NAME'."
"""

from __future__ import annotations

import re
import sys
from typing import Any

from ..i18n import N_, _

__all__ = ["MESSAGES", "REASONS", "show_error", "translate", "translated_context_class"]

USAGE_PREFIX = N_("Usage: ")
TRY_HELP = N_("Try '{command} {option}' for help.")
ERROR_PREFIX = N_("Error: {message}")

#: click's usage errors: (pattern of the English message, the catalog's template); fields named alike.
#: ``reason`` fields are translated again with :data:`REASONS`.
MESSAGES: list[tuple[str, str]] = [
    (
        r"No such option: (?P<option>\S+) \(Possible options: (?P<choices>.+)\)",
        N_("No such option: {option} (Possible options: {choices})"),
    ),
    (
        r"No such option: (?P<option>\S+) Did you mean (?P<choices>.+)\?",
        N_("No such option: {option} (Possible options: {choices})"),
    ),
    (r"No such option: (?P<option>\S+)", N_("No such option: {option}")),
    (
        r"No such command (?P<name>'.*')\. Did you mean (?P<choices>.+)\?",
        N_("No such command {name}. Did you mean {choices}?"),
    ),
    (r"No such command (?P<name>'.*')\.", N_("No such command {name}.")),
    (r"Missing command\.", N_("Missing command.")),
    (r"Missing argument (?P<name>.+?)\.", N_("Missing argument {name}.")),
    (r"Missing option (?P<name>.+?)\.", N_("Missing option {name}.")),
    (r"Missing parameter:? (?P<name>.+?)\.?", N_("Missing parameter {name}.")),
    (r"Invalid value for (?P<name>.+?): (?P<reason>.+)", N_("Invalid value for {name}: {reason}")),
    (r"Invalid value: (?P<reason>.+)", N_("Invalid value: {reason}")),
    (r"Option (?P<option>'.+?') requires an argument\.", N_("Option {option} requires an argument.")),
    (
        r"Option (?P<option>'.+?') requires (?P<count>\d+) arguments\.",
        N_("Option {option} requires {count} arguments."),
    ),
    (r"Option (?P<option>'.+?') does not take a value\.", N_("Option {option} does not take a value.")),
    (
        r"Got unexpected extra argument(?:s|\(s\))? \((?P<values>.*)\)",
        N_("Got unexpected extra argument(s) ({values})"),
    ),
    (r"Argument (?P<name>'.+?') takes (?P<count>\d+) values\.", N_("Argument {name} takes {count} values.")),
]

#: why a value is refused, as typer (pydantic) or click words it
REASONS: list[tuple[str, str]] = [
    (r"Input should be a valid integer(, .*)?", N_("Input should be a valid integer")),
    (r"Input should be a valid number(, .*)?", N_("Input should be a valid number")),
    (r"Input should be a valid boolean(, .*)?", N_("Input should be a valid boolean")),
    (
        r"Input should be greater than or equal to (?P<bound>\S+)",
        N_("Input should be greater than or equal to {bound}"),
    ),
    (
        r"Input should be less than or equal to (?P<bound>\S+)",
        N_("Input should be less than or equal to {bound}"),
    ),
    (r"Input should be greater than (?P<bound>\S+)", N_("Input should be greater than {bound}")),
    (r"Input should be less than (?P<bound>\S+)", N_("Input should be less than {bound}")),
    (r"Input should be (?P<choices>'.*')", N_("Input should be {choices}")),
    (r"(?P<value>.+) is not a valid (integer|int)\.", N_("{value} is not a valid integer.")),
    (r"(?P<value>.+) is not a valid (float|number)\.", N_("{value} is not a valid number.")),
    (r"Value (?P<value>.+) is not a valid (?P<type>\w+)\.", N_("Value {value} is not a valid {type}.")),
    (r"(?P<value>.+) is not in the range (?P<range>.+)\.", N_("{value} is not in the range {range}.")),
    (r"(?P<value>.+) is not one of (?P<choices>.+)\.", N_("{value} is not one of {choices}.")),
    (r"(File|Directory|Path) (?P<path>.+) does not exist\.", N_("{path} does not exist.")),
    (r"(File|Directory|Path) (?P<path>.+) is a file\.", N_("{path} is a file.")),
    (r"(File|Directory|Path) (?P<path>.+) is a directory\.", N_("{path} is a directory.")),
]

_COMPILED = [(re.compile(p + r"\Z", re.S), t) for p, t in MESSAGES]
_COMPILED_REASONS = [(re.compile(p + r"\Z", re.S), t) for p, t in REASONS]


def _match(message: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        m = pattern.match(message)
        if m:
            fields = {k: v for k, v in m.groupdict().items() if v is not None}
            if "reason" in fields:
                fields["reason"] = _match(fields["reason"], _COMPILED_REASONS) or fields["reason"]
            return _(template).format(**fields)
    return None


def translate(message: str) -> str:
    """click's English ``message`` in the interface language (unchanged when no template matches)."""
    return _match(message, _COMPILED) or _match(message, _COMPILED_REASONS) or message


def translated_context_class(context_class: type) -> type:
    """A subclass of a click ``Context`` class whose help formatter writes the usage prefix from the
    catalog (``Usage:`` → ``用法：``); made once per class."""
    cached = _CONTEXTS.get(context_class)
    if cached is not None:
        return cached
    base = context_class.formatter_class

    class Formatter(base):  # type: ignore[misc, valid-type]
        def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
            super().write_usage(prog, args, _(USAGE_PREFIX) if prefix is None else prefix)

    made = type(context_class.__name__, (context_class,), {"formatter_class": Formatter})
    _CONTEXTS[context_class] = made
    return made


_CONTEXTS: dict[type, type] = {}


def show_error(error: Any, file: Any = None) -> None:
    """Print one of click's usage errors as click does (usage line, how to get help, the message), in
    the interface language."""
    out = sys.stderr if file is None else file
    ctx = getattr(error, "ctx", None)
    if ctx is not None:
        print(ctx.get_usage(), file=out)
        if ctx.command.get_help_option(ctx) is not None:
            hint = _(TRY_HELP).format(command=ctx.command_path, option=ctx.help_option_names[0])
            print(hint, file=out)
        print(file=out)
    print(_(ERROR_PREFIX).format(message=translate(error.format_message())), file=out)
