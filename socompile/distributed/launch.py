"""Run a function on N local ranks (subprocesses on 127.0.0.1), for tests, benchmarks and quick checks.

    results = run_local("tests/test_dist_ulysses.py:check_forward", nprocs=2, args={"seq": 32})

Each rank is a fresh ``python -m socompile.distributed.launch`` with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>), so the target uses
``init_distributed()`` exactly as under torchrun. The function gets the ``args`` dict and returns something
JSON-serialisable; ``run_local`` returns each rank's exit code, result, output and wall time. Nothing is
left running: ranks still alive at ``timeout_s`` are killed (and reported as timed out).

The same entry point runs under a real ``torchrun`` (one node or several)::

    torchrun --nproc-per-node 2 -m socompile.distributed.launch tests/test_dist_launch.py:_zero_train '{}' 'out/rank{rank}.json'

``{rank}`` in the output path is replaced by the rank's RANK: torchrun gives every rank the same arguments.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None     # None: killed at the launcher's timeout
    result: Any
    output: str
    seconds: float


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(target: str, nprocs: int = 2, args: dict | None = None, timeout_s: float = 120.0,
              threads_per_rank: int = 1, env: dict | None = None) -> list[RankResult]:
    """Start ``nprocs`` ranks running ``target`` ("path/to/file.py:function" or "package.module:function")."""
    port = free_port()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="socompile-dist-"))
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(nprocs):
        rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads_per_rank)}
        log = open(workdir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "socompile.distributed.launch", target, json.dumps(args or {}),
             str(workdir / f"rank{rank}.json")], env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    ended: dict[int, float] = {}
    while len(ended) < nprocs and time.monotonic() - start < timeout_s:
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.monotonic() - start
        time.sleep(0.05)
    results = []
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        logs[rank].seek(0)
        output = logs[rank].read()
        logs[rank].close()
        path = workdir / f"rank{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else None
        results.append(RankResult(rank, proc.returncode if rank in ended else None, result, output,
                                  ended.get(rank, timeout_s)))
    return results


@dataclasses.dataclass
class CommandResult:
    argv: list[str]
    returncode: int | None     # None: killed at the timeout, or because another command failed
    output: str                # stdout and stderr together
    seconds: float


def run_commands(commands: list[list[str]], timeout_s: float = 120.0, env: dict | None = None,
                 cwd: str | os.PathLike | None = None) -> list[CommandResult]:
    """Run ``commands`` at once (e.g. one ``torchrun`` per "node" of a multi-node job on this machine) and wait
    for all of them. Fails fast, never hangs: once one exits non-zero, or ``timeout_s`` passes, every command
    still running is killed with its whole process group (torchrun's ranks too)."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="socompile-cmd-"))
    logs = [open(workdir / f"command{i}.log", "w+") for i in range(len(commands))]
    procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for argv, log in zip(commands, logs)]
    start = time.monotonic()
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() - start < timeout_s:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic() - start
        if any(procs[i].returncode != 0 for i in ended):
            break
        time.sleep(0.05)
    results = []
    for i, (argv, proc, log) in enumerate(zip(commands, procs, logs)):
        if proc.poll() is None:
            _kill_session(proc)
        log.seek(0)
        results.append(CommandResult(argv, proc.returncode if i in ended else None, log.read(),
                                     ended.get(i, time.monotonic() - start)))
        log.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and everything it started (it leads its own session: start_new_session=True)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _load(target: str):
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(pathlib.Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(pathlib.Path(where).resolve().parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _main(argv: list[str]) -> int:
    target, args = argv[0], json.loads(argv[1])
    out = argv[2].replace("{rank}", os.environ.get("RANK", "0"))
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = _load(target)(args)
    pathlib.Path(out).write_text(json.dumps(result))
    # Tear the process group down before the interpreter does: left to exit-time destruction, gloo's threads
    # can outlive what they use once a peer has gone, and the rank aborts ("terminate called without an
    # active exception", exit -6) after its result was written.
    from .mesh import shutdown
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
