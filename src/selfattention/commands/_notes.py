"""Notes about a model run that ``explain`` and ``report`` both print (one place for the wording)."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path
from typing import Any

from ..i18n import N_, _

__all__ = ["os_error", "save_png", "unknown_tokens_note"]

# the operating system's own wording for the errors a file option meets, translated for --lang
_OS_ERRORS = {
    errno.EACCES: N_("Permission denied"),
    errno.EPERM: N_("Operation not permitted"),
    errno.ENOENT: N_("No such file or directory"),
    errno.ENOTDIR: N_("Not a directory"),
    errno.EISDIR: N_("Is a directory"),
    errno.EROFS: N_("Read-only file system"),
    errno.ENOSPC: N_("No space left on device"),
    errno.EEXIST: N_("File exists"),
    errno.ENAMETOOLONG: N_("File name too long"),
}


def os_error(e: OSError) -> str:
    """An OSError's reason in the interface language: the usual ones translated (the OS gives English
    whatever ``--lang`` says), any other as the OS words it.

    >>> os_error(PermissionError(errno.EACCES, "Permission denied"))
    'Permission denied'
    """
    known = _OS_ERRORS.get(e.errno)
    return _(known) if known is not None else str(e.strerror or e)


def unknown_tokens_note(run: Any, name: str) -> str | None:
    """A sentence saying how many tokens of ``run`` (a :class:`~selfattention.pretrained.ModelRun`) are
    ``[UNK]`` and which model reads that script, or None when no token is unknown.

    >>> from types import SimpleNamespace
    >>> run = SimpleNamespace(n_unknown=0, tokens=["[CLS]", "hi", "[SEP]"], text="hi")
    >>> unknown_tokens_note(run, "all-MiniLM-L6-v2") is None
    True
    """
    from ..pretrained import suggest_model

    if not run.n_unknown:
        return None
    message = _(
        "note: {n} of {total} tokens are unknown to {name} (shown as [UNK]): its vocabulary does not hold "
        "those characters, so it reads them all as one and the same token."
    ).format(n=run.n_unknown, total=len(run.tokens), name=name)
    better = suggest_model(run.text)
    if better is not None and better != name:
        hint = _("For this text use --model {model}.").format(model=better)
    else:
        hint = _("A model whose vocabulary covers this script would read them (--model PATH).")
    # TRANSLATORS: the [UNK] note, then its hint (Chinese puts no space after 。)
    return _("{note} {hint}").format(note=message, hint=hint)


def save_png(fig: Any, path: Path, dpi: int) -> None:
    """Save a figure of :mod:`selfattention.viz`; with Chinese text and no CJK font, print one yellow
    note saying how to get the font (instead of a Python warning).

    Raises:
        OSError: the file cannot be written.
    """
    from rich.markup import escape

    from ..fonts import MissingCJKFontWarning
    from . import console

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MissingCJKFontWarning)
        fig.savefig(path, dpi=dpi)
    for w in caught:
        if issubclass(w.category, MissingCJKFontWarning):
            console.print("[yellow]" + escape(_("note: {message}").format(message=w.message)) + "[/yellow]")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def png_target(option: str, out: Path) -> Path:
    """``out`` checked as the PNG file ``option`` names, before the slow model run: a ``.png`` name, not a
    folder, in a folder that exists and can be written (tried for real: permissions do not tell everything,
    e.g. for root). Raises UsageError naming the option."""
    from . import UsageError

    if out.suffix.lower() != ".png":
        raise UsageError(_("{option} must be a .png file, got {path!r}").format(option=option, path=str(out)))
    if out.is_dir():
        raise UsageError(
            _("{option} {path!r} is a directory; give a file name ending in .png").format(
                option=option, path=str(out)
            )
        )
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(
            _("{option}: the folder {path!r} does not exist").format(option=option, path=str(parent))
        )
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UsageError(
            _("{option}: cannot write {path!r} (no write permission)").format(option=option, path=str(out))
        )
    _try_writing(option, out, out)
    return out


def _try_writing(option: str, target: Path, shown: Path) -> None:
    """Open ``target`` for appending (permissions do not tell everything, e.g. for root), removing it again
    if it did not exist; UsageError naming ``option`` and ``shown`` if that fails."""
    from . import UsageError

    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as e:
        raise UsageError(
            _("{option}: cannot write {path!r}: {error}").format(
                option=option, path=str(shown), error=os_error(e)
            )
        ) from e
    if not existed:
        target.unlink()


def output_folder(option: str, folder: Path) -> Path:
    """``folder`` made (with its parents) and checked writable before the work whose results go there, so a
    bad ``option`` fails at once, not after minutes of training or benchmarking. Raises UsageError."""
    from . import UsageError

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            _("{option}: cannot write {path!r}: {error}").format(
                option=option, path=str(folder), error=os_error(e)
            )
        ) from e
    _try_writing(option, folder / ".selfattention-write-test", folder)
    return folder
