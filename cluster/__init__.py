"""The Ray layer: the Hydra entry point (`python -m cluster.train`), the Ray Train V2 TorchTrainer
that runs trainer.loop in each worker, and the glue that reports checkpoints to Ray.
Imports trainer/; trainer/ never imports this."""
