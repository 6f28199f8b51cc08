"""Writing outputs without losing data: what `--overwrite` may replace, and folders that appear whole or not at all.

- `--overwrite` replaces only what hf_elmo writes: an ELMo model folder (`config.json` with `model_type` "elmo"),
  a bilm-tf export (`options.json` + `weights.hdf5`, optionally `vocab.txt`, nothing else), an empty folder, or an
  `hf-elmo embed` HDF5 file. Never one of the command's inputs, a folder holding one, or the current folder.
- A folder is written into a hidden `.NAME.tmp-PID-*` beside it and renamed into place at the end. Replacing a
  previous folder takes two renames (old aside to `.NAME.old-PID-*/previous`, new in); SIGINT and SIGTERM are held
  back during them, and a run killed in between (SIGKILL) is repaired by the next run to the same output, which
  puts the previous folder back. Leftovers of killed runs (their process is gone) are removed by later runs.
- A single file is written as a hidden `.NAME.<pid>.partial` beside it (`atomic_output_file`), flushed to disk and
  renamed into place when complete; on failure it is removed, and one left by a killed run is removed by the next.
- Several files added to a folder that holds other things (pretraining's final model beside its checkpoints) are
  written into a hidden `.files-PID-*` folder inside it and moved in one rename each (`atomic_files_into`).
- The one exception: a pretraining checkpoint folder is written by every process of the run (each its own random
  state), so its staging folder has a fixed name all processes know, `checkpoint-STEP.partial`, renamed into place
  by the main process once all have written (`hf_elmo.pretraining`).
"""

import contextlib
import errno
import glob
import json
import logging
import os
import re
import shutil
import signal
import tempfile

from .atomic_file import create_partial, discard_partial, finish_partial

logger = logging.getLogger(__name__)

BILM_TF_EXPORT_FILES = {"options.json", "weights.hdf5", "vocab.txt"}
# The signals that ask a command to stop (Ctrl-C, kill): held while an output is moved into place.
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_stop_requested = None  # the stop signal received, if any


def request_stop(signum: int) -> None:
    """Remember that a stop signal came (hf_elmo.cli's SIGTERM handler calls it before raising KeyboardInterrupt)."""
    global _stop_requested
    _stop_requested = signum


def raise_if_stop_requested() -> None:
    """
    Raise KeyboardInterrupt if a stop signal came. Long loops call this between steps: the KeyboardInterrupt the
    handler raised can be lost when it lands inside a C extension that checks for signals and clears the error.
    """
    if _stop_requested is not None:
        raise KeyboardInterrupt(f"signal {_stop_requested}")


class OutputError(OSError):
    """An output that cannot be written, or may not be replaced, as asked."""


def os_error_line(error: OSError) -> str:
    """One line for an OSError from writing output (no errno prefix, the path named once)."""
    if isinstance(error, OutputError) or not error.strerror:
        return " ".join(str(error).split())
    where = error.filename if error.filename is not None else "output"
    return f"cannot write {where}: {error.strerror}."


# How libraries report a write that found the disk full, the quota spent or a file-size limit reached: an OSError
# with one of these errno values, or text (safetensors' Rust IoError, torch's zip writer's short write).
_NO_ROOM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_ROOM_TEXT = re.compile(r"No space left|File too large|Disk quota|os error 2[78]\b|code: 2[78]\b|unexpected pos")


class NoRoom(OSError):
    """Raised before a write that `room_for` says cannot fit; `needed` bytes."""

    def __init__(self, needed: int):
        super().__init__(errno.ENOSPC, f"about {needed / 1e6:.1f} MB needed")
        self.needed = needed


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # Windows: no per-process file-size limit
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def room_for(path: str, written: int = 0) -> int:
    """Bytes that can still go into the file `path`: its disk's free space, and the file-size limit less `written`."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    limit = _file_size_limit()
    return free if limit is None else min(free, limit - written)


def check_room(path: str, needed: int) -> None:
    """Raise `NoRoom` unless `needed` bytes fit into the new file `path`: for writers (HDF5) that crash instead of
    raising when the disk fills."""
    if needed > room_for(path):
        raise NoRoom(needed)


def no_room_error(error: BaseException, output: str, left: str = "nothing half-written was left") -> "OutputError | None":
    """
    One line for a write to `output` that failed for lack of room (the disk full, a quota, a file-size limit), with
    the space left on its disk, the file-size limit in force and what is `left` of the write; None when `error` is
    another failure.
    """
    reported = getattr(error, "errno", None) in _NO_ROOM_ERRNOS or _NO_ROOM_TEXT.search(str(error))
    if not reported:
        return None
    folder = output if os.path.isdir(output) else os.path.dirname(os.path.abspath(output))
    try:
        room = f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free on its disk"
    except OSError:
        room = "free space unknown"
    limit = _file_size_limit()
    if limit is not None:
        room += f", file-size limit {limit:,} bytes (ulimit -f)"
    if isinstance(error, NoRoom):
        room = f"about {error.needed / 2**20:,.1f} MiB needed, {room}"
    return OutputError(
        f"cannot write {output}: the disk is full or a file-size limit was reached ({room}); {left}. Free some "
        "space, or write elsewhere."
    )


@contextlib.contextmanager
def no_room_reported(output: str, left: str = "nothing half-written was left", clean_up=None):
    """
    A write inside the block that finds no room (see `no_room_error`) raises the one-line `OutputError` instead,
    after `clean_up()` when given.
    """
    try:
        yield
    except Exception as error:
        no_room = no_room_error(error, output, left)
        if no_room is None:
            raise
        if clean_up is not None:
            clean_up()
        raise no_room from None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sibling_lock_file(output: str) -> str:
    """`.NAME.lock` beside `output`: the lock of a folder that a run may replace whole, or upload, stays out of it."""
    parent, name = os.path.split(os.path.abspath(output))
    return os.path.join(parent, f".{name}.lock")


class OutputInUse(FileExistsError):
    """Another run holds the output's lock."""


def check_folder_or_absent(folder: str, option: str) -> None:
    """One line for an output folder that is a file (`os.makedirs` would say only "File exists")."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise OutputError(f"{folder}: exists and is not a folder; remove it or choose another {option}.")


# The handles of the locks this process holds. A forked child (a DataLoader worker) closes its copies at once: an
# flock belongs to the open file, which a fork shares, so a child that kept it would hold the lock after its parent
# was killed, and a run started again at once was refused, naming a process that no longer existed.
_HELD_LOCKS = set()


def _close_inherited_locks() -> None:
    for handle in _HELD_LOCKS:
        handle.close()  # this process's descriptor only: the parent's still holds the lock
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


class OutputLock:
    """
    The exclusive lock (`fcntl.flock`) a run holds on its output for its lifetime, so that two runs never write one
    output: `lock_file` is created (with its folder) and holds the holder's process id; a second run gets
    `OutputInUse`, one line naming `command` and `option`, and touches nothing. `existed` says whether an earlier
    run left the file (a killed one). `release()` (or the process's end: processes it forked do not keep it) frees
    it. Where the platform has no fcntl, nothing is locked.
    """

    def __init__(self, output: str, lock_file: str, command: str, option: str):
        self.handle = None
        self.existed = os.path.exists(lock_file)
        try:
            import fcntl
        except ImportError:
            return
        folder = os.path.dirname(lock_file) or "."
        check_folder_or_absent(folder, option)
        os.makedirs(folder, exist_ok=True)
        handle = open(lock_file, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "its process id unknown"
            handle.close()
            raise OutputInUse(
                f"{output} is being written by another {command} run ({holder}); nothing was touched. Wait for that "
                f"run to end, or choose another {option}."
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        self.handle = handle
        _HELD_LOCKS.add(handle)

    def release(self, keep_file: bool = False) -> None:
        """Free the lock and remove its file: a finished output holds no file of the run's bookkeeping. (A run that
        tries the lock meanwhile never waits on the old file: it is refused at once.) `keep_file` leaves the file,
        the mark of an earlier run, for a run refused before it took that run's output over."""
        if self.handle is not None:
            try:
                if not keep_file:
                    os.remove(self.handle.name)
            except FileNotFoundError:  # the folder of a run that failed early was removed with it
                pass
            _HELD_LOCKS.discard(self.handle)
            self.handle.close()
            self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


@contextlib.contextmanager
def cache_fill_lock(cache: str | os.PathLike):
    """
    Held while this process fills an entry of the cache folder `cache` (a download, an unpacked wheel, a converted
    model): another process filling the same cache waits here until this one is done (`fill_cache_once`). Without
    it, two test workers or two scripts started at once could each begin the same entry, and one remove or refuse
    what the other was writing. Unlike `OutputLock`, a second process waits instead of being refused. Where the
    platform has no fcntl, nothing waits.
    """
    os.makedirs(cache, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(os.path.join(cache, ".filling.lock"), "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def fill_cache_once(cache: str | os.PathLike, is_filled, fill) -> None:
    """`fill()` an entry of the cache folder `cache` unless `is_filled()`, one process at a time
    (`cache_fill_lock`): a process that waited for another's fill checks again, finds it done and does nothing."""
    if is_filled():
        return
    with cache_fill_lock(cache):
        if not is_filled():
            fill()


def is_within(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or inside it (both resolved through symlinks)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_not_an_input(output: str, inputs) -> None:
    """Refuse an output that is, or contains, one of `inputs` or the current folder."""
    for source in [p for p in inputs if p]:
        if is_within(source, output):
            raise OutputError(
                f"{output}: is {'the input' if is_within(output, source) else 'a folder holding the input'} {source}; "
                "writing there would destroy it. Choose another output."
            )
    if is_within(os.getcwd(), output):
        raise OutputError(f"{output}: is the current folder (or holds it); choose another output.")


def _is_our_model_folder(folder: str, names: list[str]) -> bool:
    checkpoints = sorted(name for name in names if re.fullmatch(r"checkpoint-\d+", name))
    if "config.json" not in names and checkpoints:  # a fine-tuning run stopped before its final save
        checkpoint = os.path.join(folder, checkpoints[0])
        return os.path.isdir(checkpoint) and _is_our_model_folder(checkpoint, os.listdir(checkpoint))
    if "config.json" in names:
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                return json.load(f).get("model_type") == "elmo"
        except (OSError, ValueError, AttributeError):
            return False
    return {"options.json", "weights.hdf5"} <= set(names) <= BILM_TF_EXPORT_FILES


def check_replaceable_dir(output_dir: str, overwrite: bool, inputs=(), flag: str = "--overwrite") -> None:
    """
    Raise unless `output_dir` may be (over)written: absent, empty, or with `overwrite` a folder hf_elmo wrote.
    `flag` is how the user asks for `overwrite`, for the messages.
    """
    check_not_an_input(output_dir, inputs)
    if not os.path.lexists(output_dir):
        return
    if not os.path.isdir(output_dir) or os.path.islink(output_dir):
        raise OutputError(f"{output_dir}: exists and is not a folder; remove it or choose another output.")
    names = os.listdir(output_dir)
    if not names:
        return
    if not overwrite:
        raise FileExistsError(f"{output_dir} already exists and is not empty; pass overwrite=True ({flag}).")
    if not _is_our_model_folder(output_dir, names):
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise OutputError(
            f"{output_dir}: {flag} only replaces a folder hf_elmo wrote (an ELMo model folder or a bilm-tf "
            f"export), and this one holds other files ({shown}). Remove it yourself or choose another output."
        )


def _left_by_dead_runs(folder: str, prefix: str, tail: str = "-") -> list[str]:
    """
    Entries of `folder` named `PREFIX<pid>` then what the regex `tail` matches, written by other runs whose process
    is gone (killed midway).
    """
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+){tail}")
    found = []
    for path in glob.glob(os.path.join(glob.escape(folder), f"{glob.escape(prefix)}*")):
        match = pattern.match(os.path.basename(path))
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            found.append(path)
    return sorted(found)


def _stale(parent: str, name: str, kind: str) -> list[str]:
    """Hidden `.NAME.KIND-PID-*` entries of runs whose process is gone."""
    return _left_by_dead_runs(parent, f".{name}.{kind}-")


def recover_interrupted(output_dir: str) -> None:
    """Undo what killed runs left beside `output_dir`: put back a hidden previous folder, remove staging folders."""
    parent, name = os.path.split(output_dir)
    for old in _stale(parent, name, "old"):
        previous = os.path.join(old, "previous")
        if os.path.isdir(previous) and not os.path.lexists(output_dir):
            os.replace(previous, output_dir)
            logger.warning("Restored %s, which an interrupted run had moved aside to %s", output_dir, previous)
        shutil.rmtree(old, ignore_errors=True)
    for staging in _stale(parent, name, "tmp"):
        logger.info("Removing %s, left by an interrupted run", staging)
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _signals_held():
    """SIGINT/SIGTERM wait until the block is done (delivered right after), so that it is never cut in two."""
    if not hasattr(signal, "pthread_sigmask"):  # not on Windows: the next run's recovery has to do
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _normal_permissions(folder: str) -> None:
    """What a plain mkdir/open would give under the umask: mkdtemp makes 0700, safetensors writes 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


@contextlib.contextmanager
def atomic_output_dir(output_dir: str, overwrite: bool = False, inputs=(), flag: str = "--overwrite"):
    """
    Yields a hidden temporary folder beside `output_dir`, moved into place only when the block succeeds: an error
    or an interrupt never leaves a half-written `output_dir`, and `overwrite` replaces only a folder that
    `check_replaceable_dir` accepts (never one of `inputs`).
    """
    output_dir = os.path.abspath(output_dir)
    parent, name = os.path.split(output_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        recover_interrupted(output_dir)
    except OSError as error:
        # makedirs says "File exists" when a parent is a file: name the real problem.
        reason = "Not a directory" if os.path.isfile(parent) or isinstance(error, NotADirectoryError) else error.strerror
        raise OutputError(f"cannot write {output_dir}: {reason or error}.") from None
    check_replaceable_dir(output_dir, overwrite, inputs, flag)
    try:
        staging = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-{os.getpid()}-")
    except OSError as error:
        raise OutputError(f"cannot write {output_dir}: {error.strerror or error}.") from None
    old = None
    try:
        with no_room_reported(output_dir):
            yield staging
            _normal_permissions(staging)
            with _signals_held():
                if os.path.lexists(output_dir) and (overwrite or not os.listdir(output_dir)):
                    old = tempfile.mkdtemp(dir=parent, prefix=f".{name}.old-{os.getpid()}-")
                    os.replace(output_dir, os.path.join(old, "previous"))
                    os.replace(staging, output_dir)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    _rename_without_replacing(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and os.path.isdir(os.path.join(old, "previous")) and not os.path.lexists(output_dir):
            os.replace(os.path.join(old, "previous"), output_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise


def _appeared_meanwhile(output: str) -> FileExistsError:
    return FileExistsError(
        f"{output} was written by another run while this one worked; it is kept and this run's output is discarded "
        "(pass --overwrite to replace it)."
    )


def _rename_without_replacing(staging: str, output_dir: str) -> None:
    """
    Move the finished folder `staging` to `output_dir`, which was absent at the start: if another run has put a
    folder there meanwhile, it is kept (the existence check at the start is not enough when two runs write to the
    same new output). A rename onto a folder that holds anything fails.
    """
    try:
        os.rename(staging, output_dir)
    except OSError as error:
        if os.path.lexists(output_dir):
            raise _appeared_meanwhile(output_dir) from None
        raise error


def _link_without_replacing(partial: str, output_path: str) -> None:
    """Put the finished file `partial` at `output_path` only if nothing is there (a hard link fails if a file is)."""
    try:
        os.link(partial, output_path)
    except FileExistsError:
        raise _appeared_meanwhile(output_path) from None
    except OSError:  # a file system without hard links: the narrow window between check and rename remains
        if os.path.lexists(output_path):
            raise _appeared_meanwhile(output_path) from None
        os.rename(partial, output_path)
        return
    os.remove(partial)


def check_replaceable_file(output_path: str, overwrite: bool, inputs=()) -> None:
    """Raise unless `output_path` is absent, or with `overwrite` an `hf-elmo embed` HDF5 file that is not an input."""
    for source in [p for p in inputs if p]:
        if os.path.lexists(output_path) and os.path.exists(source) and os.path.samefile(source, output_path):
            raise OutputError(f"{output_path}: is the input {source}; writing there would destroy it.")
    if os.path.isdir(output_path):
        raise FileExistsError(f"{output_path} is a directory; give a file name for the HDF5 output.")
    if not os.path.lexists(output_path):
        return
    if not overwrite:
        raise FileExistsError(f"{output_path} already exists; pass overwrite=True (--overwrite) to replace it.")
    if not _is_our_hdf5(output_path):
        raise OutputError(
            f"{output_path}: --overwrite only replaces an HDF5 file written by hf-elmo embed, and this is not one. "
            "Remove it yourself or choose another output."
        )


# The root attribute of the files `hf-elmo allennlp-elmo` writes in AllenNLP's layout (which has none of its own).
ALLENNLP_LAYOUT_MARK = "hf-elmo allennlp-elmo"


def _is_our_hdf5(path: str) -> bool:
    import h5py

    try:
        if not h5py.is_hdf5(path):
            return False
        with h5py.File(path, "r") as f:
            return ("format_version" in f.attrs and "layers" in f.attrs and "num_lines" in f.attrs
                    or f.attrs.get("written_by") == ALLENNLP_LAYOUT_MARK)
    except OSError:
        return False


def remove_stale_partials(output_path: str) -> None:
    """Partial files of earlier runs to the same output whose process is gone (killed before it could clean up)."""
    folder, name = os.path.split(output_path)
    for path in _left_by_dead_runs(folder, f".{name}.", r"\.partial$"):
        logger.info("Removing %s, left by an interrupted run", path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def atomic_output_file(output_path, replace: bool = True):
    """
    Yields the path of a hidden, empty `.NAME.<pid>.partial` file beside `output_path` to write; when the block
    succeeds it is flushed to disk and renamed over `output_path`, otherwise removed. Readers see the old file or
    the complete new one, never half a file. A folder that cannot be written fails here, before any work, with an
    `OutputError` naming `output_path`. Replacing an existing file is the caller's decision (see
    `check_replaceable_file`); with `replace=False` a file that another run put at `output_path` meanwhile is kept
    and this one raises `FileExistsError`.
    """
    output_path = os.path.abspath(os.fspath(output_path))
    try:
        os.makedirs(os.path.dirname(output_path), exist_ok=True)
        remove_stale_partials(output_path)
        partial = create_partial(output_path)
    except OSError as error:
        raise OutputError(f"cannot write {output_path}: {error.strerror or error}.") from None
    try:
        with no_room_reported(output_path):
            yield partial
            finish_partial(partial, output_path, os.replace if replace else _link_without_replacing)
    except BaseException:
        discard_partial(partial)
        raise


def write_text_atomic(output_path, text: str) -> None:
    """Write `text` (UTF-8) to `output_path` through `atomic_output_file`."""
    with atomic_output_file(output_path) as partial, open(partial, "w", encoding="utf-8") as f:
        f.write(text)


def write_json_atomic(output_path, data, indent: int = 2, ensure_ascii: bool = True, newline: bool = False) -> None:
    """Write `data` as JSON to `output_path` through `atomic_output_file`."""
    write_text_atomic(output_path, json.dumps(data, indent=indent, ensure_ascii=ensure_ascii) + ("\n" if newline else ""))


FILE_STAGING_PREFIX = ".files-"


@contextlib.contextmanager
def atomic_files_into(output_dir, last=()):
    """
    Yields a hidden `.files-PID-*` folder inside `output_dir` to write files into. When the block succeeds, each file
    is moved into `output_dir` by one rename (a reader never sees half a file), those whose names end with an entry
    of `last` at the end, in that order (e.g. the weights after the config, a results file after the weights);
    otherwise the folder is removed. One left by a killed run is removed by `remove_stale_file_staging`.
    """
    output_dir = os.path.abspath(os.fspath(output_dir))
    remove_stale_file_staging(output_dir)
    try:
        staging = tempfile.mkdtemp(dir=output_dir, prefix=f"{FILE_STAGING_PREFIX}{os.getpid()}-")
    except OSError as error:
        raise OutputError(f"cannot write {output_dir}: {error.strerror or error}.") from None
    try:
        with no_room_reported(output_dir):
            yield staging
            _normal_permissions(staging)
            rank = lambda name: next((i + 1 for i, end in enumerate(last) if name.endswith(end)), 0)  # noqa: E731
            for name in sorted(os.listdir(staging), key=lambda name: (rank(name), name)):
                os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
            os.rmdir(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_stale_file_staging(output_dir) -> None:
    """The `atomic_files_into` folders in `output_dir` of runs whose process is gone (killed while writing)."""
    for path in _left_by_dead_runs(os.fspath(output_dir), FILE_STAGING_PREFIX):
        logger.info("Removing %s, left by an interrupted run", path)
        shutil.rmtree(path, ignore_errors=True)
