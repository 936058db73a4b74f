"""The driver's MLflow: the runs every worker logs into, what they measured, and their plots.

    runs.py      create a run (a sweep's parent, a job's child), tag it, end it, read it back
    source.py    the git commit a run is tagged with (no Ray, no MLflow: cluster/submit.py too)
    job.py       one job's run for cluster/train.py: its artifacts, then its summary and curve
    summary.py   medians and p10-p90 after the warm-up, from a run's own metric history
    compare.py   a sweep's runs side by side: rows, and which is fastest (cluster/report.py)
    plots.py     loss curves and bar charts as PNG files

Imports nothing itself: import the module you need. The workers' side of MLflow (rank 0's
logger, the system metrics) is trainer/metrics.py.
"""
