"""The shim's dashboard token file, ``$XDG_RUNTIME_DIR/uapplace/token``
(``Paths.token_file``; docs/http-contract.md §5): one line of random text, mode 0600 in a
0700 directory, owned by the user.

Written by the shim on its first start (:func:`load_or_create_token`) or beforehand by
``uapplace install --with-shim`` (:func:`create_token`), read by the shim at every start
and by the operator (``x-uap-dashboard-token``). A file or directory that others could
read, one owned by someone else, or an empty file is refused with a ``ValueError``
naming the path: a token others can read protects nothing.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


def load_or_create_token(path: Path) -> str:
    """The dashboard token, created (0600, directory 0700) when missing."""
    token = create_token(path)
    return token if token is not None else read_token(path)


def create_token(path: Path) -> str | None:
    """A fresh token written to ``path`` (created 0600, its directory 0700 when missing);
    ``None`` when the file already exists, which is left as it is."""
    check_token_directory(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        token = secrets.token_urlsafe(32)
        handle.write(token + "\n")
    return token


def check_token_directory(directory: Path) -> None:
    """Create ``directory`` 0700 when missing; refuse one others could enter or not ours."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(
            f"{directory}: must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
        )


def read_token(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, encoding="utf-8") as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ValueError(
                f"{path}: the token file must be owned by uid {os.getuid()} with mode 0600 "
                f"(it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
            )
        token = handle.read().strip()
    if not token:
        raise ValueError(f"{path}: the token file is empty; delete it to get a new token")
    return token
