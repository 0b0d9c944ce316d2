"""The ``selfattention`` command: a thin typer app. Commands live in :mod:`selfattention.commands`.

Each module in ``COMMAND_MODULES`` defines ``register(app: typer.Typer) -> None``. Errors the user can
fix (bad input, missing file, malformed TOML) are raised as :class:`selfattention.commands.UsageError`
(or ValueError/TypeError/OSError) and become one red line on stderr and exit code 2, no traceback.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import typer
from rich.markup import escape

from . import i18n
from .commands import UsageError, clicktext, err_console
from .i18n import N_, _

COMMAND_MODULES = [
    "demo",
    "check",
    "explain",
    "report",
    "generate",
    "train",
    "lesson",
    "bench",
    "fuzz",
    "ring",
    "grade",
]

_APP_HELP = N_("Self-attention as the lectures describe it: replay, explain, check, measure.")
#: click's own text for --help, translated by ``_tidy_help`` like every other option's help
_HELP_OPTION_HELP = N_("Show this message and exit.")

app = typer.Typer(
    name="selfattention",
    help=_APP_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from .commands import console

        console.print(f"selfattention {package_version()}", highlight=False)
        raise typer.Exit(0)


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else ``selfattention.__version__``.

    >>> package_version().count(".") >= 2
    True
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("selfattention")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from . import __version__

        return __version__


def _lang(value: str | None) -> str | None:
    """``--lang``: checked and applied before any other option (``main`` applied it already for --help)."""
    if value is not None:
        try:
            i18n.set_language(value)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return value


@app.callback(help=_APP_HELP)
def _root(
    version: bool = typer.Option(
        False, "--version", help=N_("Print the version and exit."), callback=_version, is_eager=True
    ),
    lang: str | None = typer.Option(
        None,
        "--lang",
        metavar="zh|en",
        help=N_(
            "Language of the messages: zh (Chinese) or en (English). Default: from the locale "
            "(LANGUAGE, LC_ALL, LC_MESSAGES, LANG; e.g. LANG=zh_CN.UTF-8 gives zh)."
        ),
        callback=_lang,
        is_eager=True,
    ),
) -> None:
    pass


for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f".commands.{_name}", __package__)
    except ModuleNotFoundError as _e:  # a command still being written; tests/test_cli.py checks all load
        if _e.name != f"{__package__}.commands.{_name}":
            raise
        continue
    _module.register(app)


def _unwrap(text: str | None) -> str | None:
    """A help text in the current language, its paragraphs as single lines (typer's rich help keeps the
    source's line breaks). Help texts are marked with ``N_`` where they are written."""
    if not text:
        return text
    text = _(text)
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n"))


def _tidy_help(command: Any) -> None:
    """Help that reads well at 80 columns, in the interface language, for a command and its subcommands.

    Flags take no value, so none is shown (typer would print ``--check <bool>``, ``--help <bool>``), and
    docstring paragraphs are re-flowed instead of breaking where the source lines break. A command whose
    function has ``help_values`` has a help template: its placeholders are filled after translation.
    """
    values = getattr(getattr(command, "callback", None), "help_values", None)
    command.context_class = clicktext.translated_context_class(command.context_class)  # "Usage:"
    command.help = _unwrap(command.help)
    if command.help and values and "{" in command.help:
        command.help = command.help.format(**values)
    # the help option is made on demand and cached per command: make it now, with a bare context
    help_option = command.get_help_option(command.context_class(command))
    for param in [*command.params, *([help_option] if help_option is not None else [])]:
        if getattr(param, "help", None):
            param.help = _(param.help)
            if values and "{" in param.help:
                param.help = param.help.format(**values)
        if i18n.language() != "en" and param.help:
            _default_into_help(param)
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif param.param_type_name == "argument" and param.name:
            # upper case, as in every other usage line: typer then writes {FILES}... and [TEXT]
            param.metavar = param.name.upper()
    for sub in getattr(command, "commands", {}).values():
        _tidy_help(sub)


def _default_into_help(param: Any) -> None:
    """``[default: 3]`` and ``[required]`` as part of the help sentence (``…的 token（默认：3）``) in a
    language other than English: typer sets them apart with a space, which Chinese typography does not
    put after a full-width stop."""
    if getattr(param, "required", False):
        param.help = _("{help} [required]").format(help=param.help)
        return
    default = param.default
    if not getattr(param, "show_default", False) or default is None or isinstance(default, bool):
        return
    if callable(default):
        return
    if isinstance(default, list | tuple):
        default = _(", ").join(map(str, default))
    param.help = _("{help} [default: {value}]").format(help=param.help, value=default)
    param.show_default = False


def command() -> Any:
    """The click command behind ``app`` with the help fixes applied (what :func:`main` runs)."""
    cmd = typer.main.get_command(app)
    _tidy_help(cmd)
    return cmd


#: typer's own words in its help screens (module attributes of typer.rich_utils, read when help is drawn),
#: set to the interface language by :func:`_typer_words`; an attribute a typer version lacks is skipped
_TYPER_WORDS = {
    "ARGUMENTS_PANEL_TITLE": N_("Arguments"),
    "OPTIONS_PANEL_TITLE": N_("Options"),
    "COMMANDS_PANEL_TITLE": N_("Commands"),
    "DEFAULT_STRING": N_("[default: {}]"),
    "REQUIRED_LONG_STRING": N_("[required]"),
    "ENVVAR_STRING": N_("[env var: {}]"),
    "DEPRECATED_STRING": N_("(deprecated) "),
    "ERRORS_PANEL_TITLE": N_("Error"),
    "ABORTED_TEXT": N_("Aborted."),
    "RICH_HELP": N_("Try [blue]'{command_path} {help_option}'[/] for help."),
}


def _typer_words() -> None:
    """typer's panel titles and ``[default: …]`` in the interface language (English: typer's own text)."""
    try:
        import typer.rich_utils as rich_utils
    except ImportError:  # a typer without rich help: nothing to translate
        return
    for attr, text in _TYPER_WORDS.items():
        if isinstance(getattr(rich_utils, attr, None), str):
            setattr(rich_utils, attr, _(text))
    if i18n.language() != "en" and isinstance(getattr(rich_utils, "REQUIRED_LONG_STRING", None), str):
        rich_utils.REQUIRED_LONG_STRING = ""  # in the help sentence instead: ``…的名称（必需）``


def _language_of(argv: list[str]) -> str:
    """The language the command line asks for (``--lang X`` / ``--lang=X`` before the command), else the
    locale's; an unknown value is left to the ``--lang`` option to refuse."""
    lang = i18n.language_from_env()
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            break  # the command: options after it are the command's
        if arg == "--lang" and i + 1 < len(argv):
            lang = i18n.normalize_language(argv[i + 1])
        elif arg.startswith("--lang="):
            lang = i18n.normalize_language(arg.split("=", 1)[1])
    return lang if lang in i18n.LANGUAGES else i18n.language_from_env()


def _lang_first(argv: list[str]) -> list[str]:
    """``--lang X`` / ``--lang=X`` given after the command (``selfattention demo --lang zh``) moved before it,
    where the option lives; only for a known language and never after ``--``."""
    out, moved, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        if (
            arg == "--lang"
            and i + 1 < len(argv)
            and i18n.normalize_language(argv[i + 1]) in i18n.LANGUAGES
            and out
        ):
            moved += argv[i : i + 2]
            i += 2
            continue
        if (
            arg.startswith("--lang=")
            and i18n.normalize_language(arg.split("=", 1)[1]) in i18n.LANGUAGES
            and out
        ):
            moved.append(arg)
            i += 1
            continue
        out.append(arg)
        i += 1
    return [*moved, *out]


def _only_lang(argv: list[str]) -> bool:
    """Whether ``argv`` holds nothing but ``--lang X`` / ``--lang=X``."""
    rest = list(argv)
    while rest and (rest[0] == "--lang" and len(rest) >= 2 or rest[0].startswith("--lang=")):
        rest = rest[2:] if rest[0] == "--lang" else rest[1:]
    return not rest


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``selfattention`` script; returns the exit code.

    The interface language is set first (``--lang``, else the locale), so that help texts are built in it.
    """
    argv = _lang_first(sys.argv[1:] if argv is None else list(argv))
    try:
        i18n.set_language(_language_of(argv))
        _typer_words()
        if argv and _only_lang(argv):  # `selfattention --lang zh` alone: the help, as with no arguments
            argv = [*argv, "--help"]
        rc = command().main(args=argv, prog_name="selfattention", standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        err_console.print("[red]{aborted}[/red]".format(aborted=_("aborted")))
        return 1
    except (UsageError, ValueError, TypeError, OSError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        err_console.print(
            _("[bold red]error:[/bold red] {msg}").format(msg=escape(str(msg))),
            highlight=False,
        )
        return 2
    except Exception as e:  # click's own usage errors (bad option values, unknown options)
        # typer >= 0.2x vendors click as ``typer._click``: its exceptions are not ``click``'s, so match
        # on the ClickException interface (show() + exit_code) rather than on the class
        show, code = getattr(e, "show", None), getattr(e, "exit_code", None)
        if callable(show) and isinstance(code, int):
            if type(e).__name__ == "NoArgsIsHelpError" or not callable(getattr(e, "format_message", None)):
                show()  # the help itself
            else:
                clicktext.show_error(e)  # click's words, in the interface language
            return code
        raise
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
