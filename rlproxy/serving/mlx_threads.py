"""Moved to rlproxy/mlx_threads.py (kv/ needs it too, and kv/ sits below serving/). This name
stays only while something imports it from here (training/rank_link.py did when it moved);
then delete it.
"""

from rlproxy.mlx_threads import Worker, mlx_thread  # noqa: F401  (the old name's importers)
