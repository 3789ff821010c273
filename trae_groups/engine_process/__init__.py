"""The engine core in a process of its own, behind the ``ModelClient`` seam.

The HTTP front (Starlette, the graph executor, templates, python nodes, metrics)
holds an ``EngineProcessRuntime`` (runtime.py): it starts one child process
(child.py) that runs the models, the pool, the loop and the scheduler exactly as
``ModelRuntime`` does in one process, and reaches it over one local socket pair
(wire.py). Each (model, version) is an ``EngineClient`` (client.py) in the front.
docs/serving.md ("The engine process") is the guide.
"""

from trae_groups.engine_process.runtime import EngineLost, EngineProcessRuntime

__all__ = ["EngineLost", "EngineProcessRuntime"]
