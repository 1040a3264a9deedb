"""Runs a test body on N processes (torch.distributed, gloo, CPU) started by the test itself.

``run_on_ranks(body, world_size, *args)`` spawns ``world_size`` processes, each joining one
gloo process group on a free local port, runs ``body(rank, world_size, *args)`` in each, and
re-raises in the test the first failure of any rank (with its traceback). ``body`` must be a
module-level function (the processes are spawned, so it is pickled by reference).
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, body, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # N processes share the machine's cores: one thread each keeps them from oversubscribing.
    torch.set_num_threads(1)
    import fusednorm  # noqa: F401  (operators, fake kernels, autograd)

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_ranks(body, world_size: int, *args) -> None:
    mp.start_processes(
        _entry,
        args=(world_size, free_port(), body, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
