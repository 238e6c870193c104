"""Starting a system: the one package that knows both the router (pd_server/) and the ranks.

    launch.py      `pd_start.sh` -> `python -m launcher.launch`: router + ranks as one process group
    supervisor.py  rank processes on this host: watched, restarted (--supervise), reaped
    ray_ranks.py   rank processes as Ray actors on a cluster's nodes (--ray)
"""
