"""Child processes: the set-up of a campaign's worker, and an evaluator that judges a program in a child
process, so that a crashing kernel cannot take the caller with it."""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import traceback
from typing import Optional

import torch

from .judge import Verdict, check_program
from .program import Program


_WORKER_READY = False


def _worker_init(threads: Optional[int] = None):
    global _WORKER_READY
    if _WORKER_READY:
        return
    _WORKER_READY = True
    if threads:
        torch.set_num_threads(threads)


class Evaluator:
    """Runs :func:`check_program` in a child process, so that a crashing kernel cannot take the caller with
    it (a crash is reported as the verdict kind ``crash``)."""

    def __init__(self, device: str):
        self.device = device
        self.pool = None

    def _pool(self):
        if self.pool is None:
            self.pool = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self.pool

    def __call__(self, p: Program, timeout: float = 300) -> Verdict:
        try:
            return self._pool().submit(_check_worker, p, self.device).result(timeout=timeout)
        except cf.process.BrokenProcessPool:
            self.close()
            return Verdict(False, "crash", "the process running the fused kernel died")
        except cf.TimeoutError:
            self.close(kill=True)
            return Verdict(False, "hang", f"no result in {timeout} s")

    def close(self, kill: bool = False):
        if self.pool is not None:
            if kill:
                for proc in list(getattr(self.pool, "_processes", {}).values()):
                    proc.kill()
            self.pool.shutdown(wait=not kill, cancel_futures=True)
            self.pool = None


def _check_worker(p: Program, device: str) -> Verdict:
    _worker_init()
    try:
        return check_program(p, device)
    except Exception as ex:  # noqa: BLE001
        return Verdict(False, "fuzzer_error", "".join(traceback.format_exception(ex))[-3000:])
