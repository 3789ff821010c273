"""Graph specs (YAML and DSL), compile-time validation and the executor."""
