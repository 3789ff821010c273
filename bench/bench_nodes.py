"""Trivial python-node functions for the executor overhead benchmark."""


def passthrough(x: str) -> str:
    return x


async def passthrough_async(x: str) -> str:
    return x
