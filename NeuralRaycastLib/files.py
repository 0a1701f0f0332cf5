"""Writing results so that nothing partial is ever left: every file goes to a temporary sibling, is checked,
flushed to the disk and only then renamed into place; a folder is built beside its final place and renamed
in when complete. On any failure the previous file or folder is left as it was and the temporary is removed.

A full disk does not always show where the bytes are written: some writers report success and leave an empty
or short file (VTK's), and some file systems report it only when the file is flushed. So each file is
checked (not empty, and whatever check its writer passes) and flushed before it replaces anything.

Every byte and every rename goes through this module's ``os``, so tests inject disk-full, read-only and
interrupted writes there.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

#: A check of a written temporary file; raises OSError when the file is incomplete.
Check = Callable[[Path], None]

PARTIAL = ".partial-"
REPLACED = ".replaced-"
_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
_CHUNK = 1 << 20

_ADVICE = {
    errno.ENOSPC: "free space on that disk or write somewhere else",
    errno.EDQUOT: "free space within your disk quota or write somewhere else",
    errno.EFBIG: "the file is too large for that file system: write somewhere else",
    errno.EROFS: "that disk is read-only: write somewhere else",
    errno.EACCES: "check the folder's permissions or write somewhere else",
    errno.EPERM: "check the folder's permissions or write somewhere else",
    errno.EIO: "the disk may be full or failing: free space or write somewhere else",
}


def _reason(cause: BaseException | str) -> str:
    if isinstance(cause, OSError) and cause.strerror:
        text = cause.strerror
    else:
        text = str(cause) or type(cause).__name__
    text = " ".join(text.split())  # one line, whatever a library put in its message
    return text[:1].lower() + text[1:]


class WriteError(OSError):
    """A result that could not be written. The message is one line: the file or folder it was meant for,
    why, and what to do; ``errno`` is the cause's."""

    def __init__(self, path: str | Path, cause: BaseException | str):
        code = cause.errno if isinstance(cause, OSError) else None
        self.path = Path(path)
        self.reason = cause.reason if isinstance(cause, WriteError) else _reason(cause)
        super().__init__(code, self.reason, str(self.path))

    @property
    def advice(self) -> str:
        return _ADVICE.get(self.errno or 0, "check that the folder can be written")

    def moved(self, old: Path, new: Path) -> WriteError:
        """The same error for the file's place once ``old`` (a staging folder holding it) is renamed ``new``."""
        try:
            path = new / self.path.relative_to(old)
        except ValueError:
            return self
        return WriteError(path, self)

    def __str__(self) -> str:
        return f"{self.path}: cannot write ({self.reason}); {self.advice}"


def write_error(path: str | Path, error: OSError) -> WriteError:
    """``error`` as a WriteError naming ``path``, unless it already names a file of its own."""
    return error if isinstance(error, WriteError) else WriteError(path, error)


def _temporary_sibling(path: Path, tag: str) -> Path:
    """A hidden, unique name beside ``path`` that keeps its suffix (some writers choose a format by it)."""
    return path.with_name(f".{path.stem}{tag}{uuid.uuid4().hex[:12]}{path.suffix}")


def _make_folders(folder: Path, created: list[Path]) -> None:
    """Create ``folder`` and its missing parents, adding the ones created to ``created`` (outermost first, to
    remove again if nothing is put in them)."""
    missing = []
    for candidate in (folder, *folder.parents):
        if candidate.is_dir():
            break
        missing.append(candidate)
    for candidate in reversed(missing):
        try:
            os.mkdir(candidate)
        except FileExistsError:
            if not candidate.is_dir():
                raise
            continue
        created.append(candidate)


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; elsewhere the file system does it)."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


class _DescriptorWriter(io.RawIOBase):
    """A file descriptor written through this module's ``os`` (so a test's injected fault reaches every
    writer). It has no ``fileno``: libraries that would write to the descriptor themselves (Pillow's
    encoders) then write through it too."""

    def __init__(self, descriptor: int):
        super().__init__()
        self._descriptor = descriptor

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        return os.write(self._descriptor, data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return os.lseek(self._descriptor, offset, whence)

    def tell(self) -> int:
        return os.lseek(self._descriptor, 0, io.SEEK_CUR)

    def truncate(self, size: int | None = None) -> int:
        size = self.tell() if size is None else size
        os.ftruncate(self._descriptor, size)
        return size


def _create(path: Path) -> tuple[int, int]:
    """Create ``path`` (it must not exist) with the permissions a new file gets here (the umask's; not the
    owner-only ones of a temporary file); its descriptor and mode."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _BINARY, 0o666)
    try:
        mode = os.fstat(descriptor).st_mode & 0o777
    except OSError:
        os.close(descriptor)
        raise
    return descriptor, mode


@contextlib.contextmanager
def _removed_on_error(temporary: Path, target: Path) -> Iterator[None]:
    """Any error while ``temporary`` is written for ``target``: the temporary is removed, and a file system
    error becomes a :class:`WriteError` naming ``target``."""
    try:
        yield
    except BaseException as error:
        _remove(temporary)
        if isinstance(error, OSError):
            raise write_error(target, error) from error
        raise


class FileSet:
    """Files written all or nothing: each is written to a temporary sibling and checked as it is closed;
    :meth:`commit` puts them all in place, :meth:`discard` removes them. Use through :func:`atomic_files`."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []  # (temporary, target)
        self._created: list[Path] = []  # folders made for the files, removed again if nothing is committed

    def _prepare(self, target: Path) -> None:
        try:
            _make_folders(target.parent, self._created)
        except OSError as error:
            raise write_error(target, error) from error

    @contextlib.contextmanager
    def path(self, target: str | Path, check: Check | None = None) -> Iterator[Path]:
        """A temporary path to write ``target`` to (for writers that take a file name); when the block ends
        the file must exist, be non-empty and pass ``check``."""
        target = Path(target)
        self._prepare(target)
        temporary = _temporary_sibling(target, PARTIAL)
        with _removed_on_error(temporary, target):
            descriptor, mode = _create(temporary)  # reserves the name, gives the usual permissions
            os.close(descriptor)
            yield temporary
            os.chmod(temporary, mode)
            self._finish(temporary, target, check, synced=False)

    @contextlib.contextmanager
    def open(self, target: str | Path, check: Check | None = None) -> Iterator[BinaryIO]:
        """A binary file to write ``target`` through; checked and flushed to the disk when the block ends."""
        target = Path(target)
        self._prepare(target)
        temporary = _temporary_sibling(target, PARTIAL)
        with _removed_on_error(temporary, target):
            descriptor, _ = _create(temporary)
            raw = _DescriptorWriter(descriptor)
            try:
                with io.BufferedWriter(raw, _CHUNK) as handle:
                    yield handle  # type: ignore[misc]
                    handle.flush()
                    os.fsync(descriptor)
            finally:
                raw.close()
                with contextlib.suppress(OSError):
                    os.close(descriptor)
            self._finish(temporary, target, check, synced=True)

    def _finish(self, temporary: Path, target: Path, check: Check | None, synced: bool) -> None:
        if os.stat(temporary).st_size == 0:
            raise OSError(errno.EIO, "the writer left an empty file")
        if check is not None:
            check(temporary)
        if not synced:  # written by a library: flush it to the disk here
            descriptor = os.open(temporary, os.O_RDWR | _BINARY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        self._staged.append((temporary, target))

    def write_bytes(self, target: str | Path, data: bytes) -> Path:
        with self.open(target) as handle:
            handle.write(data)
        return Path(target)

    def write_text(self, target: str | Path, text: str) -> Path:
        return self.write_bytes(target, text.encode("utf-8"))

    def commit(self) -> list[Path]:
        """Put every staged file in place. The files they replace are moved aside first and put back if
        any rename fails, so the set is in place whole or not at all."""
        staged, self._staged = self._staged, []
        single = len(staged) == 1
        aside: list[tuple[Path, Path]] = []  # (target, its previous file moved aside)
        placed: list[Path] = []
        current = staged[0][1] if staged else Path()
        try:
            for temporary, current in staged:
                if not single and os.path.lexists(current):
                    previous = _temporary_sibling(current, REPLACED)
                    os.replace(current, previous)
                    aside.append((current, previous))
                os.replace(temporary, current)
                placed.append(current)
        except OSError as error:
            for target in placed:
                _remove(target)
            for target, previous in aside:
                with contextlib.suppress(OSError):
                    os.replace(previous, target)
            for temporary, _ in staged:
                _remove(temporary)
            _remove_empty(self._created)
            raise write_error(current, error) from error
        for _, previous in aside:
            _remove(previous)
        for folder in {target.parent for _, target in staged}:
            _sync_folder(folder)
        return [target for _, target in staged]

    def discard(self) -> None:
        staged, self._staged = self._staged, []
        for temporary, _ in staged:
            _remove(temporary)
        _remove_empty(self._created)


@contextlib.contextmanager
def atomic_files() -> Iterator[FileSet]:
    """Several files written all or nothing (see :class:`FileSet`); committed when the block ends."""
    files = FileSet()
    try:
        yield files
        files.commit()
    except BaseException:
        files.discard()
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path, check: Check | None = None) -> Iterator[Path]:
    """A temporary sibling of ``path`` for a writer that takes a file name; renamed to ``path`` when the
    block ends if the file is non-empty and passes ``check``."""
    with atomic_files() as files, files.path(path, check) as temporary:
        yield temporary


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends without an error, and nothing otherwise."""
    with atomic_files() as files, files.open(path) as handle:
        yield handle


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_files() as files:
        files.write_bytes(path, data)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def copy_file(source: str | Path, target: str | Path) -> Path:
    """Copy a file's bytes (atomically; the permissions a new file gets, not the source's)."""
    with open(source, "rb") as reader, atomic_file(target) as writer:
        shutil.copyfileobj(reader, writer, _CHUNK)
    return Path(target)


def copy_tree(source: str | Path, target: str | Path, skip: tuple[str, ...] = ()) -> Path:
    """Copy a folder's files and folders into ``target`` (created), leaving out the top-level names in
    ``skip``; the first failure stops the copy (a full disk is not worth trying every other file on)."""
    source, target = Path(source), Path(target)
    _make_folders(target, [])
    for entry in sorted(source.iterdir()):
        if entry.name in skip:
            continue
        if entry.is_dir():
            copy_tree(entry, target / entry.name)
        else:
            copy_file(entry, target / entry.name)
    return target


def is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_replaceable(path: str | Path, replaceable: Callable[[Path], bool] = is_empty_folder,
                      refusal: str = "choose a new or empty folder") -> None:
    """Refuse (FileExistsError) a ``path`` that exists and is not a folder, or is a folder that is neither
    empty nor one ``replaceable`` accepts: writing a folder there would put what it holds at risk."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder; {refusal}")
    if not (is_empty_folder(path) or replaceable(path)):
        raise FileExistsError(f"{path} exists and holds other files; {refusal}")


class StagedFolder:
    """A folder built as ``<name>.partial-<random>`` beside ``path`` and renamed to ``path`` by
    :meth:`commit`; a folder already at ``path`` is replaced only then (moved aside, the new one moved in,
    the old one removed), so a failure at any point leaves it as it was and no staging folder behind.

    Refuses at once a ``path`` that is a file, or a non-empty folder ``replaceable`` does not accept."""

    def __init__(self, path: str | Path, replaceable: Callable[[Path], bool] = is_empty_folder,
                 refusal: str = "choose a new or empty folder"):
        self.target = Path(path)
        self._replaceable, self._refusal = replaceable, refusal
        check_replaceable(self.target, replaceable, refusal)
        self.path = self.target.with_name(f"{self.target.name}{PARTIAL}{uuid.uuid4().hex[:12]}")
        self._created: list[Path] = []
        try:
            _make_folders(self.target.parent, self._created)
            os.mkdir(self.path)
        except OSError as error:
            _remove_empty(self._created)
            raise write_error(self.target, error) from error

    def error(self, error: OSError) -> WriteError:
        """``error``, raised while writing into the staging folder, named for the folder's final place."""
        if isinstance(error, WriteError):
            return error.moved(self.path, self.target)
        return WriteError(self.target, error)

    def commit(self) -> Path:
        try:
            check_replaceable(self.target, self._replaceable, self._refusal)  # still so: nothing put there since
        except FileExistsError:
            self.discard()
            raise
        previous = None
        try:
            if os.path.lexists(self.target):
                previous = self.target.with_name(f"{self.target.name}{REPLACED}{uuid.uuid4().hex[:12]}")
                os.rename(self.target, previous)
            os.rename(self.path, self.target)
        except OSError as error:
            self.discard()
            if previous is not None and not os.path.lexists(self.target):
                try:
                    os.rename(previous, self.target)
                except OSError:  # never removed: say where it is
                    raise WriteError(self.target, f"{_reason(error)}; the earlier folder is now {previous}") \
                        from error
            raise self.error(error) from error
        if previous is not None:
            _remove(previous)
        _sync_folder(self.target.parent)
        return self.target

    def discard(self) -> None:
        _remove(self.path)
        _remove_empty(self._created)


@contextlib.contextmanager
def atomic_folder(path: str | Path, replaceable: Callable[[Path], bool] = is_empty_folder,
                  refusal: str = "choose a new or empty folder") -> Iterator[Path]:
    """Write a folder whole: the block writes into the staging folder it is given, which becomes ``path``
    when the block ends (see :class:`StagedFolder`); errors name the files' final places."""
    staged = StagedFolder(path, replaceable, refusal)
    try:
        yield staged.path
    except OSError as error:
        staged.discard()
        raise staged.error(error) from error
    except BaseException:
        staged.discard()
        raise
    staged.commit()
