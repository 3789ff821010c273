"""trae-groups: serve composite model apps (a DAG of models) behind one endpoint."""

__version__ = "0.1.0"
