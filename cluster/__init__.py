"""What the router and the ranks both speak, and nothing else: the messages between processes
(protocol/), the cluster secret's CURVE authentication (auth.py) and the dataclass -> flags
helper every process parses its command line with (cli_args.py). It imports neither the router
(pd_server/) nor any rank package.
"""
