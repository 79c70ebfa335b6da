"""Replace a directory atomically: readers see the old one or the new one, never neither.

`os.replace` cannot put a directory over a non-empty one, and renaming the old one away
first leaves a moment (or, after a crash, a state) with nothing at the path. Linux's
renameat2(RENAME_EXCHANGE) swaps two paths in one step; where it is missing (other OSes,
file systems without it) the two-rename fallback is used and says so in its docstring.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the OS / file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), str(b))


def replace_dir(new: Path, out: Path) -> None:
    """Move the complete directory `new` to `out`, replacing what is there.

    Where renameat2 is missing the old dir is renamed away and the new one in: a crash
    between the two leaves the old one at `.<name>.old-<pid>` beside it."""
    new, out = Path(new), Path(out)
    if not out.exists():
        os.rename(new, out)
        return
    if exchange(new, out):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old directory
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)
