"""Files the user names: inputs that can be read to the end, outputs that are safe to write.

* Inputs (prompt files, traces, ``--model``) must be regular files (or a model folder): a FIFO
  blocks, a device such as /dev/zero never ends.
* Outputs (``--report``, ``--record``, ``--per-request``, ``--export``) are checked before a
  run starts (``check_outputs``): their folder exists and takes a new file, and each is not a
  directory, a special file or a symbolic link, not one of the run's inputs and not another
  output. The model is an input too (``model_inputs``): the default model's file, or every
  file in a model folder, so a report never lands on the weights. Writing (``open_output``, ``write_atomic``) never goes through a symlink or into a
  special file, and a file written over keeps its permissions.

Errors are ``PathError`` (a ValueError, so the CLI shows one line) naming the path as given.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO


class PathError(ValueError):
    """A path that cannot be used as asked; the message names it as the user gave it."""


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` is, in words."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "a regular file"


def check_model_path(path: str | os.PathLike[str] | None) -> None:
    """``--model`` is a folder or a regular file; a missing path is left to the loader."""
    if path is None:
        return
    try:
        mode = os.stat(Path(path).expanduser()).st_mode
    except OSError:
        return
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise PathError(f"--model {path}: is {kind_of(mode)}, not a model file or folder")


# A model folder holds a config, a tokenizer and some weight shards: far fewer entries than this.
MAX_FOLDER_ENTRIES = 10_000


def model_inputs(model: str | os.PathLike[str] | None) -> list[Path]:
    """What a run reads for ``--model``: the path given (a folder stands for every file in it),
    or the default model's file when none is given (nothing if it is not installed)."""
    if model is not None:
        return [Path(model).expanduser()]
    from .engine.model.loader import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, packaged_model_path
    from .engine.model.model_errors import ModelLoadError

    try:
        return [Path(packaged_model_path(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE))]
    except ModelLoadError:
        return []


def check_outputs(
    outputs: Mapping[str, str | os.PathLike[str] | None],
    inputs: Iterable[str | os.PathLike[str] | None] = (),
) -> None:
    """Check every output (flag -> path, None: not given) before the run starts.

    An input folder (a model folder) stands for every file in it: an existing file under it, or
    one of its entries reached another way (a hard link, the blob an HF-cache symlink names), is
    an input too."""
    given = {flag: Path(p) for flag, p in outputs.items() if p is not None}
    seen: dict[tuple[int, int] | str, str] = {}
    folders: list[Path] = []
    for path in (Path(p) for p in inputs if p is not None):
        if path.is_dir():
            folders.append(path.resolve())
            seen.update(_folder_identities(path))
        elif (key := _identity(path)) is not None:
            seen[key] = f"an input of this run ({path})"
    for flag, path in given.items():
        _check_output(path, flag)
        key = _identity(path) or str(path.resolve())
        if key in seen:
            raise PathError(f"cannot write {flag} {path}: that is {seen[key]}")
        _refuse_inside(path, flag, folders)
        seen[key] = f"the {flag} file too"


def open_output(path: str | os.PathLike[str], flag: str, binary: bool = False) -> IO:
    """``path`` opened for writing from the start, never through a symlink or into a special
    file (``O_NOFOLLOW``, and ``O_NONBLOCK`` so a FIFO fails instead of blocking)."""
    path = Path(path)
    mode = _lstat_mode(path)
    if mode is not None and not stat.S_ISREG(mode):
        raise PathError(f"cannot write {flag} {path}: it is {kind_of(mode)}, not a regular file")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        raise PathError(f"cannot write {flag} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the check and the open
            raise PathError(f"cannot write {flag} {path}: it is {kind_of(st.st_mode)}")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)  # only now: a special file is never truncated
        return os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: str | os.PathLike[str], data: bytes, flag: str) -> None:
    """Write ``data`` to ``path`` all at once (see ``atomic_output``)."""
    with atomic_output(path, flag) as f:
        f.write(data)


@contextmanager
def atomic_output(path: str | os.PathLike[str], flag: str) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` when the block ends without an error, so a reader
    sees the old file or the whole new one.

    It is written next to ``path`` and takes the old file's permissions (a new one gets the
    usual 0666 less the umask). A symlink or special file at ``path`` is refused, not replaced.
    """
    path = Path(path)
    mode = _lstat_mode(path)
    if mode is not None and not stat.S_ISREG(mode):
        raise PathError(f"cannot write {flag} {path}: it is {kind_of(mode)}, not a regular file")
    try:
        fd, tmp = _create_temp(path, ".tmp")
    except OSError as e:
        raise PathError(f"cannot write {flag} {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(mode))
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise PathError(f"cannot write {flag} {path}: {e.strerror or e}") from None
    except BaseException:
        os.unlink(tmp)
        raise


# -- helpers -----------------------------------------------------------------------------------


def _check_output(path: Path, flag: str) -> None:
    mode = _lstat_mode(path)
    if mode is not None and not stat.S_ISREG(mode):
        raise PathError(f"cannot write {flag} {path}: it is {kind_of(mode)}, not a regular file")
    folder = path.parent
    if not folder.is_dir():
        missing = "does not exist" if not folder.exists() else "is not a folder"
        raise PathError(f"cannot write {flag} {path}: the folder {folder} {missing}")
    try:  # a real file, not os.access: root passes access() on folders it still cannot write
        fd, probe = _create_temp(path, ".probe")
    except OSError as e:
        raise PathError(f"cannot write {flag} {path}: {folder}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def _folder_identities(folder: Path) -> dict[tuple[int, int], str]:
    """The files at the top of an input folder (where a model's files are), symlinks followed."""
    found: dict[tuple[int, int], str] = {}
    try:
        with os.scandir(folder) as entries:
            for _, entry in zip(range(MAX_FOLDER_ENTRIES), entries):
                key = _identity(Path(entry.path))
                if key is not None:
                    found[key] = f"an input of this run ({Path(entry.path)}, in {folder})"
    except OSError:
        pass  # an unreadable folder: the loader says so
    return found


def _refuse_inside(path: Path, flag: str, folders: list[Path]) -> None:
    """An existing file under an input folder may be read by the run: never write over it."""
    if not os.path.lexists(path):
        return
    where = path.resolve()
    for folder in folders:
        if where.is_relative_to(folder):
            raise PathError(
                f"cannot write {flag} {path}: that is an input of this run (a file in {folder})"
            )


def _lstat_mode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PathError(f"{path}: {e.strerror or e}") from None


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _create_temp(path: Path, suffix: str) -> tuple[int, Path]:
    """A new file next to ``path``. Unlike mkstemp's (0600), its mode is 0666 less the umask,
    as for any file the user creates."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{suffix}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")
