"""Attention and KV-cache ops over paged memory; backends chosen at run time."""
