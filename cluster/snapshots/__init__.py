"""In-memory checkpoint snapshots kept on peer nodes (issue 17, after "Gemini", SOSP '23).

A snapshot is an ordinary checkpoint (trainer/checkpoint: the same writer, commit, retention,
reader, resharding and validation) written under "keeper://<run_key>/<path>": a pyarrow
filesystem whose files live in the memory of Ray actors, one keeper per node.

    keeper_fs.register_keeper_scheme()          # in every process that reads or writes them
    keepers.ensure_keeper(run_key, node_id)     # by each worker; a node's workers share one
    root = f"keeper://{run_key}/snapshots"
    CheckpointWriter(root, keep=2).save(...)    # or latest_checkpoint(root), CheckpointReader
    keepers.stop_keepers(run_key)               # the driver, when the job ends

    keeper.py      SnapshotKeeper: one node's files, in its memory (imports only Ray)
    keepers.py     a run's keepers: named, pinned to their node, listed, stopped
    keeper_fs.py   the keeper:// filesystem: where each file goes, reads by range
    lifecycle.py   a launch's snapshots: their key, the roots its workers write and inherit,
                   when the keepers stop (the driver and the workers both ask it)

Placement, what lets a snapshot survive the loss of any one node: every file is stored on two
keepers, the writing process's own node's and its peer's, the next node id after it in the
sorted list of nodes that have a keeper (wrapping around). So each file has a copy on a node
other than the one that wrote it. With a single node there is only one copy: a worker crash is
still covered (the keeper is its own process and outlives the worker group), a node loss is not.
A file that lost a copy is not copied again; the next snapshot is placed among the nodes left.
Memory: a node holds `keep` snapshots of the shards written on it and on the node before it.

Imports nothing itself: a keeper process imports only keeper.py (Ray loads an actor's class by
its module), not the filesystem and the project behind it.
"""
