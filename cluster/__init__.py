"""The Ray layer: the commands, and the glue between Ray Train and the Ray-free trainer/.

    train.py sweep.py prepare.py plan.py submit.py report.py   the commands (python -m cluster.X)
    config.py      the job's config: the ground floor, importing nothing of cluster/ but the
                   run folder's layout (run/layout.py, which imports nothing of cluster/)
    compose.py     how Hydra composes it: the schema, the model presets, model=hf's resolver
    job_slot.py    where a job sits in a sweep (told through the environment); sweep_repeats.py
    preflight.py   the driver's checks before Ray: the job as the workers will run it
    logs.py        what a run prints, without the libraries' chatter
    address.py     which Ray a job joins (or none: a local one is started)
    launch.py      Ray for one job: connect, build the TorchTrainer
    worker.py      what each Ray Train worker runs: the adapter into trainer.loop
    run/           the run folder: its layout, elastic/ documents, the lease, Ray's checkpoint
                   pointers, the fatal record
    tracking/      the driver's MLflow: runs, summaries, comparisons, plots
    elastic/       drain, grow, leave, faults, tracker, clock, cluster view, preemption, spares;
                   hooks.py (the worker's) and callbacks.py (the driver's Ray Train callbacks)
    snapshots/     in-memory snapshots: keepers on every node, the keeper:// filesystem, and a
                   launch's snapshots from their key to their end (lifecycle.py)

Imports trainer/; trainer/ never imports this. No package here imports anything in its
__init__: import the module you need.
"""
