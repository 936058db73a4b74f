"""The Ray layer: the commands, and the glue between Ray Train and the Ray-free trainer/.

    train.py sweep.py prepare.py plan.py submit.py report.py   the commands (python -m cluster.X)
    config.py      the job's config and the run folder's layout: the ground floor, importing
                   nothing of cluster/
    preflight.py   the driver's checks before Ray: the job as the workers will run it
    logs.py        what a run prints, without the libraries' chatter
    launch.py      Ray for one job: connect, build the TorchTrainer
    worker.py      what each Ray Train worker runs: the adapter into trainer.loop
    run/           the run folder's files: elastic/ documents, the lease, Ray's checkpoint
                   pointers, the fatal record
    tracking/      the driver's MLflow: runs, summaries, comparisons, plots
    elastic/       drain, grow, leave, faults, tracker, clock, cluster view, preemption, spares
    snapshots/     in-memory snapshots: keepers on every node and the keeper:// filesystem

Imports trainer/; trainer/ never imports this. No package here imports anything in its
__init__: import the module you need.
"""
