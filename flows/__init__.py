"""Prefect flows: thin orchestration over ``dlrmflow.engine`` and ``dlrmflow.datasets``."""
