"""The TCP port of a launch (MASTER_PORT) for the tests and benchmarks that start the scripts, here or on a GPU
machine."""

import os
import random
import socket
import threading

_port_lock, _next_port = threading.Lock(), []


def free_port() -> int:
    """A TCP port for a launch's MASTER_PORT: free now, and not one that another process is about to take. Not
    bind(0)'s: that comes from the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
    default), from which every outgoing connection and every other bind(0) draw too (gloo's pairs, vLLM's
    get_open_port), so another process can take it between its release and the launcher's bind (EADDRINUSE, seen in
    the suite). These are below that range, in 10000-26383: a slice of 2048 per pytest-xdist worker
    (PYTEST_XDIST_WORKER, which what a test launches inherits; one slice outside pytest), walked from a random start
    (the threads of a process share the walk), each checked free."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = 10000 + 2048 * (int(worker) % 8 if worker.isdigit() else 0)
    with _port_lock:
        if not _next_port:
            _next_port.append(random.randrange(2048))
        for _ in range(2048):
            port = low + _next_port[0] % 2048
            _next_port[0] += 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                    return port
                except OSError:
                    continue
    raise SystemExit(f"error: no free TCP port in {low}-{low + 2047}")
