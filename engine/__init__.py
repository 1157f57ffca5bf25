"""Algorithms of dlrmflow. Nothing in here imports Prefect."""
