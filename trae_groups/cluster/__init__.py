"""Scale-out on Ray Serve: the same graph file, with engine replicas on a cluster.

An ingress deployment runs our Starlette app (routes, validation, templates, python
nodes, admission, SSE, the OpenAI routes); its executor reaches the models through
``RemoteClient``s, which implement the engine protocol (engine/protocol.py) over
DeploymentHandles. Each engine *group* (graphs/deploy.py) is a deployment whose
replica is one runtime: one engine loop, one paged pool, one weight store. Ray is
imported only here; one process stays the embedded default. docs/cluster.md is the guide.
"""
