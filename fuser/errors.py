"""Errors raised by the fuser's compilers and drivers."""
from __future__ import annotations

from typing import Sequence


def numbered(source: str) -> str:
    """``source`` with 1-based line numbers, as compiler messages refer to them."""
    lines = source.splitlines()
    width = len(str(len(lines)))
    return "\n".join(f"{i:>{width}} | {line}" for i, line in enumerate(lines, 1))


class CompileError(RuntimeError):
    """A generated kernel failed to compile. Carries the compiler's log, its options and the source."""

    def __init__(self, compiler: str, source: str, options: Sequence[str], log: str):
        self.compiler, self.source, self.options, self.log = compiler, source, list(options), log
        super().__init__(
            f"{compiler} failed to compile a generated kernel (options: {' '.join(options)}).\n"
            f"--- compiler log ---\n{log.rstrip()}\n--- source ---\n{numbered(source)}\n"
            "This is a bug in fuser's code generation: please report it with this message. "
            "fuser.override_can_fuse_on_cpu(False) / override_can_fuse_on_gpu(False) disables fusion meanwhile.")


class DriverError(RuntimeError):
    """A CUDA driver or NVRTC call returned an error."""


class PassError(RuntimeError):
    """The fusion pass raised, or left a graph that fails TorchScript's lint. Carries the stage's name."""

    def __init__(self, stage: str, cause: BaseException):
        self.stage, self.cause = stage, cause
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        super().__init__(f"fuser: the fusion pass failed in its {stage!r} stage "
                         f"({type(cause).__name__}: {first[:300]}).")
