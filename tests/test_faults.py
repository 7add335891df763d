"""Faults through a real `duelq serve` process: SIGKILL and SIGTERM mid-stream, restart.

What is checked, with the reference backend and a sequential replay as the oracle:

* after SIGKILL, the newest checkpoint holds exactly the batches whose answers
  (first acknowledgement, or a replayed one after the restart) carry a step at
  or below its step, bit for bit; every batch gets exactly one answer; the
  restarted server continues from the checkpoint and a key applied before it
  is answered ``replayed``, not applied again;
* after SIGTERM mid-stream, nothing acknowledged is lost and the resumed run is
  bit-identical to one never stopped;
* a client killed mid-stream costs only its own stream.
"""

from __future__ import annotations

import os
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from duelq.client import LearnerClient, encode_batch
from duelq.server.core.checkpoint import read_latest
from duelq.server.core.learner import Learner
from duelq.server.core.state import LearnerState
from duelq.server.fronts import start_server
from duelq.server.server import MALLOC_SETTINGS, ServerOptions
from duelq.v1 import learner_pb2 as pb
from duelq.v1 import learner_pb2_grpc as pb_grpc

from conftest import SMALL, random_batch

#: `duelq serve` flags that make the SMALL config.
SMALL_FLAGS = ("--hidden-dim", str(SMALL.hidden_dim), "--n-actions", str(SMALL.n_actions),
               "--lr", str(SMALL.lr), "--step-entropy-slot", SMALL.step_entropy_slot)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `duelq serve` subprocess on a fixed port; stderr is collected by a thread."""

    def __init__(self, port: int, *flags: str):
        # Serving once the public server says so: with --front-process, the learner process
        # says "serving" before the front has its relay.
        self._serving = ("serving duelq.v1.Learner from " if "--front-processes" in flags
                         else "serving duelq.v1.Learner")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "duelq.apps.cli", "serve", "--port", str(port),
             "--backend", "reference", "--grace-s", "1", *SMALL_FLAGS, *flags],
            stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.target = f"127.0.0.1:{port}"

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self._serving not in self.log:
            assert self.process.poll() is None, self.log
            assert time.monotonic() < deadline, self.log
            time.sleep(0.02)

    def stop(self, signum: int, timeout: float = 30) -> int:
        self.process.send_signal(signum)
        return self.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        code = self.process.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


class CountingClient(LearnerClient):
    """A LearnerClient that counts its reconnection back-offs (one per failed attempt)."""

    reconnects = 0

    def _sleep(self, attempt: int) -> None:
        self.reconnects += 1
        super()._sleep(attempt)


def replay(order: list) -> LearnerState:
    """The state after applying ``order`` (batches) one by one, never stopped."""
    learner = Learner(SMALL, backend="reference")
    for batch in order:
        learner.step(batch)
    return learner.snapshot()


def test_sigkill_mid_stream_loses_nothing_acknowledged_before_the_last_checkpoint(tmp_path):
    actors, per_actor, kill_after = 3, 120, 150
    port, directory = free_port(), tmp_path / "ckpt"
    batches = {a: [random_batch(np.random.default_rng(10 + a), 8) for _ in range(per_actor)]
               for a in range(actors)}
    answers: dict[int, list[tuple[int, int, int, bool, int]]] = {a: [] for a in range(actors)}
    failures: list[BaseException] = []

    def actor(a: int) -> None:
        try:
            with CountingClient(f"127.0.0.1:{port}", actor_id=f"actor-{a}", retries=60,
                                backoff=0.05, max_backoff=0.25) as client:
                for i, r in enumerate(client.train_stream(batches[a], window=4)):
                    life = 2 if client.reconnects else 1
                    answers[a].append((i, r.seq, r.step, r.replayed, life))
                    time.sleep(0.002)  # actors that also act: the kill lands mid-stream
        except BaseException as exc:  # noqa: BLE001 — reported below
            failures.append(exc)

    first = Served(port, "--checkpoint-dir", str(directory), "--checkpoint-every-steps", "40")
    second = None
    try:
        first.wait_serving()
        threads = [threading.Thread(target=actor, args=(a,)) for a in range(actors)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(map(len, answers.values())) < kill_after and time.monotonic() < deadline:
            time.sleep(0.005)
        first.process.send_signal(signal.SIGKILL)
        assert first.process.wait(10) == -signal.SIGKILL
        acked_before_kill = max(s for a in answers.values() for _, _, s, _, _ in a)
        saved = read_latest(directory, SMALL)
        assert saved is not None, first.log
        S = saved.state.step
        assert 40 <= S <= acked_before_kill + 4 * actors

        second = Served(port, "--checkpoint-dir", str(directory))
        for t in threads:
            t.join(90)
        assert not failures, (failures, second.log)
        assert f"resuming from {saved.path}: step {S}" in second.log

        # Every batch answered exactly once, in order, under its own key.
        for a in range(actors):
            assert [(i, seq) for i, seq, *_ in answers[a]] == [(i, i + 1) for i in range(per_actor)]
        by_step: dict[int, tuple[int, int]] = {}
        lost = 0
        for a, rows in answers.items():
            for i, _, step, replayed, life in rows:
                if step <= S:                 # in the checkpoint: acked before, or replayed after
                    assert step not in by_step
                    by_step[step] = (a, i)
                elif life == 1:               # acknowledged after the checkpoint: lost with the kill
                    lost += 1
                else:                         # applied by the restarted server
                    assert not replayed and step not in by_step
                    by_step[step] = (a, i)
        final = S + sum(1 for rows in answers.values() for *_, step, replayed, life in rows
                        if life == 2 and step > S)
        assert sorted(by_step) == list(range(1, final + 1))
        in_checkpoint = [batches[a][i] for a, i in (by_step[s] for s in range(1, S + 1))]
        assert saved.state.checksum() == replay(in_checkpoint).checksum()

        # A key applied before the checkpoint is answered from the restored records.
        a, i = by_step[S]
        request = encode_batch(batches[a][i])
        request.key.CopyFrom(pb.RequestKey(actor_id=f"actor-{a}", seq=i + 1))
        with grpc.insecure_channel(second.target) as channel:
            again = pb_grpc.LearnerStub(channel).TrainStep(request, timeout=10)
            info = pb_grpc.LearnerStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)
        assert (again.replayed, again.step, info.step) == (True, S, final)

        assert second.stop(signal.SIGTERM) == 0, second.log
        end = read_latest(directory, SMALL)
        assert end.state.step == final
        order = [batches[a][i] for a, i in (by_step[s] for s in range(1, final + 1))]
        assert end.state.checksum() == replay(order).checksum()
    finally:
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.parametrize("front", [(), ("--front-processes", "1"),
                                   ("--front-processes", "2")],
                         ids=["one-process", "front-process", "two-front-processes"])
def test_sigterm_mid_stream_drains_checkpoints_and_resumes_bit_identically(tmp_path, front):
    port, directory, count = free_port(), tmp_path / "ckpt", 160
    rng = np.random.default_rng(3)
    batches = [random_batch(rng, 8) for _ in range(count)]
    answers: list[tuple[int, int, bool, int]] = []
    failures: list[BaseException] = []
    stopping = threading.Event()

    def paced():   # the last 100 only once the first server drains, and slowly: mid-stream
        # (while the client waits for the next batch it reads no answers: ≥ 60 − window)
        for k, batch in enumerate(batches):
            if k == 60:
                stopping.wait(30)
            elif k > 60:
                time.sleep(0.002)
            yield batch

    def actor() -> None:
        try:
            with CountingClient(f"127.0.0.1:{port}", actor_id="solo", retries=60, backoff=0.05,
                                max_backoff=0.25) as client:
                for r in client.train_stream(paced(), window=8):
                    answers.append((r.seq, r.step, r.replayed, 2 if client.reconnects else 1))
        except BaseException as exc:  # noqa: BLE001 — reported below
            failures.append(exc)

    first = Served(port, "--checkpoint-dir", str(directory), *front)
    second = None
    try:
        first.wait_serving()
        thread = threading.Thread(target=actor)
        thread.start()
        while len(answers) < 60 - 8 and thread.is_alive():   # the client waits in paced()
            time.sleep(0.002)
        first.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "draining" not in first.log and time.monotonic() < deadline:
            time.sleep(0.002)
        stopping.set()
        assert first.wait() == 0, first.log
        assert "SIGTERM received" in first.log and "final checkpoint" in first.log
        stopped = read_latest(directory, SMALL)
        second = Served(port, "--checkpoint-dir", str(directory), *front)
        thread.join(90)
        assert not failures, (failures, second.log)

        # Drained: everything acknowledged by the first server is in its final checkpoint.
        assert max(step for _, step, _, life in answers if life == 1) <= stopped.state.step
        assert f"resuming from {stopped.path}: step {stopped.state.step}" in second.log
        # One stream, nothing lost: batch k is step k, whichever server answered it.
        assert [(seq, step) for seq, step, _, _ in answers] == [(k, k) for k in range(1, count + 1)]
        assert any(life == 2 for *_, life in answers)

        assert second.stop(signal.SIGTERM) == 0, second.log
        end = read_latest(directory, SMALL)
        never_stopped = replay(batches)
        assert end.state.step == count
        assert end.state.checksum() == never_stopped.checksum()
        assert np.array_equal(end.state.params.w_a, never_stopped.params.w_a)
    finally:
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.parametrize("fronts", [0, 1], ids=["one-process", "front-process"])
def test_a_stopping_server_takes_no_new_calls_while_it_drains(fronts):
    """gRPC stops taking calls as the drain begins, not after it: clients that the drain
    answers UNAVAILABLE retry at once, and a call of theirs that came just as gRPC shut down
    would be cancelled (CANCELLED, which no client retries), so they must find the port
    closed meanwhile.  The drain is held by a step that holds the learner.  A connected
    client's next call is UNAVAILABLE once it has read the server's GOAWAY (its channel
    leaves READY); one sent before that may be CANCELLED by gRPC itself (grpc/grpc#41785),
    so the test waits for it."""
    from test_hostile import learner_held
    server = start_server(SMALL, ServerOptions(port=0, front_processes=fronts, grace_s=30),
                          backend="reference")
    stopper = threading.Thread(target=server.stop)
    try:
        with grpc.insecure_channel(server.target) as channel:   # connected before the stop
            stub = pb_grpc.LearnerStub(channel)
            stub.GetInfo(pb.GetInfoRequest(), timeout=30)
            states = queue.SimpleQueue()
            channel.subscribe(states.put)
            with learner_held(server, applied=False):
                stopper.start()
                deadline = time.monotonic() + 30
                while True:   # until the port is closed, the learner still held
                    try:
                        socket.create_connection(("127.0.0.1", server.port), 1).close()
                    except ConnectionRefusedError:
                        break
                    except ConnectionResetError:   # the listener closed as this one queued
                        pass
                    assert time.monotonic() < deadline, "the port stays open while it drains"
                    time.sleep(0.01)
                while states.get(timeout=30) == grpc.ChannelConnectivity.READY:
                    pass   # the GOAWAY not read yet
                with pytest.raises(grpc.RpcError) as turned_away:
                    stub.GetInfo(pb.GetInfoRequest(), timeout=30)
                assert turned_away.value.code() == grpc.StatusCode.UNAVAILABLE
        stopper.join(60)
        assert not stopper.is_alive()
    finally:
        if not stopper.is_alive() and stopper.ident is None:
            server.stop(0)


DOOMED = textwrap.dedent("""
    import itertools, sys
    import numpy as np
    from duelq.client import LearnerClient
    from conftest import random_batch
    rng = np.random.default_rng(0)
    batches = (random_batch(rng, 8) for _ in itertools.count())
    with LearnerClient(sys.argv[1], actor_id="doomed") as client:
        for result in client.train_stream(batches, window=8):
            print("acked", result.seq, flush=True)
""")


@pytest.mark.parametrize("fronts", [1, 2])
def test_a_killed_front_process_leaves_no_socket_folder(monkeypatch, fronts):
    """SIGKILL gives the (first) front no chance to clean up: its learner process, which then
    stops (without a final checkpoint), removes the folder of its private sockets, and the
    other fronts stop too (every process that shares the log's pipe has exited)."""
    temp = Path(tempfile.mkdtemp(prefix="dq-", dir="/tmp"))   # short: a socket path ≤ 107 B
    monkeypatch.setenv("TMPDIR", str(temp))
    served = Served(free_port(), "--front-processes", str(fronts))
    try:
        served.wait_serving()
        folders = list(temp.glob("duelq-*"))
        assert len(folders) == 1 and (folders[0] / "learner.sock").exists()
        served.kill()
        deadline = time.monotonic() + 30
        while folders[0].exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not folders[0].exists(), served.log
        served._reader.join(15)
        assert not served._reader.is_alive(), served.log
        assert "the front process went away" in served.log and "Traceback" not in served.log
    finally:
        served.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_starts_its_processes_with_the_malloc_settings(monkeypatch):
    """`duelq serve` keeps request-sized buffers in glibc's heap in the learner and front
    processes it starts (they inherit MALLOC_SETTINGS through the environment)."""
    for name in MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    served = Served(free_port(), "--front-processes", "2")
    try:
        served.wait_serving()
        tasks = Path(f"/proc/{served.process.pid}/task")
        if not (tasks / str(served.process.pid) / "children").exists():
            pytest.skip("no /proc/<pid>/task/<tid>/children on this kernel")
        children = [pid for task in tasks.iterdir()
                    for pid in (task / "children").read_text().split()]
        assert len(children) >= 2, children   # the learner process and the second front
        want = {f"{name}={value}".encode() for name, value in MALLOC_SETTINGS.items()}
        for pid in children:
            assert want <= set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")), pid
    finally:
        served.stop(signal.SIGTERM)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_tune_malloc_keeps_a_setting_the_environment_has():
    """In a process of its own (the settings are process-wide and irreversible)."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_SETTINGS}
    env["MALLOC_MMAP_THRESHOLD_"] = str(4 << 20)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os
        from duelq.server.server import tune_malloc
        print(tune_malloc(), os.environ["MALLOC_MMAP_THRESHOLD_"],
              os.environ["MALLOC_TRIM_THRESHOLD_"])
        """)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    trim = MALLOC_SETTINGS["MALLOC_TRIM_THRESHOLD_"]
    assert done.stdout.split() == ["True", str(4 << 20), str(trim)]


def test_a_client_killed_mid_stream_costs_only_its_own_stream(make_server):
    server = make_server(max_streams=2, max_rpcs=4)
    doomed = subprocess.Popen([sys.executable, "-c", DOOMED, server.target],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
    steady_results, failures = [], []

    def paced(rng):
        for _ in range(150):
            time.sleep(0.01)
            yield random_batch(rng, 8)

    def steady() -> None:
        try:
            with LearnerClient(server.target, actor_id="steady") as client:
                steady_results.extend(client.train_stream(paced(np.random.default_rng(1)),
                                                          window=4))
        except BaseException as exc:  # noqa: BLE001 — reported below
            failures.append(exc)

    thread = threading.Thread(target=steady)
    try:
        for line in doomed.stdout:           # both streams are open and training
            if line.startswith("acked 30"):
                break
        thread.start()
        while len(steady_results) < 5 and thread.is_alive():
            time.sleep(0.01)
        doomed.kill()
        doomed.wait(10)
        # Its stream slot comes back while the steady stream goes on: a new stream fits.
        deadline, opened = time.monotonic() + 10, None
        with LearnerClient(server.target, actor_id="newcomer") as client:
            while opened is None:
                try:
                    opened = list(client.train_stream([random_batch(np.random.default_rng(2),
                                                                    8)]))
                except Exception:  # noqa: BLE001 — RESOURCE_EXHAUSTED until the slot is freed
                    assert time.monotonic() < deadline, "the killed client's stream slot leaked"
                    time.sleep(0.05)
        assert thread.is_alive(), "the steady stream ended before the check"
        thread.join(30)
    finally:
        doomed.kill()
    assert not failures
    steps = [r.step for r in steady_results]
    assert len(steps) == 150 and steps == sorted(steps) and len(set(steps)) == 150
    assert not any(r.replayed for r in steady_results)
    assert server.learner.step_count >= 30 + 150 + 1
