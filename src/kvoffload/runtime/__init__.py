"""Multi-process runtime: a scheduler and N spawned worker processes talking over the wire.

* ``_channel`` - wire messages over a ``multiprocessing`` connection, with timeouts.
* ``_liveness`` - hearing from one worker: receives that skip heartbeats and give up a silent or failed worker.
* ``_worker_process`` - the worker process entry point (handshake, StepPlans in, WorkerReports out).
* ``cluster`` - ``WorkerCluster``, the scheduler side: spawn, handshake, fan out, gather, fail dead workers.
* ``hooks`` - ``WorkerHook``: application code a worker runs around every step, named by a dotted path.

The runtime moves KV between each worker's engine memory and its host pool and nothing else. Code that plays
the engine inside the workers (the demo's simulated forward pass, a probe) is a worker hook:
``WorkerCluster(snapshot, hook="package.module:Factory", hook_options={...})`` makes every worker import
``Factory`` (the path and the JSON options travel in the JSON ``WorkerSpec``, never as pickle) and call it once
with a ``WorkerContext`` (rank, world size, the worker's flat ``uint8`` KV tensor and its ``TransferLayout``,
the offloading config, the options). The hook it returns is called with ``before_step(plan, attachments)``
when a plan arrives (``attachments``: the extra frames of ``WorkerCluster.step(plan, attachments)``), with
``after_step(plan, report)`` once the step's loads are done, before its stores are queued (the forward pass;
the bytes it returns come back in ``ClusterStep.attachments[rank]``), with ``finish(report)`` on shutdown
after the drain (its bytes come back from ``WorkerCluster.close()``), and ``close()`` at the end. A hook that
raises ends its worker with a ``WorkerFailure`` naming the exception.
"""
