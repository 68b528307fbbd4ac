"""A rollout rank's life with --rollout-ranks (utils/split_launch.py: the split world, the trainers' RolloutClient, the
messages): it starts its part of a vLLM engine and runs trainer 0's commands until "stop", collecting the batches of
the trainer ranks it plays (utils/rollouts.py collect_for, the script's generate), loading weights, generating for
evaluation; a sender thread delivers the batches while it generates the next ones. Knows no method."""

import os
import sys
import threading
from queue import Queue

import torch.distributed as dist

from . import rollouts
from .process import StopSignal, shutdown
from .sampler import make_sampler
from .split_launch import broadcast, receive_group, send
from .vllm_engine import check_written, load_group

_told, _telling = threading.Event(), threading.Lock()


def _say_once(line: str) -> None:
    """The one line of a rollout rank whose peer is gone, from whichever of its threads finds it first: when trainer 0
    is killed both may (the main thread on `link`, the sender on `bridge`); the other adds no line. Each then ends the
    process (os._exit), so the second waits here until the first has printed: returning at once, its os._exit could
    end the process between the first's taking its turn and its line reaching stderr (the rank would stop silently)."""
    with _telling:
        if not _told.is_set():
            print(line, file=sys.stderr, flush=True)
            _told.set()


class _Sender(threading.Thread):
    """Sends queued (trainer rank, message) pairs in order, so that the rollout rank goes on generating."""

    def __init__(self, launch):
        super().__init__(daemon=True)
        self.queue, self.launch = Queue(), launch
        self.start()

    def run(self):
        while (item := self.queue.get()) is not None:
            try:
                send(item[1], item[0], self.launch.bridge)
            except RuntimeError as e:
                _say_once(self.launch.failed(f"trainer rank {item[0]}", e).code)
                os._exit(1)

    def close(self):
        self.queue.put(None)
        self.join()


def serve(launch, args, tokenizer, train_data: list, grading_workers: int) -> int:
    """A rollout rank's life: start its part of an engine (sampler.make_sampler), then run trainer 0's commands until
    "stop": collect a step's batch for the trainer ranks it plays, load weights, generate for an evaluation. Returns
    the process's exit status (0) when the trainers stop: the script ends the process with it."""
    rank, on_gpu = dist.get_rank(), launch.device.type == "cuda"
    T, K, tp = launch.trainers, launch.rollouts, args.vllm_tensor_parallel_size
    played = list(range(rank, T, K))  # trainer ranks whose batches this rank generates and sends
    sampler = make_sampler(args, rank, on_gpu, None, tokenizer, launch)  # its part of a vLLM engine, never asleep
    engine = sampler.llm
    stop = StopSignal(sampler)
    sender, consumed = _Sender(launch), 0
    while True:
        try:
            kind, payload = broadcast(None, launch.link)
        except RuntimeError as e:  # the process ends here at once, as the sender does: unwinding it would let a
            # runpy frame that ran the script as __main__ (tests, the fork server) restore its own __main__ while the
            # sender still pickles a batch of the script's Samples (PicklingError, a traceback in the sender)
            _say_once(launch.failed("trainer rank 0", e).code)
            os._exit(1)
        if kind == "stop":
            break
        if kind == "begin":
            consumed = payload
        elif kind == "collect":
            consumed, parts = rollouts.collect_for(
                args, consumed, train_data, tokenizer, sampler, grading_workers, played, T
            )
            for r in played:
                sender.queue.put((r, ("batch", parts[r], stop.requested)))
        elif kind == "weights":  # a group's (name, shape, dtype) list, then its buffers, until None
            written = []
            while (header := broadcast(None, launch.link)) is not None:
                load_group(engine, receive_group(header, launch), written)
            check_written(engine, written)  # every parameter of its engine written: or one line, and the rank stops
            engine.reset_prefix_cache()
        elif kind == "generate":  # evaluation: each trainer's requests, on the engine of the rank that plays it
            mine = [r for r in range(T) if (r % K) // tp == rank // tp]  # the trainers of this rank's engine
            inputs = [x for r in mine for x in payload[r][0]]
            outputs = engine.generate(inputs, [x for r in mine for x in payload[r][1]], use_tqdm=False)
            first = 0
            for r in mine:
                n = len(payload[r][0])
                if r % K == rank:
                    sender.queue.put((r, ("outputs", outputs[first : first + n], stop.requested)))
                first += n
    sender.close()
    shutdown(sampler, launch)
    return 0
