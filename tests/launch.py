"""Launching the method scripts on the CPU testbed from tests: flags, the fork server (or python and torchrun), run
directories, metrics."""

import atexit
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from testbed.common import CPU_ENV, read_jsonl
from testbed.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_flags(tb, **overrides) -> list:
    flags = {
        "model-name-or-path": tb.model_dir,
        "dataset": tb.train_file,
        "total-steps": 2,
        "num-prompts-per-step": 4,
        "group-size": 4,
        "max-prompt-length": 128,
        "max-response-length": 40,
        "num-mini-batches": 1,
        "micro-batch-size": 8,
        "learning-rate": 5e-4,
        "save-every": 0,
        "eval-every": 0,
        "logprob-chunk-size": 16,
        "grading-workers": 1,  # a pool start-up (~2 s of CPU) outweighs grading 16 answers; test_e2e.py uses one
    }
    flags.update(overrides)
    out = []
    for key, value in flags.items():
        out += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return out


def script_argv(script, flags, output_dir, fault=None, env=None):
    """(argv after the interpreter, environment) of a run of `script`, optionally with a fault injected by
    tests/inject.py (GRPO_FAULT syntax); the environment names a free MASTER_PORT for runs on several ranks."""
    entry = [os.path.join(ROOT, "tests", "inject.py")] if fault else []
    argv = [*entry, os.path.join(ROOT, script), "--output-dir", str(output_dir), *flags]
    env = {**os.environ, **CPU_ENV, "MASTER_PORT": str(free_port()), "WANDB_DIR": str(output_dir), **(env or {})}
    if fault:
        env["GRPO_FAULT"] = fault
    return argv, env


def plain_command(argv, env, nproc=0) -> list:
    """The command line that runs argv on `nproc` CPU processes under torchrun, or as one plain `python script`
    (nproc 0: no launcher)."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", env["MASTER_PORT"]]
    return [sys.executable, *(launcher if nproc else []), *argv]


def run_script(script, flags, output_dir, nproc=0, timeout=600, check=True, fault=None, env=None, plain=False):
    """Run `script` (see script_argv) through run_python and wait for it; return the finished process."""
    argv, env = script_argv(script, flags, output_dir, fault, env)
    proc = run_python(argv, env, nproc, timeout, plain=plain)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


# environment variables the libraries read only when a run uses them: they may differ from the fork server's
LAZY = {"MASTER_PORT", "WANDB_DIR", "WANDB_MODE", "WANDB_TAGS", "GRPO_FAULT", "GRPO_RATIO", "PYTEST_CURRENT_TEST"}
_server = {}


def run_python(argv, env, nproc=0, timeout=600, cwd=ROOT, plain=False) -> subprocess.CompletedProcess:
    """`python *argv` in `env` (on `nproc` ranks when > 0), forked from this worker's fork server (ForkedRun). With
    `plain`, or an environment that differs from the CPU test environment in more than the LAZY keys, plain_command's
    command line instead (a plain interpreter, torchrun for ranks)."""
    base = {**os.environ, **CPU_ENV}
    if plain or any(env.get(k) != base.get(k) for k in (env.keys() | base.keys()) - LAZY):
        cmd = plain_command(argv, env, nproc)
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    run = ForkedRun(argv, env, nproc, cwd)
    out, err = run.communicate(timeout)
    return subprocess.CompletedProcess(argv, run.returncode, out, err)


def fork_server() -> subprocess.Popen:
    """This worker's fork server, started in the CPU test environment if it is not running (its stderr in a log file
    that a failure quotes)."""
    server = _server.get("proc")
    if server is None or server.poll() is not None:
        log = tempfile.NamedTemporaryFile(prefix="forkserver-", suffix=".log", delete=False)
        server = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "forkserver.py")],
            cwd=ROOT,
            env={**os.environ, **CPU_ENV},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            bufsize=0,  # unbuffered: a reply read ahead into a buffer would hide from select()
            start_new_session=True,  # its own process group: a timeout kills the server and every run it forked
        )
        _server.update(proc=server, log=log.name)
        atexit.register(os.remove, log.name)
        atexit.register(server.kill)
    return server


class ForkedRun:
    """`python *argv` on `nproc` ranks forked from this worker's fork server (tests/forkserver.py, fork_server), with
    what the tests use of subprocess.Popen: poll(), communicate(), returncode; `pids`: its processes (rank 0 first)."""

    def __init__(self, argv, env, nproc=0, cwd=ROOT):
        sys.audit("tests.launch", argv)  # a run, though the fork server may be up already (conftest.py's guard)
        server = self.server = fork_server()
        self.argv, self.returncode = argv, None
        self.tmp = tempfile.mkdtemp(prefix="forked-")
        self.out, self.err = os.path.join(self.tmp, "stdout"), os.path.join(self.tmp, "stderr")
        for path in (self.out, self.err):
            open(path, "w").close()
        request = {"argv": argv, "env": env, "cwd": str(cwd), "nproc": nproc, "stdout": self.out, "stderr": self.err}
        server.stdin.write(json.dumps(request).encode() + b"\n")
        self.pids = self._reply(120)["pids"]

    def _reply(self, timeout):
        if not select.select([self.server.stdout], [], [], timeout)[0]:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
            raise subprocess.TimeoutExpired(self.argv, timeout)
        line = self.server.stdout.readline()
        if not line:
            with open(_server["log"]) as f:
                raise RuntimeError(f"the fork server exited {self.server.wait()}:\n{f.read()[-3000:]}")
        return json.loads(line)

    def poll(self):
        if self.returncode is None and select.select([self.server.stdout], [], [], 0)[0]:
            self.returncode = self._reply(0)["returncode"]
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) of every rank, once the run has ended."""
        if self.returncode is None:
            self.returncode = self._reply(timeout)["returncode"]
        with open(self.out) as f, open(self.err) as g:
            out, err = f.read(), g.read()
        shutil.rmtree(self.tmp)
        return out, err


def run_dir(output_dir) -> str:
    (name,) = [d for d in os.listdir(output_dir) if d != "wandb"]
    return os.path.join(output_dir, name)


def read_metrics(path) -> list:
    return read_jsonl(os.path.join(path, "metrics.jsonl"))


def final_weights(path) -> dict:
    return load_file(os.path.join(path, "final", "model.safetensors"))


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file (LevelDB-style: 32 KiB blocks of checksummed parts)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, block, chunks = 7, 32768, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


# 2 optimizer updates per step (KL-Cov needs >= 2 per rollout batch), a checkpoint after every step
COMMON = {"total-steps": 4, "num-mini-batches": 2, "micro-batch-size": 4, "save-every": 1, "keep-checkpoints": 2}
METHOD = {  # each method's state and selections made non-trivial on 4 steps; vLLM where generation is the kill point
    "grpo_vanilla.py": {},
    "grpo_aent.py": {
        "no-use-vllm": True,
        "entropy-coef-warmup": 0,
        "entropy-low": 0.5,
        "entropy-high": 0.6,
        "entropy-coef-lr": 0.01,
    },
    "grpo_klcov.py": {"no-use-vllm": True, "kl-cov-ratio": 0.2},
    "grpo_clipcov.py": {"no-use-vllm": True, "clip-cov-ratio": 0.2, "clip-cov-lb": 0, "clip-cov-ub": 5},
}


def fault_flags(tb, script, **overrides):
    """script_flags for the fault tests: 4 steps, 2 updates per step, a checkpoint after every step."""
    return script_flags(tb, **{**COMMON, **METHOD[script], **overrides})


# a rollout rank's sampler log-probs against the trainer's on the same weights (~5e-7 on CPU); one update stale is more
NOISE = 1e-5


def rollout_flags(tb, script, staleness=1, **overrides):
    """fault_flags with the engines on one rollout rank (--rollout-ranks 1, --max-staleness `staleness`): vLLM."""
    method = {k: v for k, v in METHOD.get(script, {}).items() if k != "no-use-vllm"}
    return script_flags(tb, **{**COMMON, **method, "rollout-ranks": 1, "max-staleness": staleness, **overrides})


def checkpoints(path):
    return sorted(os.listdir(os.path.join(path, "checkpoints")))


def trainer_state(path, step=None):
    name = f"step_{step:07d}" if step else checkpoints(path)[-1]
    with open(os.path.join(path, "checkpoints", name, "trainer_state.json")) as f:
        return json.load(f)


def assert_same_run(a, b):
    """Same metrics (all but timings) at every step, same method state, same final weights."""
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert {k for k in x if not k.startswith("time/")} == {k for k in y if not k.startswith("time/")}
        for key in x:
            if not key.startswith(("time/", "charts/tokens_per_second")):
                assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)
    assert trainer_state(a)["method_state"] == pytest.approx(trainer_state(b)["method_state"], rel=1e-5)
    wa, wb = final_weights(a), final_weights(b)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
