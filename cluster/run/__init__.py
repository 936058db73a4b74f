"""A run's own files in its Ray run folder (<cluster.storage_path>/<cluster.run_name>, laid out as
layout.py says), and who writes them:

    layout.py           the paths: run_folder, checkpoint_root, the folders' names
    folder.py           the elastic/ folder's small JSON documents (RunFolder)
    lease.py            the run lease: one launch at a time owns the run name
    ray_checkpoint.py   the pointer folders that report the loop's checkpoints to Ray Train
    reporter.py         those reports, sent from a thread of their own (never blocking the loop)
    fatal.py            the error that ends a launch's training for good, handed to the driver

Imports nothing itself: import the module you need. None of them imports Ray at the top.
"""
