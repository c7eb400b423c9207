"""Launching the 2- and 4-rank worker scripts of the tests (gloo on CPU): one process per rank, on
a free loopback port, rank 0 writing its results to a file the test loads. The workers import
`helpers` through the PYTHONPATH they are given (helpers.child_env); their side of it (flags,
process group, training loop) is helpers.worker."""

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
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                worker,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--out",
                out,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(),
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    if not expect_ok:
        return procs, logs
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return torch.load(out)
