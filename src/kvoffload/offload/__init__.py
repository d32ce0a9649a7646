"""The offloading backend, in the order one engine step flows through it.

Scheduler side (torch-free; what an engine's scheduler process imports):

* ``keys`` - offload keys (block hash + group id), chunk arithmetic, key tags, a reference block hasher.
* ``manager`` (with ``policies``) - which key lives in which host chunk, LRU and ARC eviction (vLLM 0.33).
* ``scheduler`` - per-request lookup, load and store decisions, one ``StepPlan`` per engine step.

Between the two:

* ``pool`` - how many chunk rows fit the host budget (torch-free), the pool and its integrity table (torch).

Worker side (torch; imported only when used):

* ``worker`` (with ``copy``) - StepPlan execution and asynchronous page copies.
"""
