"""Moved: the served-process harness is rlproxy/ops/served.py, which bench/ uses too. This name
stays only for the test files that still import it from here (test_durability.py,
test_hostile_streams.py, test_poison.py, test_remote_learner.py); delete it once they import
rlproxy.ops.served."""

from rlproxy.ops.served import free_port, server_env, wait_healthy  # noqa: F401
