"""Which cached files mindiesd may load: the check made before a file that runs code when loaded is read (a
pickled graph-cache entry or artifact, ``compilation/storage/cache.py``; a built C++ kernel module,
``ops/kernels/cpp_build.py``).

A file is read only when it and every folder from the cache folder down to it are owned by this user or root
(another owner only where trusted on purpose) and writable by nobody else (the owner's private group excepted), the
rule ssh applies to ``authorized_keys``. No symbolic link below the cache folder is followed. Each folder and the
file are opened relative to their checked parent with ``O_NOFOLLOW`` and checked on what was opened (``fstat``),
so nothing can be swapped in between the check and the read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["TRUST_ENV_VAR", "UntrustedPath", "trust_foreign_owner_from_env", "untrusted_reason"]

#: Environment variable: ``1`` (or ``true``) reads cache files owned by another user (``cache_trust_foreign_owner``).
TRUST_ENV_VAR = "MINDIESD_CACHE_TRUST_FOREIGN_OWNER"


def trust_foreign_owner_from_env() -> bool:
    """Whether ``$MINDIESD_CACHE_TRUST_FOREIGN_OWNER`` asks to read a cache owned by another user."""
    return os.environ.get(TRUST_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class UntrustedPath(Exception):
    """A file or folder of a cache folder that mindiesd does not read: :attr:`path` is the part at fault."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


def untrusted_reason(path: Any, root: Any, trust_foreign_owner: bool = False) -> Optional[str]:
    """Why the file or folder ``path`` of the cache folder ``root`` is not to be read (the part at fault and the
    rule it breaks), or None when it may be: the check every read of the cache makes (:class:`CacheFolder`)."""
    root = Path(root).expanduser()
    parts = Path(path).expanduser().relative_to(root).parts
    opener = open_folder if Path(path).is_dir() else open_file
    try:
        fd = opener(root, parts, trust_foreign_owner)
    except UntrustedPath as exc:
        return str(exc)
    os.close(fd)
    return None


def ownership_fault(st: os.stat_result, trust_foreign_owner: bool) -> Optional[str]:
    """What makes a file or folder with this status untrusted, as ssh judges authorized_keys: an owner other than
    this user or root (unless trusted), or write access for group or others (a user's private group excepted)."""
    uid = os.getuid()
    if st.st_uid not in (uid, 0) and not trust_foreign_owner:
        return (f"is owned by uid {st.st_uid}, neither this user (uid {uid}) nor root "
                "(cache_trust_foreign_owner reads a cache shared on purpose)")
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable & stat.S_IWGRP and private_group(st.st_uid, st.st_gid):
        writable &= ~stat.S_IWGRP
    if writable:
        who = "others" if writable == stat.S_IWOTH else "its group" if writable == stat.S_IWGRP else "group and others"
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}; chmod go-w makes it the owner's alone)"
    return None


@functools.lru_cache(maxsize=None)
def private_group(uid: int, gid: int) -> bool:
    """Whether ``gid`` is the user private group of ``uid`` (named after the user, no other member), as a umask of
    002 makes group-writable folders on many systems; Debian's sshd accepts those too."""
    try:
        import grp
        import pwd

        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


_SYMLINK = "is a symbolic link (none is followed below the cache folder)"


def _checked_open(name: str, flags: int, dir_fd: int, shown: str, trust_foreign_owner: bool) -> int:
    """``name`` in the folder ``dir_fd`` opened without following a symbolic link, and checked on what was opened
    (fstat), so that nothing can be swapped in between the check and the read."""
    if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        raise UntrustedPath(shown, _SYMLINK)
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    reason = ownership_fault(os.fstat(fd), trust_foreign_owner)
    if reason is not None:
        os.close(fd)
        raise UntrustedPath(shown, reason)
    return fd


def open_folder(root: Path, parts: Sequence[str], trust_foreign_owner: bool, create: bool = False) -> int:
    """A descriptor of the folder ``root/parts``, each folder from the root down checked (the root's own path may
    pass through symbolic links: its target is checked); ``create`` makes the missing ones, mode 0700."""
    real_root = os.path.realpath(root)
    if create and not os.path.isdir(real_root):
        os.makedirs(os.path.dirname(real_root), exist_ok=True)
        make_folder(real_root)
    fd = os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    reason = ownership_fault(os.fstat(fd), trust_foreign_owner)
    if reason is not None:
        os.close(fd)
        raise UntrustedPath(str(root), reason)
    shown = root
    for part in parts:
        shown = shown / part
        if create:
            make_folder(part, fd)
        try:
            next_fd = _checked_open(part, os.O_RDONLY | os.O_DIRECTORY, fd, str(shown), trust_foreign_owner)
        finally:
            os.close(fd)
        fd = next_fd
    return fd


def check_replaceable(name: str, dir_fd: int, shown: str) -> None:
    """Raise :class:`UntrustedPath` when the file ``name`` exists and would not be read: a store does not replace
    it either (it stays for its owner to look at)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    reason = _SYMLINK if stat.S_ISLNK(st.st_mode) else ownership_fault(st, False)
    if reason is not None:
        raise UntrustedPath(shown, reason)


def make_folder(path: str, dir_fd: Optional[int] = None) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700, dir_fd=dir_fd)


def open_file(root: Path, parts: Sequence[str], trust_foreign_owner: bool) -> int:
    """A descriptor of the regular file ``root/parts`` whose folders and itself pass the checks."""
    folder = open_folder(root, parts[:-1], trust_foreign_owner)
    try:
        # O_NONBLOCK: a FIFO planted in its place must not block the open
        fd = _checked_open(parts[-1], os.O_RDONLY | os.O_NONBLOCK, folder, str(root.joinpath(*parts)),
                           trust_foreign_owner)
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UntrustedPath(str(root.joinpath(*parts)), "is not a regular file")
    return fd
