"""Distributed tests: real ``torch.distributed`` process groups (gloo, CPU) of two spawned processes.

:func:`tests.distributed._workers.launch` starts the ranks, each running one function of ``_workers.py``, and
returns what each rank reported; it never waits longer than its timeout (the ranks are killed, the test fails).
"""
