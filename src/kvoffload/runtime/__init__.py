"""Multi-process runtime: a scheduler and N spawned worker processes talking over the wire.

* ``channel`` - wire messages over a ``multiprocessing`` connection, with timeouts.
* ``worker_process`` - the worker process entry point (handshake, StepPlans in, WorkerReports out).
* ``cluster`` - ``WorkerCluster``, the scheduler side: spawn, handshake, fan out, gather, fail dead workers.
* ``sim_engine`` - deterministic KV contents for the demo and tests (fill and byte-for-byte verify).
"""
