"""Runs a test body on N processes (torch.distributed, gloo, CPU) started by the test itself.

``run_on_ranks(body, world_size, *args)`` spawns ``world_size`` processes, each joining one
gloo process group on a free local port, runs ``body(rank, world_size, *args)`` in each, and
re-raises in the test the first failure of any rank (with its traceback). ``body`` must be a
module-level function (the processes are spawned, so it is pickled by reference).

Teardown. A rank that passed writes a marker file after its body and a final barrier (so
every rank's checks are done by then), destroys the process group and leaves with
``os._exit(0)``: interpreter finalization, where torch's gloo worker threads can abort the
process (torch PR 179291), is skipped. A rank that dies by a signal after every rank wrote
its marker died in ``destroy_process_group`` (torch's teardown, no fusednorm code runs
there): the test reports it and passes, since every check ran and passed. A signal before
that (an abort inside an operator or a collective) fails the test, with every thread's
Python stack from faulthandler in the captured stderr.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marker(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.passed")


def _entry(rank: int, world_size: int, port: int, markers: str, body, args) -> None:
    # a rank killed by a signal (an abort in C++) prints every thread's Python stack
    faulthandler.enable(all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # N processes share the machine's cores: one thread each keeps them from oversubscribing.
    torch.set_num_threads(1)
    import fusednorm  # noqa: F401  (operators, fake kernels, autograd)

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise  # spawn's wrapper writes the traceback for the parent
    with open(_marker(markers, rank), "w") as f:
        f.write("passed\n")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(body, world_size: int, *args) -> None:
    with tempfile.TemporaryDirectory(prefix="fusednorm-ranks-") as markers:
        try:
            mp.start_processes(
                _entry,
                args=(world_size, free_port(), markers, body, args),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessExitedException as e:
            passed = all(os.path.exists(_marker(markers, r)) for r in range(world_size))
            if not (passed and e.signal_name):
                raise
            warnings.warn(
                f"every rank passed its checks; rank {e.error_index} then died by "
                f"{e.signal_name} in torch.distributed's teardown (destroy_process_group)",
                RuntimeWarning,
                stacklevel=2,
            )
