"""Run by tests/test_rollout_ranks.py: both threads of a rollout rank find their peer gone and each ends the process
after rollout_rank._say_once (os._exit), the first slow to print (a stderr that takes 0.5 s a write). Its line must
come out: the second may not end the process while the first is printing."""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils import rollout_rank  # noqa: E402


class SlowStream:
    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        time.sleep(0.5)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


sys.stderr = SlowStream(sys.stderr)
threading.Thread(target=rollout_rank._say_once, args=("error: the first thread's line",)).start()
time.sleep(0.1)  # the first thread is in its write
rollout_rank._say_once("error: the second thread's line")
os._exit(1)
