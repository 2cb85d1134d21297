"""Run a function on several processes joined by one process group, bounded in time.

``backend="gloo"`` runs CPU processes, or with ``shared_gpu=i`` processes that all
have ``cuda:i`` as their current device (several ranks on one GPU, which NCCL
refuses); ``backend="nccl"`` runs one process per GPU, rank ``r`` on ``cuda:r``
(its current device, also given to the group as ``device_id`` so the
communicator is built at once). Every process group gets a
timeout, and the launcher kills the processes when the whole run takes longer
than its own deadline: a bug fails a test, it never hangs it. A failure in any
process fails the caller with that process's traceback.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

# Each collective gives up after this: a rank that never comes fails its peers.
# Generous: on a loaded 2-core machine one rank may still be compiling (Dynamo,
# AOTAutograd) while its peers wait in the first collective.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=180)
# The whole run, process start-up (importing torch) included.
RUN_DEADLINE_S = 480
BACKENDS = ("gloo", "nccl")
# Triton reads TRITON_INTERPRET when a kernel is defined, so a forked rank runs this
# process's kernels as they were defined; a test that sets it for its ranks needs them
# to import everything afresh.
_TRITON_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET")


def _worker(rank: int, world_size: int, init_file: str, backend: str,
            shared_gpu: int | None, timeout: datetime.timedelta, fn, args, errors) -> None:
    # One intra-op thread per rank: the ranks share the machine's cores (torch is
    # imported already, so OMP_NUM_THREADS would come too late).
    torch.set_num_threads(1)
    options = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    elif shared_gpu is not None:
        torch.cuda.set_device(shared_gpu)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timeout, **options)
    try:
        fn(rank, world_size, *args)
    except Exception:  # noqa: BLE001 (reported through the queue; the process exits)
        errors.put((rank, traceback.format_exc()))
        # Leave at once: tearing the group down would wait on peers still inside a
        # collective this rank will never join. The launcher sees the exit, stops
        # the peers and reports this traceback.
        os._exit(1)
    # A rank that tears down while a peer still finishes the last collective
    # closes the connection under it (gloo then aborts that peer): meet first (unless
    # ``fn`` aborted the group, as a test of what an abort does may).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Skip the interpreter's teardown: under load a rank sometimes aborted there
    # ("terminate called without an active exception") after its work passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
                timeout: datetime.timedelta = COLLECTIVE_TIMEOUT):
    """``init_device_mesh`` whose every sub-group waits at most ``timeout`` per collective
    (a mesh's groups otherwise take the backend's default, 10 or 30 minutes, not the
    world group's)."""
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return init_device_mesh(device_type, shape, mesh_dim_names=names,
                            backend_override=dict.fromkeys(names, options))


def skip_without_gpus(world_size: int) -> None:
    """Skip the calling test where there are fewer CUDA GPUs than ``world_size`` (NCCL runs
    one rank per GPU)."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")


def run_on_ranks(world_size: int, fn, *args, backend: str = "gloo",
                 shared_gpu: int | None = None,
                 timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
                 deadline_s: float = RUN_DEADLINE_S) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes of one process
    group (``dist.group.WORLD``) of ``backend``; ``fn`` must be importable (a
    module-level function). With gloo, ``shared_gpu`` (a GPU index) is every
    process's current CUDA device. Each collective waits at most ``timeout``, the
    whole run at most ``deadline_s`` seconds."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if shared_gpu is not None and backend != "gloo":
        raise ValueError(f"shared_gpu puts every rank on one GPU, which only gloo allows: "
                         f"backend must be 'gloo', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend 'nccl' runs one rank per GPU: world_size ({world_size}) "
                         f"must be <= the GPUs here ({torch.cuda.device_count()})")
    # CPU ranks fork from this process, which has imported torch and the library already:
    # a spawned rank spent about 2 s of CPU importing them again, most of a small test's
    # time on a 2-core machine. A process that has initialised CUDA cannot fork a rank
    # that uses it, so GPU ranks are spawned, as are ranks that must see another
    # TRITON_INTERPRET than this process's kernels were defined under.
    start_method = ("fork" if backend == "gloo" and shared_gpu is None
                    and not torch.cuda.is_initialized()
                    and os.environ.get("TRITON_INTERPRET") == _TRITON_INTERPRET_AT_IMPORT
                    else "spawn")
    context = mp.get_context(start_method)
    errors = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(pathlib.Path(tmp) / "init")
        processes = mp.start_processes(
            _worker, args=(world_size, init_file, backend, shared_gpu, timeout, fn, args, errors),
            nprocs=world_size, join=False, start_method=start_method)
        try:
            finished = False
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=deadline_s)
            while not finished:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    raise TimeoutError(f"{world_size} ranks did not finish in {deadline_s} s")
                finished = processes.join(timeout=min(remaining, 5))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            messages = []
            while not errors.empty():
                rank, text = errors.get()
                messages.append(f"--- rank {rank} ---\n{text}")
            raise AssertionError("\n".join(messages) or str(error)) from None
        finally:
            for process in processes.processes:
                if process.is_alive():
                    process.kill()
