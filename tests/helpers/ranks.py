"""Launching the 2- and 4-rank worker scripts of the tests (gloo on CPU): one process per rank, on
a free loopback port, rank 0 writing its results to a file the test loads. The workers import
`helpers` through the PYTHONPATH they are given (helpers.child_env)."""
import contextlib
import os
import random
import socket
import subprocess
import sys

import torch

from helpers import child_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, tmp_path, *args, world=2, expect_ok=True):
    """Run `worker` on `world` ranks with `args`. With expect_ok, assert every rank exited 0 and
    return what rank 0 saved; otherwise return (procs, logs) for the test to inspect."""
    out = str(tmp_path / f"r{random.randrange(1 << 30)}.pt")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, worker, "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--out", out, *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=child_env())
             for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    if not expect_ok:
        return procs, logs
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return torch.load(out)


def exit_after(main) -> None:
    """A worker's entry point: run main() (results saved, process group destroyed) and leave
    without the interpreter's teardown, where gloo's worker threads now and then abort a run that
    passed ("terminate called without an active exception": a torch/gloo teardown race, not
    zrw's)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


@contextlib.contextmanager
def count_gathered_bytes():
    """The tests' own count of all-gathered bytes, independent of zrw's (zrw.testing has its
    own): for the block, wraps the process group's all-gather entry points
    (ProcessGroup.all_gather_single, what FSDP2 calls, and _allgather_base). Yields a dict
    with "bytes" (output bytes: what the rank receives, its own shard included) and "sizes"
    (each collective's output bytes, in call order), updated as collectives run."""
    from torch.distributed import ProcessGroup

    counts = {"bytes": 0, "sizes": []}
    saved = {}
    for meth in ("all_gather_single", "_allgather_base"):
        orig = getattr(ProcessGroup, meth, None)
        if orig is None:
            continue
        saved[meth] = orig

        def wrapper(self, out, inp, *a, _orig=orig, **k):
            n = out.numel() * out.element_size()
            counts["bytes"] += n
            counts["sizes"].append(n)
            return _orig(self, out, inp, *a, **k)

        setattr(ProcessGroup, meth, wrapper)
    try:
        yield counts
    finally:
        for meth, orig in saved.items():
            setattr(ProcessGroup, meth, orig)
