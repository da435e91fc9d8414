"""``pdserve plan``: the prefill/decode split of a server budget for a workload, predicted from
the servers' measured costs (``docs/planning.md``).

``workload.py`` (what is asked), ``profile.py`` (what a server costs), ``measure.py`` and
``calibrate.py`` (where the costs come from), ``simulate.py`` (a cluster serving the requests),
``planner.py`` (the candidate splits and the recommendation), ``cli.py`` (the command).
"""
