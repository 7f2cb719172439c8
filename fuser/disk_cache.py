"""The persistent kernel cache: compiled images on disk, so a second process compiles nothing.

Place: ``$FUSER_CACHE_DIR``, else ``$XDG_CACHE_HOME/fuser``, else ``~/.cache/fuser``; a directory the user
owns with mode 0700 (created so; one owned by someone else, or writable by others, turns the cache off).
``FUSER_DISABLE_CACHE=1`` turns it off.

Key: sha256 over labeled, length-prefixed fields: a schema version, a hash of fuser's own code generator
sources (editing a template invalidates every old entry), and what the caller passes (compiler version,
architecture, options, source). Entry: a magic line, the sha256 of the payload, the payload. Writes go to a
temporary file in the same directory and are renamed into place, so readers never see half an entry; a short,
corrupt or foreign file is a miss, never loaded.
"""
from __future__ import annotations

import functools
import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

SCHEMA = b"fuser-cache-v1"
MAGIC = b"FUSERKC1\n"
_CODEGEN_FILES = ("codegen/__init__.py", "codegen/common.py", "codegen/body.py", "codegen/cpu_vector.py",
                  "codegen/emit.py", "ops.py", "descs.py", "cuda/templates.py", "cuda/launch.py", "cuda/driver.py",
                  "cpu/templates.py", "cpu/compiler.py")

hits = 0  # entries served from disk by this process (tests and the benchmark read it)


@functools.lru_cache(maxsize=None)
def codegen_hash() -> str:
    """sha256 of the sources that decide what a kernel's image contains."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for name in _CODEGEN_FILES:
        data = (root / name).read_bytes()
        h.update(len(name).to_bytes(8, "little") + name.encode() + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def key(fields: Sequence[tuple[str, bytes | str]]) -> str:
    """Hex sha256 of the schema, the code generator's hash and ``fields`` (label, value) pairs."""
    h = hashlib.sha256()
    for label, value in (("schema", SCHEMA), ("codegen", codegen_hash()), *fields):
        data = value.encode() if isinstance(value, str) else bytes(value)
        h.update(len(label).to_bytes(8, "little") + label.encode() + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def directory() -> Optional[Path]:
    """The cache directory, created if needed; None when the cache is off or the place is unsafe."""
    if os.environ.get("FUSER_DISABLE_CACHE", "0") not in ("", "0"):
        return None
    base = os.environ.get("FUSER_CACHE_DIR")
    if base:
        path = Path(base)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg) if xdg else Path.home() / ".cache") / "fuser"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None  # others could plant images we would load
    return path


def read(path: Path) -> Optional[bytes]:
    """The payload of the entry at ``path``, or None for anything missing, short, corrupt or foreign."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(MAGIC) + 64
    if len(data) < head or not data.startswith(MAGIC):
        return None
    digest, payload = data[len(MAGIC):head], data[head:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        return None
    return payload


def write(path: Path, payload: bytes) -> None:
    """Atomically store ``payload`` at ``path`` (best effort: a full disk only costs a recompile later)."""
    write_file(path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + payload)


def write_file(path: Path, data: bytes) -> None:
    """Atomically put ``data`` (as it is: no magic, no digest) at ``path``; best effort, as :func:`write`."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def get_or_build(fields: Sequence[tuple[str, bytes | str]], build: Callable[[], bytes], suffix: str) -> bytes:
    """The cached payload for ``fields``, or ``build()``'s result, stored for next time."""
    global hits
    where = directory()
    if where is None:
        return build()
    path = where / (key(fields) + suffix)
    payload = read(path)
    if payload is not None:
        hits += 1
        return payload
    payload = build()
    write(path, payload)
    return payload
