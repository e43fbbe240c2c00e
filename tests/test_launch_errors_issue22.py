"""Issue #22: launch and teardown mistakes give clear errors, never a hang or a raw gloo one.

* Ranks launched with different ``WORLD_SIZE`` waited in ``init_process_group``
  forever; ``sf.distributed.initialize()`` now fails at once on every rank, naming
  every ``RANK``/``WORLD_SIZE`` seen, and a rank that never comes is named after
  ``join_timeout``.
* After ``destroy_process_group()`` on one rank, that rank's collectives said "Could not
  resolve the process group" and its peer's said gloo's "Connection closed by peer";
  both now raise ``ProcessGroupError`` naming the collective and the axis.

Each case starts two plain processes with a crafted environment (what torchrun would
set), on loopback; every process is bounded by a timeout and killed after it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROCESS_TIMEOUT_S = 90  # a loaded 2-core box imports torch slowly; the checks take < 5 s
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(script: str, envs: list[dict[str, str]], where: Path) -> list[subprocess.Popen]:
    """Start one process per environment running ``script`` in the folder ``where``."""
    where.mkdir()
    path = where / "rank_script.py"
    path.write_text(textwrap.dedent(script))
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    base.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME="lo", SHARDFN_CHECK="0")
    return [subprocess.Popen([sys.executable, str(path)], cwd=where, env={**base, **env},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for env in envs]


def _outputs(processes: list[subprocess.Popen]) -> list[str]:
    """Every process's output; a process still running after the timeout is killed."""
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=PROCESS_TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            outputs.append(f"HUNG for {PROCESS_TIMEOUT_S} s: " + process.communicate()[0])
    return outputs


def _launch_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


INITIALIZE = """
import time
import shardfn as sf
start = time.monotonic()
try:
    info = sf.distributed.initialize(join_timeout=JOIN_TIMEOUT)
    print("JOINED", info.rank, info.world_size)
    sf.distributed.shutdown()
except sf.distributed.JoinError as e:
    print("JOINERROR", round(time.monotonic() - start, 1), e)
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, list[str]]:
    """Every scenario's processes, started together (the imports dominate: run them at
    once rather than one scenario after another), and their outputs."""
    root = tmp_path_factory.mktemp("launch")
    join = INITIALIZE.replace("JOIN_TIMEOUT", "60")
    scenarios = {
        "sizes 2,3": (join, [(0, 2), (1, 3)]),
        "sizes 3,2": (join, [(0, 3), (1, 2)]),  # rank 0, the store's host, expects more
        "missing rank": (INITIALIZE.replace("JOIN_TIMEOUT", "3"), [(0, 3), (1, 3)]),
        "destroy": (DESTROY, [(0, 2), (1, 2)]),
    }
    started = {}
    for i, (name, (script, ranks)) in enumerate(scenarios.items()):
        port = _free_port()
        started[name] = _start(script, [_launch_env(r, size, port) for r, size in ranks],
                               root / f"scenario{i}")
    return {name: _outputs(processes) for name, processes in started.items()}


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)])
def test_ranks_that_disagree_on_world_size_fail_at_once_naming_it(launched, sizes):
    outputs = launched[f"sizes {sizes[0]},{sizes[1]}"]
    for rank, out in enumerate(outputs):
        assert "JOINERROR" in out, f"rank {rank}: {out}"
        if "lost the rendezvous store" in out:  # rank 0 found it first and left
            continue
        assert "disagree on WORLD_SIZE" in out, out
        assert f"RANK=0 WORLD_SIZE={sizes[0]}" in out and f"RANK=1 WORLD_SIZE={sizes[1]}" in out
        assert float(out.split("JOINERROR")[1].split()[0]) < 30, out  # not the join timeout
    assert any("disagree on WORLD_SIZE" in out for out in outputs), outputs


def test_a_rank_that_never_comes_is_named_after_join_timeout(launched):
    outputs = launched["missing rank"]
    for out in outputs:  # rank 0 hosts the store: a rank still polling may lose it first
        assert "JOINERROR" in out and "never joined: RANK [2]" in out, out
        assert "only 2 of WORLD_SIZE=3" in out or "lost the rendezvous store" in out, out
    assert "only 2 of WORLD_SIZE=3 processes joined within 3 s" in outputs[0], outputs[0]


DESTROY = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
import shardfn as sf
from shardfn.primitives._group_errors import ProcessGroupError

info = sf.distributed.initialize()
mesh = sf.Mesh({"dp": 2})
assert sf.psum(torch.ones(2), "dp", mesh=mesh).tolist() == [2.0, 2.0]
left = Path("left")
if info.rank == 1:
    dist.destroy_process_group()
    for what, run in [("psum", lambda: sf.psum(torch.ones(2), "dp", mesh=mesh)),
                      ("reduce_grads", lambda: sf.data_parallel(mesh, "dp").reduce_grads(
                          {"w": torch.ones(3)}))]:
        try:
            run()
            print(what, "RAN")
        except ProcessGroupError as e:
            print(what, "OWN", e)
    left.write_text("1")
    sys.exit(0)
while not left.exists():
    time.sleep(0.05)
time.sleep(1.0)  # rank 1 has exited: its connections are closed
for what, run in [("psum", lambda: sf.psum(torch.ones(2), "dp", mesh=mesh)),
                  ("reduce_grads", lambda: sf.data_parallel(mesh, "dp").reduce_grads(
                      {"w": torch.ones(3)}))]:
    try:
        run()
        print(what, "RAN")
    except ProcessGroupError as e:
        print(what, "PEER", e)
"""


def test_collectives_after_destroy_process_group_say_so(launched):
    peer, own = launched["destroy"]  # both joined with initialize(): agreeing ranks still join
    for what in ("psum", "reduce_grads"):
        line = next((x for x in own.splitlines() if x.startswith(what + " ")), own)
        assert line.startswith(f"{what} OWN "), own
        assert "axis 'dp'" in line and "destroyed on this rank" in line, line
        assert "sf.distributed.initialize()" in line, line
    line = next((x for x in peer.splitlines() if x.startswith("psum ")), peer)
    assert line.startswith("psum PEER ") and "axis 'dp'" in line, peer
    assert "a peer of this group left" in line and "rank 0" in line, line
