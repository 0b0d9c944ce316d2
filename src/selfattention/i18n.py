"""The interface language: standard gettext over the catalogs shipped in ``selfattention/locale``.

Messages are ``str.format`` templates with named fields, marked for extraction in one of two ways:

- ``_("...")`` translates at the call (a message built when it is printed);
- ``N_("...")`` only marks the text for extraction and returns it unchanged: for texts defined at import
  time (table headers, help texts, lesson claims), translated later with ``_(text)`` where they are shown.

Catalogs: ``locale/zh/LC_MESSAGES/selfattention.po`` (the translations) and its compiled ``.mo`` (what
runs), both committed. ``make i18n`` re-extracts the messages with Babel and compiles the catalog; see
docs/i18n.md. English needs no catalog: the message ids are the English texts.

The language is chosen once per command (``selfattention --lang zh|en``, else the locale: the first set
of ``LANGUAGE``, ``LC_ALL``, ``LC_MESSAGES``, ``LANG``, as gettext reads them).

>>> language_from_env({"LANG": "zh_CN.UTF-8"})
'zh'
>>> language_from_env({"LANGUAGE": "fr:zh_TW", "LANG": "en_US.UTF-8"})
'zh'
>>> language_from_env({"LC_ALL": "C.UTF-8", "LANG": "zh_CN.UTF-8"})
'en'
>>> with use_language("zh"):
...     _("verdict")
'结论'
>>> _("verdict")
'verdict'
>>> with use_language("zh"):
...     _("")
''
"""

from __future__ import annotations

import gettext
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "DOMAIN",
    "LANGUAGES",
    "LOCALE_DIR",
    "N_",
    "_",
    "language",
    "language_from_env",
    "ngettext",
    "set_language",
    "use_language",
]

DOMAIN = "selfattention"
"""The gettext domain: the catalogs are ``LOCALE_DIR/<lang>/LC_MESSAGES/selfattention.mo``."""
LANGUAGES = ("en", "zh")
"""The interface languages: English (the message ids themselves) and Chinese."""
LOCALE_DIR = Path(__file__).parent / "locale"
_ENV_VARS = ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG")

_translation: gettext.NullTranslations = gettext.NullTranslations()
_language = "en"


def _supported(code: str) -> str | None:
    """``zh_CN.UTF-8`` → ``zh``, ``en_US`` → ``en``, ``C``/``POSIX`` → ``en``; anything else → None."""
    base = code.split(".")[0].split("@")[0].replace("-", "_").split("_")[0].lower()
    if base in ("c", "posix"):
        return "en"
    return base if base in LANGUAGES else None


def language_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The interface language the locale asks for: ``"zh"`` or ``"en"`` (the default).

    Reads the first non-empty variable of ``LANGUAGE``, ``LC_ALL``, ``LC_MESSAGES``, ``LANG`` (gettext's
    order); ``LANGUAGE`` may list several languages separated by ``:``, the first supported one wins. A
    locale asking for a language without a catalog gives English.
    """
    env = os.environ if environ is None else environ
    for var in _ENV_VARS:
        value = env.get(var, "")
        if value:
            for item in value.split(":"):
                found = _supported(item) if item else None
                if found is not None:
                    return found
            return "en"
    return "en"


def normalize_language(lang: str) -> str:
    """A language as :data:`LANGUAGES` spells it: ``ZH``, ``zh_CN``, ``zh-Hans`` → ``zh`` (a value that is
    no known language comes back as given, for the caller to refuse).

    >>> normalize_language("zh_CN"), normalize_language("EN"), normalize_language("fr")
    ('zh', 'en', 'fr')
    """
    if not isinstance(lang, str):
        return lang
    base = lang.strip().replace("-", "_").split("_")[0].lower()
    return base if base in LANGUAGES else lang


def set_language(lang: str) -> None:
    """Switch every later ``_()``/``ngettext`` to ``lang`` (one of :data:`LANGUAGES`).

    Raises:
        ValueError: ``lang`` is not one of :data:`LANGUAGES` (the message names the value and the choices).
        OSError: the compiled catalog of ``lang`` is missing from the installed package.
    """
    global _translation, _language
    lang = normalize_language(lang)
    if lang not in LANGUAGES:
        raise ValueError(
            "--lang must be one of {choices}, got {value!r}".format(choices=", ".join(LANGUAGES), value=lang)
        )
    if lang == "en":
        _translation = gettext.NullTranslations()
    else:
        try:
            _translation = gettext.translation(DOMAIN, LOCALE_DIR, languages=[lang])
        except FileNotFoundError:
            raise OSError(
                "the {lang} message catalog {path} is missing: run `make i18n` in a source checkout".format(
                    lang=lang, path=LOCALE_DIR / lang / "LC_MESSAGES" / f"{DOMAIN}.mo"
                )
            ) from None
    _language = lang


def language() -> str:
    """The current interface language (``"en"`` until :func:`set_language` is called)."""
    return _language


@contextmanager
def use_language(lang: str) -> Iterator[None]:
    """Run a block in ``lang``, then restore the language that was set before."""
    old = _language
    set_language(lang)
    try:
        yield
    finally:
        set_language(old)


def _(message: str) -> str:
    """``message`` in the current language (the message itself when it has no translation; ``""`` stays
    ``""``, where gettext would return the catalog's header)."""
    return _translation.gettext(message) if message else message


def pgettext(context: str, message: str) -> str:
    """``message`` in the current language where the same English word means something else elsewhere
    (``context`` tells them apart in the catalog: ``msgctxt``)."""
    return _translation.pgettext(context, message) if message else message


def ngettext(singular: str, plural: str, n: int) -> str:
    """The singular or plural form of a message for the count ``n``, in the current language."""
    return _translation.ngettext(singular, plural, n)


def N_(message: str) -> str:
    """Mark ``message`` for extraction without translating it (translate it later with ``_``)."""
    return message
