"""sf.distributed.initialize() and real torchrun on CPU.

The kill test: a script under ``torchrun --nproc-per-node 2`` that builds a mesh
without ``initialize()`` must fail with Mesh's clear error (before the fix it
ran two separate one-rank trainings and exited 0); with ``initialize()`` it
must train exactly like the same function on the local world of 2 ranks and
like one process on the whole batch.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import shardfn as sf

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
TORCHRUN_TIMEOUT_S = 120
STEPS = 4


# ---- the training both launchers run ----------------------------------------------------


def train(steps: int = STEPS, sharded: bool = True):
    """A few AdamW steps of a small MLP with ZeRO-1 over "dp"; the reference when unsharded.

    Returns ``(losses, params)``; every rank's share of each global batch of 12 rows.
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    import shardfn as sf

    world = dist.get_world_size() if sharded and dist.is_initialized() else 1
    rank = dist.get_rank() if sharded and dist.is_initialized() else 0
    mesh = sf.Mesh({"dp": world}) if sharded else sf.Mesh({"dp": 1}, ranks=[rank])
    torch.manual_seed(0)
    model = sf.functional(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 1)))
    params = model.init(seed=0)
    opt = sf.optim.adamw(5e-2, weight_decay=0.01)
    if sharded:
        opt = sf.shard_opt_state(opt, mesh, axis="dp")
    state = opt.init(params)

    def loss_fn(params, x, y):
        return ((model.apply(params, x) - y) ** 2).mean()

    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(12, 6, generator=gen)
        y = x[:, :2].sum(dim=1, keepdim=True).cos()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
        losses.append(sf.pmean(loss.detach(), "dp", mesh=mesh))
    losses = torch.stack(losses) if losses else torch.empty(0)
    return losses, {name: value.detach().clone() for name, value in params.items()}


SCRIPT = """
import os, sys
import torch
import shardfn as sf
sys.path.insert(0, {repo!r})
from tests.test_distributed_launch import train

if {initialize!r}:
    info = sf.distributed.initialize(timeout=60)
    assert (info.rank, info.world_size) == (int(os.environ["RANK"]), 2), info
    assert info.backend == "gloo" and info.device == torch.device("cpu"), info
    assert sf.distributed.initialize() == info  # idempotent
losses, params = train()
torch.save({{"losses": losses, "params": params}},
           os.path.join({out!r}, f"rank{{os.environ['RANK']}}.pt"))
print("trained on rank", os.environ["RANK"], flush=True)
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(script: Path, nproc: int = 2,
              extra_args: tuple[str, ...] | list[str] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` under real torchrun on CPU, on loopback; kill the whole tree on timeout."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections stay on loopback
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), str(script), *extra_args]
    process = subprocess.Popen(command, cwd=script.parent, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and every worker it started
        stdout, stderr = process.communicate()
        pytest.fail(f"torchrun hung for {TORCHRUN_TIMEOUT_S} s\nstdout:\n{stdout}\n"
                    f"stderr:\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _write_script(tmp_path: Path, initialize: bool) -> Path:
    script = tmp_path / ("with_init.py" if initialize else "without_init.py")
    script.write_text(textwrap.dedent(SCRIPT.format(repo=str(REPO), out=str(tmp_path),
                                                    initialize=initialize)))
    return script


# ---- real torchrun ---------------------------------------------------------------------


def test_torchrun_without_initialize_fails_clearly(tmp_path):
    result = _torchrun(_write_script(tmp_path, initialize=False))
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"two lone one-rank trainings ran without error:\n{output}"
    assert ("WORLD_SIZE=2 in the environment (torchrun?) but torch.distributed is not "
            "initialised: call sf.distributed.initialize() first") in output, output
    assert not list(tmp_path.glob("rank*.pt")), "a rank trained alone"


def test_torchrun_with_initialize_trains_like_the_local_world(tmp_path, worlds):
    result = _torchrun(_write_script(tmp_path, initialize=True))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    launched = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    local = worlds(2).run(train)
    losses, params = train(sharded=False)
    for rank, run in enumerate(launched):
        # the same gloo collectives in the same order: the same bits as the local world
        torch.testing.assert_close(run["losses"], local[rank][0], rtol=0, atol=0)
        for name, value in local[rank][1].items():
            assert torch.equal(run["params"][name], value), f"rank {rank} {name} differs"
        # and one process on the whole batch, to float32 round-off
        assert_close(run["losses"], losses)
        for name, value in params.items():
            assert_close(run["params"][name], value)
    assert not torch.equal(params["0.weight"], train(steps=0, sharded=False)[1]["0.weight"])


def _demo_final_line(steps: int, ckpt: str) -> str:
    """examples/demo.py's train on this rank (plan fsdp), summed up as the demo's final line."""
    demo = _load_demo()
    result = demo.train("fsdp", steps, 16, 64, ckpt, True)
    return f"loss {result['losses'][-1]:.8f}  param checksum {demo.checksum(result['full']):.10f}"


def _load_demo():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shardfn_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


DEMO = REPO / "examples" / "demo.py"


def test_demo_runs_unchanged_under_torchrun(tmp_path, worlds):
    result = _torchrun(DEMO, extra_args=["--steps", "4", "--ckpt", str(tmp_path / "ckpt")])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "joined a torchrun world of 2 processes (gloo, cpu)" in output
    assert output.count("sharded training (fsdp) matches one-process training: OK") == 1, output
    assert "the second half gives the same parameters bit for bit: OK" in output, output
    final = [line for line in result.stdout.splitlines() if line.startswith("final: ")]
    expected = worlds(2).run(_demo_final_line, 4, str(tmp_path / "local"))
    assert final == [f"final: plan fsdp  world 2  {expected[0]}"], output


# ---- initialize() without torchrun ------------------------------------------------------


def test_plain_python_is_a_world_of_one(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    info = sf.distributed.initialize()
    assert info == sf.distributed.DistributedInfo(0, 1, 0, None, torch.device("cpu"))
    assert not torch.distributed.is_initialized()
    sf.distributed.shutdown()  # nothing to undo
    with pytest.raises(ValueError, match="outside a launcher"):
        sf.distributed.initialize("gloo")
    with pytest.raises(ValueError, match=re.escape("initialize(device='cuda:0') outside a")):
        sf.distributed.initialize(device="cuda:0")


BASE_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_launch_environment_parses_torchrun_vars():
    env = sf.distributed.launch_environment(BASE_ENV)
    assert env == sf.distributed.LaunchEnv(1, 2, 1, 2, "127.0.0.1", 29500)
    assert sf.distributed.launch_environment({}) is None
    one_node = {k: v for k, v in BASE_ENV.items() if k != "LOCAL_WORLD_SIZE"}
    assert sf.distributed.launch_environment(one_node).local_world_size == 2


@pytest.mark.parametrize(("change", "message"), [
    ({"RANK": None}, "sets WORLD_SIZE=2, LOCAL_RANK=1 but not RANK"),
    ({"LOCAL_RANK": None}, "but not LOCAL_RANK"),
    ({"MASTER_ADDR": None, "MASTER_PORT": None}, "but not MASTER_ADDR, MASTER_PORT"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' in the environment is not an integer"),
    ({"RANK": "2"}, "RANK=2 with WORLD_SIZE=2: valid is 0 <= RANK < WORLD_SIZE"),
    ({"RANK": "-1"}, "RANK=-1 with WORLD_SIZE=2"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"),
    ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 and WORLD_SIZE=2"),
])
def test_launch_environment_errors(change, message):
    env = {k: v for k, v in {**BASE_ENV, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        sf.distributed.launch_environment(env)


def test_initialize_checks_arguments(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="backend must be 'nccl', 'gloo' or None"):
        sf.distributed.initialize("mpi")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="but not RANK"):
        sf.distributed.initialize()
    assert not torch.distributed.is_initialized()


def _initialize_in_local_world():
    """In a local world the group exists: initialize() is a checked no-op, shutdown() leaves it."""
    import torch.distributed as dist

    import shardfn as sf

    info = sf.distributed.initialize()
    assert info == sf.distributed.initialize("gloo")
    try:
        sf.distributed.initialize("nccl")
    except ValueError as error:
        wrong_backend = str(error)
    sf.distributed.shutdown()  # not ours: the local world's group stays
    return info, wrong_backend, dist.is_initialized()


def test_initialize_in_local_world_is_a_no_op(worlds):
    results = worlds(2).run(_initialize_in_local_world)
    for rank, (info, wrong_backend, still_initialized) in enumerate(results):
        assert info == sf.distributed.DistributedInfo(rank, 2, rank, "gloo", torch.device("cpu"))
        assert "already initialised differently: backend 'nccl' was asked for but the group " \
               "uses 'gloo'" in wrong_backend
        assert still_initialized


def _initialize_from_env(port: int):
    """torchrun's variables for a world of one: initialize(), repeat, check, shutdown()."""
    import os

    import torch.distributed as dist

    import shardfn as sf

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        info = sf.distributed.initialize(timeout=timedelta(seconds=30))
        again = sf.distributed.initialize()
        mesh_size = sf.Mesh({"dp": 1}).size("dp")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = "1", "2"  # the env now disagrees
        try:
            sf.distributed.initialize()
        except ValueError as error:
            disagrees = str(error)
        os.environ.update(env)
        sf.distributed.shutdown()
        after = dist.is_initialized()
        sf.distributed.shutdown()  # idempotent
        return info, again, mesh_size, disagrees, after
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_initialize_from_env_and_shutdown(worlds):
    # a world of 1 runs in a worker process with no group: initialize() makes one from env://
    [(info, again, mesh_size, disagrees, after)] = worlds(1).run(_initialize_from_env,
                                                                 _free_port())
    assert info == sf.distributed.DistributedInfo(0, 1, 0, "gloo", torch.device("cpu"))
    assert again == info
    assert mesh_size == 1
    assert "the environment says RANK=1, WORLD_SIZE=2 but the group has rank 0 of 1" in disagrees
    assert after is False


# ---- the NCCL branch, with CUDA faked (no GPU here) -------------------------------------


class _Joined(Exception):
    """Raised by the fake init_process_group to stop initialize() once it has chosen."""


def _fake_node(monkeypatch, gpus: int, env: dict[str, str]):
    """Pretend this node has ``gpus`` GPUs; record set_device and init_process_group calls."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(set_device=device))

    def init_process_group(backend, **kwargs):
        calls.update(backend=backend, **kwargs)
        raise _Joined

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    # no rank 0 to join here: initialize() gets a store that agreed at once
    monkeypatch.setattr(sf.distributed, "join_world",
                        lambda launch, timeout: torch.distributed.HashStore())
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return calls


def test_nccl_with_one_gpu_per_local_rank(monkeypatch):
    calls = _fake_node(monkeypatch, gpus=2, env=BASE_ENV)
    with pytest.raises(_Joined):
        sf.distributed.initialize(timeout=30)
    assert isinstance(calls.pop("store"), torch.distributed.HashStore)  # joined first
    assert calls == dict(set_device=torch.device("cuda", 1), backend="nccl",
                         rank=1, world_size=2,
                         timeout=timedelta(seconds=30), device_id=torch.device("cuda", 1))


@pytest.mark.parametrize("gpus", [0, 1])
def test_gloo_without_a_gpu_per_local_rank(monkeypatch, gpus):
    calls = _fake_node(monkeypatch, gpus=gpus, env=BASE_ENV)
    with pytest.raises(_Joined):
        sf.distributed.initialize()
    assert calls["backend"] == "gloo" and calls["device_id"] is None
    assert "set_device" not in calls


def test_nccl_device_override_and_errors(monkeypatch):
    calls = _fake_node(monkeypatch, gpus=2, env=BASE_ENV)
    with pytest.raises(_Joined):
        sf.distributed.initialize(device=0)
    assert calls["set_device"] == calls["device_id"] == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=re.escape("LOCAL_RANK=1 needs cuda:3 but this node "
                                                   "has 2 GPUs")):
        sf.distributed.initialize("nccl", device="cuda:3")
    with pytest.raises(ValueError, match="under NCCL each process needs a CUDA device"):
        sf.distributed.initialize("nccl", device="cpu")
    with pytest.raises(ValueError, match="device='cuda:0' is for NCCL"):
        sf.distributed.initialize("gloo", device="cuda:0")
    _fake_node(monkeypatch, gpus=0, env=BASE_ENV)
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA"):
        sf.distributed.initialize("nccl")
    with pytest.raises(ValueError, match="timeout must be positive"):
        sf.distributed.initialize(timeout=0)
