"""The reference PyTorch-native GPT job: model, parallelisms and training script.

``model`` (GPT with global layer names and configuration-independent init),
``parallelize`` (mesh, pipeline stages, DTensor TP, FSDP2/replicate DP,
pipeline schedule), ``train`` (the job builder and the torchrun entry point),
``layout`` (its PTC, derived from PyTorch by ``tenplex.ptc.torch_layout``).
"""
