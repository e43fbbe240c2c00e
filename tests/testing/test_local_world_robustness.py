"""Robustness of the local world: concurrent runs, broken groups, crashes, hangs vs slow runs.

Tests that break a world (kill a rank, time out a collective) use the module's own
``fragile`` world, never the session's ``worlds``; it is closed at the end.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.primitives import stats
from shardfn.testing import LocalWorld, RankError, WorldTimeout

PG_TIMEOUT_S = 4.0  # the fragile world's gloo timeout: short, for the broken-group test


@pytest.fixture(scope="module")
def fragile():
    world = LocalWorld(2, timeout=30, pg_timeout=PG_TIMEOUT_S)
    yield world
    world.close()


def _pids(world: LocalWorld) -> list[int]:
    return world.run(os.getpid)


def _psum_of_ranks() -> float:
    with sf.Mesh({"dp": dist.get_world_size()}):
        return float(sf.psum(torch.tensor([dist.get_rank() + 1.0]), "dp"))


# --- concurrent runs --------------------------------------------------------------------


def test_concurrent_runs_never_swap_results(worlds):
    world = worlds(2)
    results: dict[int, list] = {}

    def fn(tag, pause):
        time.sleep(pause)
        return tag, dist.get_rank()

    def client(tag):
        results[tag] = [world.run(fn, tag, 0.02 * (tag % 3)) for _ in range(4)]

    threads = [threading.Thread(target=client, args=(tag,)) for tag in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    for tag, runs in results.items():
        assert runs == [[(tag, 0), (tag, 1)]] * 4


# --- argument validation ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 0, -0.5, math.nan, math.inf])
def test_bad_run_durations_are_value_errors(worlds, bad):
    with pytest.raises(ValueError, match="run timeout must be a finite number of seconds > 0"):
        worlds(1).run(os.getpid, timeout=bad)
    with pytest.raises(ValueError, match="run deadline"):
        worlds(1).run(os.getpid, deadline=bad)
    assert worlds(1).run(lambda: 5) == [5]


@pytest.mark.parametrize("bad", ["3", True, [1.0], torch.tensor(1.0)])
def test_non_number_run_durations_are_type_errors(worlds, bad):
    with pytest.raises(TypeError, match="run timeout must be a number of seconds"):
        worlds(1).run(os.getpid, timeout=bad)
    with pytest.raises(TypeError, match="run deadline"):
        worlds(1).run(os.getpid, deadline=bad)


@pytest.mark.parametrize("size, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError),
                                         (True, TypeError), ("2", TypeError), (None, TypeError)])
def test_bad_sizes_are_rejected(size, error):
    with pytest.raises(error, match="LocalWorld size must be an int >= 1"):
        LocalWorld(size)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"timeout": 0}, ValueError, "LocalWorld timeout"),
    ({"timeout": -1}, ValueError, "LocalWorld timeout"),
    ({"timeout": math.nan}, ValueError, "LocalWorld timeout"),
    ({"timeout": "10"}, TypeError, "LocalWorld timeout"),
    ({"deadline": 0}, ValueError, "LocalWorld deadline"),
    ({"grace": -1}, ValueError, "LocalWorld grace"),
    ({"pg_timeout": math.inf}, ValueError, "LocalWorld pg_timeout"),
    ({"check": "yes"}, TypeError, "LocalWorld check"),
])
def test_bad_world_options_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        LocalWorld(1, **kwargs)


# --- broken process groups --------------------------------------------------------------


def test_gloo_timeout_respawns_the_world(fragile):
    def skip_on_rank_1():
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins: gloo times out
        return "skipped"

    pids = _pids(fragile)
    with pytest.raises(RankError, match="Timed out") as info:
        fragile.run(skip_on_rank_1)
    assert fragile.run(_psum_of_ranks) == [3.0, 3.0]  # not "Connection closed by peer"
    assert info.value.rank == 0 and not isinstance(info.value, WorldTimeout)
    assert "process group may be broken" in str(info.value)
    assert set(_pids(fragile)).isdisjoint(pids)  # restarted


def test_plain_error_after_collectives_keeps_the_world(worlds):
    def fn():
        dist.all_reduce(torch.ones(1))
        if dist.get_rank() == 1:
            raise ValueError("after a good collective")
        return "fine"

    pids = _pids(worlds(2))
    with pytest.raises(RankError, match="after a good collective") as info:
        worlds(2).run(fn)
    assert "restarted" not in str(info.value)
    assert _pids(worlds(2)) == pids  # the group is in step: no respawn needed


def test_collective_failures_count_exceptions_leaving_a_scope():
    before = stats.collective_failures(), stats.progress()
    with stats.collective_scope("psum over axis 'dp'"):
        assert stats.in_flight() == "psum over axis 'dp'"
    assert stats.collective_failures() == before[0]
    with pytest.raises(RuntimeError), stats.collective_scope("psum over axis 'dp'"):
        raise RuntimeError("Connection closed by peer")
    assert stats.collective_failures() == before[0] + 1
    stats.heartbeat()
    assert stats.progress() == before[1] + 5  # two scopes entered and left, one heartbeat
    assert stats.in_flight() is None


# --- crashes ----------------------------------------------------------------------------


def test_sigabrt_reports_signal_and_stderr_tail(fragile, capsys):
    def fn():
        if dist.get_rank() == 1:
            for line in range(100):
                sys.stderr.write(f"noise {line:03d}\n")
            sys.stderr.write("gloo says: Received data size doesn't match\n")
            sys.stderr.flush()
            os.abort()
        return dist.get_rank()

    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        fragile.run(fn)
    assert time.monotonic() - start < 15  # found by the process sentinel, not a timeout
    message = str(info.value)
    assert info.value.rank == 1 and info.value.ranks == (1,)
    assert "rank 1 is dead (killed by signal SIGABRT)" in message
    assert "Received data size doesn't match" in message and "noise 099" in message
    assert "noise 000" not in message  # only the tail (40 lines)
    assert "faulthandler" in message and "in fn" in message  # the Python stack at the crash
    assert "[rank 1] gloo says: Received data size" in capsys.readouterr().err  # forwarded
    assert fragile.run(_psum_of_ranks) == [3.0, 3.0]


def test_gloo_size_mismatch_abort_is_reported_with_gloo_message(fragile):
    def mismatched():
        dist.all_reduce(torch.ones(2 if dist.get_rank() == 0 else 3000))  # not via check mode

    with pytest.raises(WorldTimeout) as info:
        fragile.run(mismatched)
    message = str(info.value)
    assert re.search(r"rank \d is dead \(killed by signal SIGABRT\); last lines of its stderr",
                     message)
    assert "Received data size doesn't match" in message  # gloo's words, from the stderr tail
    assert "in mismatched" in message  # faulthandler's stack of the dead rank
    assert fragile.run(_psum_of_ranks) == [3.0, 3.0]


# --- hangs versus slow runs -------------------------------------------------------------


def test_run_making_progress_outlives_the_timeout(worlds):
    def train(steps, pause):
        with sf.Mesh({"dp": 2}):
            total = torch.zeros(1)
            for _ in range(steps):
                time.sleep(pause)
                total += sf.psum(torch.ones(1), "dp")
        return float(total)

    start = time.monotonic()
    assert worlds(2).run(train, 8, 0.4, timeout=1.5) == [16.0, 16.0]
    assert time.monotonic() - start > 3.0  # longer than the timeout, yet not killed


def test_heartbeat_and_plain_collectives_count_as_progress(worlds):
    def sleeper():
        for _ in range(5):
            time.sleep(0.4)
            stats.heartbeat()
        return "done"

    def direct():  # torch.distributed calls without shardfn: torch's sequence numbers move
        for _ in range(5):
            time.sleep(0.4)
            dist.all_reduce(torch.ones(1))
        return "done"

    def sequence_grows():  # what the watchdog counts for collectives outside shardfn
        from shardfn.testing._worker import _group_sequence

        before = _group_sequence(dist)
        dist.all_reduce(torch.ones(1))
        return _group_sequence(dist) - before

    assert worlds(1).run(sleeper, timeout=1.2) == ["done"]
    assert worlds(2).run(direct, timeout=1.2) == ["done", "done"]
    assert worlds(2).run(sequence_grows) == [1, 1]


def test_stuck_collective_is_killed_with_stack_and_collective(fragile):
    def fn():
        with sf.Mesh({"dp": 2}):
            if dist.get_rank() == 1:
                time.sleep(1000)
            sf.psum(torch.ones(1), "dp")

    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        fragile.run(fn, timeout=1)
    # a WorldTimeout, not gloo's own timeout (a RankError from rank 0 after PG_TIMEOUT_S)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "no progress on any of them for the run timeout of 1s" in message
    # the collective named (in check mode: its fingerprint exchange over the axis) and the stack
    assert re.search(r"rank 0 did not finish .*; collective in flight: [^\n]*axis 'dp'", message)
    assert "in psum" in message and 'sf.psum(torch.ones(1), "dp")' in message
    assert "rank 1 did not finish" in message and "time.sleep(1000)" in message
    assert info.value.ranks == (0, 1)
    assert fragile.run(_psum_of_ranks) == [3.0, 3.0]


def test_deadline_limits_total_time_of_a_progressing_run(fragile):
    def busy():
        while True:
            time.sleep(0.1)
            stats.heartbeat()

    start = time.monotonic()
    with pytest.raises(WorldTimeout, match="within the run deadline of 1.5s"):
        fragile.run(busy, timeout=30, deadline=1.5)
    assert time.monotonic() - start < 8
    assert fragile.run(_psum_of_ranks) == [3.0, 3.0]


# --- loopback and check mode ------------------------------------------------------------


def _tcp_local_addresses() -> list[str]:
    """Local addresses of this process's TCP sockets (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/self/net/{table}") as file:
            for row in file.read().splitlines()[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    raw = bytes.fromhex(fields[1].split(":")[0])
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    addresses.append(socket.inet_ntop(family, raw))
    return addresses


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_gloo_binds_to_loopback(worlds):
    def fn():
        return (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("MASTER_ADDR"),
                _tcp_local_addresses())

    for interface, master, addresses in worlds(2).run(fn):
        assert interface == "lo" and master == "127.0.0.1"
        assert addresses and all(_is_loopback(a) for a in addresses), addresses


def test_check_mode_is_on_in_workers_and_restored_after_runs(worlds):
    from shardfn.primitives import consistency

    def turn_off():
        consistency.check_consistency(False)
        return consistency.enabled()

    assert worlds(2).run(consistency.enabled) == [True, True]
    assert worlds(2).run(turn_off) == [False, False]
    assert worlds(2).run(consistency.enabled) == [True, True]  # the world's setting again
    # every rank restarts check mode's call numbering after every run
    epochs = worlds(2).run(lambda: consistency._EPOCH[0])
    assert worlds(2).run(lambda: consistency._EPOCH[0]) == [e + 1 for e in epochs]


def test_check_mode_follows_environment_and_override(monkeypatch):
    from shardfn.primitives import consistency

    monkeypatch.setenv("SHARDFN_CHECK", "0")
    for check, expected in ((None, False), (True, True)):
        with LocalWorld(1, check=check) as world:
            assert world.check is expected
            assert world.run(consistency.enabled) == [expected]


def _mesh_of_the_world() -> tuple:
    import os

    import shardfn as sf

    mesh = sf.Mesh({"dp": dist.get_world_size() if dist.is_initialized() else 1})
    return mesh.size("dp"), os.environ.get("WORLD_SIZE")


def test_a_world_started_under_torchrun_ignores_its_launch_variables(monkeypatch):
    # A notebook or test launched by torchrun: the workers must not see torchrun's world.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with LocalWorld(1) as world:
        assert world.run(_mesh_of_the_world) == [(1, None)]
