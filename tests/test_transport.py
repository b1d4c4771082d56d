"""What the runtime asks of torch.distributed and torch itself that a GPU run would meet first:
the failure watcher's store, TF32 set with torch's newer API."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import torch.distributed as dist

from umopt.run.comm import TorchComm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_failure_watcher_waits_on_a_store_of_its_own():
    """Under a TCPStore (torchrun's, every multi-node run's) a client holds its lock for the whole
    of a wait: the watcher, waiting for a failure for a minute at a time, must not make this
    process's own store calls (a failing rank's report) wait behind it. And when a failure is
    written, it breaks this process's links."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        comm = TorchComm.current()
        comm.watch()
        time.sleep(0.3)  # the watcher is inside its 60 s wait now
        began = time.monotonic()
        assert comm.failure() == ""
        comm._first(comm.prefix + "failed", "rank 1 failed: RuntimeError: boom")
        assert time.monotonic() - began < 10  # on the watcher's store: 60 s
        end = time.monotonic() + 10
        while not comm.failed and time.monotonic() < end:
            time.sleep(0.05)
        assert comm.failed == "rank 1 failed: RuntimeError: boom"
    finally:
        dist.destroy_process_group()


def test_numerics_are_read_after_tf32_is_set_with_the_new_api():
    """torch.get_float32_matmul_precision() raises once torch.backends.cuda.matmul.fp32_precision
    is set; a Pipeline, the runtime's report and the profiler read the settings all the same."""
    code = (
        "import torch\n"
        "from umopt.devices import numerics\n"
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'\n"
        "n = numerics()\n"
        "assert n['matmul_tf32'] is True and n['float32_matmul_precision'] == 'high', n\n"
        "torch.backends.fp32_precision = 'ieee'\n"
        "torch.backends.cuda.matmul.fp32_precision = 'none'\n"
        "n = numerics()\n"
        "assert n['matmul_tf32'] is False and n['float32_matmul_precision'] == 'highest', n\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_groups_made_for_the_pipelines_take_the_worlds_timeout():
    """torch gives a new group its own default timeout (10 minutes under NCCL, 30 under gloo),
    not the world's: the links', the tied weights' and the data-parallel groups would then wait that
    long on a stuck peer instead of the run's UMOPT_TIMEOUT_S."""
    from datetime import timedelta

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=37),
    )
    try:
        comm = TorchComm.current()
        assert comm.timeout_s() == 37
        cpu = __import__("torch").device("cpu")
        for group in (comm.new_group([0]), comm.split([[0]]), *comm.groups_of([[0]]).values()):
            assert group._get_backend(cpu).options._timeout.total_seconds() == 37
    finally:
        dist.destroy_process_group()
