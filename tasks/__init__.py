"""Prefect tasks: thin wrappers over engine functions."""
