"""Several nodes (sharedmp.distributed): node leaders on loopback, averaging with torch.distributed (gloo).

Each node is a real leader process with its own spawned Hogwild workers, started as torchrun
would start it (its variables, its own process group), by ``python -m sharedmp demo --nodes``,
by ``torchrun`` itself, or by ``_distributed_leader.py`` for the failure cases. Every process
is bounded by a timeout and its whole group is killed on the way out; each test checks that
no leader (nor its workers) is left.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")
import torch  # noqa: E402
import torch.distributed  # noqa: E402

from sharedmp import distributed  # noqa: E402
from sharedmp.cli import main  # noqa: E402
from _helpers import children  # noqa: E402
from conftest import as_from_a_terminal, group_gone, signal_state  # noqa: E402

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 90            # seconds for a whole multi-node run, start-up included
N_TRAIN = 1348          # digits: 1,797 samples, 75 % for training
# The accuracy bar of the single-node run (test_training: 2 workers, 3 epochs, lr 0.1). Two
# nodes averaging every 2 steps move the weights by the mean of their updates, so they need
# about twice the passes over their half of the data to get as far.
SMALL = ["--workers", "2", "--hidden", "32", "--lr", "0.1", "--sync-every", "2"]
EPOCHS = 8
BAR = 0.85


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(rank, world, port):
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))



class Group:
    """Processes started in their own sessions; on exit, each group still there is SIGKILLed."""

    def __init__(self):
        self.procs = []

    def start(self, argv, env=None):
        proc = subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=env, cwd=HERE)
        self.procs.append(proc)
        return proc

    def communicate(self, proc, timeout, before_kill=None, context=""):
        try:
            return proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            if before_kill is not None:          # (e.g. SIGABRT: faulthandler prints the stacks)
                before_kill()
                time.sleep(1)
            self.__exit__()
            out, err = proc.communicate()
            pytest.fail(f"{proc.args} did not finish within {timeout} s {context}; its output:"
                        f"\n{out[-3000:]}\n{err[-12000:]}", pytrace=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.returncode is None:               # not reaped: its pid is still its own
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.communicate()


def leader(group, rank, world, port, how, timeout, victim=1, after=6):
    argv = [sys.executable, os.path.join(HERE, "_distributed_leader.py"), str(victim), how,
            str(after), str(timeout)]
    return group.start(argv, env=node_env(rank, world, port))


def wait_exit(proc, timeout):
    """Poll until ``proc`` exits; its exit time (monotonic). Fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            pytest.fail(f"{proc.args} still running after {timeout} s", pytrace=False)
        time.sleep(0.01)
    return time.monotonic()


def check_report(report, epochs):
    """What every multi-node run must show: trained, averaged, equal models, figures."""
    nodes = report["nodes"]
    assert [n["rank"] for n in nodes] == [0, 1]
    for n in nodes:
        assert n["workers"] == 2
        assert n["samples"] == epochs * N_TRAIN // 2      # each node trains on its half
        assert n["test_accuracy"] >= BAR                   # chance is 0.10
        assert n["rounds"] >= 2 and len(n["round_checksums"]) == n["rounds"]
        assert n["allreduce_seconds"] > 0 and n["samples_per_s"] > 0
        assert n["workers_see_final"]
    # Right after each round both nodes hold the very same weights (they trained on
    # different shards in between: without the all-reduce the checksums would differ),
    # and the weights moved from round to round.
    assert nodes[0]["round_checksums"] == nodes[1]["round_checksums"]
    assert len(set(nodes[0]["round_checksums"])) > 1
    assert nodes[0]["final_checksum"] == nodes[1]["final_checksum"] == nodes[0]["round_checksums"][-1]
    assert report["models_equal_after_each_round"] and report["models_equal_at_end"]
    assert report["samples"] == epochs * N_TRAIN
    for n in nodes:                                       # leaders and their workers are gone
        assert group_gone(n["pid"]), f"node {n['rank']} (pid {n['pid']}) is still running"


# -------------------------------------------------------------------- the normal runs

def test_two_simulated_nodes_on_loopback(tmp_path):
    js = tmp_path / "nodes.json"
    with Group() as g:
        proc = g.start([sys.executable, "-m", "sharedmp", "demo", "--nodes", "2", *SMALL,
                        "--epochs", str(EPOCHS), "--json", str(js)])
        out, err = g.communicate(proc, TIMEOUT)
    assert proc.returncode == 0, err
    for row in ("nodes", "node 0", "node 1", "averaging", "test accuracy", "samples/s", "all-reduce"):
        assert f"\n{row} " in "\n" + out, (row, out)
    assert "node models equal after every round: yes; at the end: yes" in out
    report = json.loads(js.read_text())
    check_report(report, EPOCHS)
    assert report["runs"][0]["node"] == 0 and report["backend"] == "gloo"


def test_torchrun_command_line(tmp_path):
    """The README's two-machine command, both 'machines' on loopback: one torchrun per node."""
    js = tmp_path / "torchrun.json"
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this Python")
    with Group() as g:
        procs = [g.start([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                          "--master-addr", "127.0.0.1", "--master-port", str(port),
                          "-m", "sharedmp", "demo", *SMALL, "--epochs", str(EPOCHS), "--json", str(js)])
                 for r in (0, 1)]
        results = [g.communicate(p, TIMEOUT) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    assert "node models equal after every round: yes" in results[0][0]
    assert results[1][0] == ""                            # node 1 prints nothing when all goes well
    check_report(json.loads(js.read_text()), EPOCHS)


# ----------------------------------------------------------------------------- failures

@pytest.mark.parametrize("victim", [1, 0], ids=["node 1", "node 0 (hosts the store)"])
def test_node_killed_mid_run_stops_the_other_with_a_clear_error(victim):
    """SIGKILL of one node's whole process group (from its worker, after 3 rounds)."""
    port = free_port()
    with Group() as g:
        nodes = [leader(g, rank, 2, port, "kill", timeout=60, victim=victim) for rank in (0, 1)]
        dead, alive = nodes[victim], nodes[1 - victim]
        wait_exit(dead, TIMEOUT)
        killed = time.time()                              # within 10 ms of the kill
        wait_exit(alive, 40)
        ended = time.time()
        _, err = alive.communicate()
        dead.communicate()
    assert dead.returncode == -signal.SIGKILL
    assert alive.returncode == 3, err
    # gloo sees the closed connection at once, far sooner than the 60 s timeout.
    raised = float(err.split("NodeLost at ")[1].split(",")[0])
    print(f"node {1 - victim} raised NodeLost {raised - killed:+.2f} s after node {victim} was killed, "
          f"stopped its workers and exited {ended - killed:.2f} s after")
    assert ended - killed < 30
    assert f"node {1 - victim} of 2 lost contact with node rank {victim} (host " in err
    assert f"pid {dead.pid})" in err and "during averaging round" in err
    assert "restart every node" in err and "Traceback" not in err
    assert group_gone(alive.pid) and group_gone(dead.pid)


def test_node_that_hangs_ends_both_after_the_timeout():
    """A worker of node 1 never returns: node 1 gives up on it, node 0 on node 1, both in time."""
    port = free_port()
    t0 = time.monotonic()
    with Group() as g:
        node0 = leader(g, 0, 2, port, "hang", timeout=5)
        node1 = leader(g, 1, 2, port, "hang", timeout=5)
        _, err0 = g.communicate(node0, TIMEOUT)
        _, err1 = g.communicate(node1, TIMEOUT)
    assert node0.returncode == 3, err0
    assert node1.returncode == 4, err1
    assert "lost contact with node rank 1" in err0 and "raise --dist-timeout (now 5 s)" in err0
    assert "node 1: worker(s) " in err1 and "did not reach averaging round" in err1
    assert "within 5 s" in err1
    assert time.monotonic() - t0 < TIMEOUT
    assert group_gone(node0.pid) and group_gone(node1.pid)


def test_launcher_reports_a_killed_node_and_the_other_stops(tmp_path):
    """``demo --nodes 2``: node 1's group SIGKILLed from outside once its workers run."""
    with Group() as g:
        proc = g.start([sys.executable, "-m", "sharedmp", "demo", "--nodes", "2", *SMALL,
                        "--epochs", "100000", "--dist-timeout", "60"])
        leaders = wait_for_workers(proc)
        time.sleep(3)                                     # into training (or still starting)
        os.killpg(leaders[1], signal.SIGKILL)
        out, err = g.communicate(proc, 60)
    assert proc.returncode == 1, err
    assert f"launcher: node 1 (pid {leaders[1]}) was killed by SIGKILL" in err
    assert f"node 0: error: node 0 of 2 lost contact with node rank 1 (host {socket.gethostname()}, " \
           f"pid {leaders[1]})" in err
    assert "did not stop within" not in err               # node 0 stopped by itself
    assert all(group_gone(pid) for pid in leaders.values())


def test_ctrl_c_stops_every_node():
    """SIGINT to the launcher's group, as a terminal's Ctrl-C: passed on, exit 130, nothing left."""
    with Group() as g:
        proc = g.start(as_from_a_terminal([sys.executable, "-m", "sharedmp", "demo", "--nodes",
                                           "2", *SMALL, "--epochs", "100000"]))
        leaders = wait_for_workers(proc)
        time.sleep(3)
        state = [signal_state(pid) for pid in (proc.pid, *leaders.values())]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = g.communicate(proc, 60, before_kill=lambda: [
            os.kill(pid, signal.SIGABRT) for pid in (proc.pid, *leaders.values())],
            context=f"signals at SIGINT (launcher, leaders): {state}")
    assert proc.returncode == 130, err
    assert "node 0: interrupted: the workers were stopped" in err
    assert "node 1: interrupted: the workers were stopped" in err
    assert "interrupted: every node was stopped" in err and "Traceback" not in err
    assert all(group_gone(pid) for pid in leaders.values())


def wait_for_workers(proc):
    """{rank: pid} of the launcher's leaders, once each has its 2 workers."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        leaders = {rank_of(pid): pid for pid in children(proc.pid)}
        if len(leaders) == 2 and all(len(children(pid)) >= 2 for pid in leaders.values()):
            return leaders
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)



def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def test_node_alone_gives_up_joining_after_the_timeout():
    """Node 0 of 2 whose peer never comes: a clear error after --dist-timeout, not a hang."""
    with Group() as g:
        proc = g.start([sys.executable, "-m", "sharedmp", "demo", *SMALL, "--dist-timeout", "3"],
                       env=node_env(0, 2, free_port()))
        out, err = g.communicate(proc, 60)
    assert proc.returncode == 1, err
    assert "node 0: error: node 0 of 2 could not join the other nodes at 127.0.0.1:" in err
    assert "--master-addr and --master-port" in err and "Traceback" not in err


# ------------------------------------------------------------------------ bad settings

@pytest.mark.parametrize("env, match", [
    ({}, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set: start one leader per node with torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"must be in \[0, WORLD_SIZE\)"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "not a TCP port"),
])
def test_node_env_says_what_is_wrong(env, match):
    with pytest.raises(ValueError, match=match):
        distributed.NodeEnv.from_env(env)


def test_node_env_reads_torchrun_variables():
    env = distributed.NodeEnv.from_env({"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
                                        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert env == distributed.NodeEnv(1, 3, 0, "10.0.0.1", 29500)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backend="mpi"), "unknown backend 'mpi'; choose gloo"),
    (dict(every=0), "every .* must be a positive integer"),
    (dict(timeout=0), "timeout must be positive"),
])
def test_node_bad_settings_raise_before_joining(kwargs, match):
    with pytest.raises(ValueError, match=match):
        distributed.Node(distributed.NodeEnv(0, 2, 0, "127.0.0.1", 1), **kwargs)
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_nccl_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="the nccl backend needs a CUDA GPU on every node; use gloo"):
        distributed.Node(distributed.NodeEnv(0, 2, 0, "127.0.0.1", 1), backend="nccl")


@pytest.mark.parametrize("args, expected", [
    (["--nodes", "0"], "--nodes must be at least 1"),
    (["--sync-every", "0"], "--sync-every must be at least 1"),
    (["--dist-timeout", "-1"], "--dist-timeout must be positive"),
    (["--nodes", "2", "--compare"], "--compare runs on one node only"),
])
def test_bad_node_arguments(capsys, args, expected):
    assert main(["demo", *args]) == 2
    assert expected in capsys.readouterr().err
