"""Stage entry points, each run as `python -m stages.<name>`."""
