"""The training layer: what a rank's trainer runs on top of the rank client.

- :mod:`.realized_work`: mass functions and :func:`average_window` (one window's rounds);
- :mod:`.schedule`: where each window ends and when its consensus merges (no I/O);
- :mod:`.mirror`: the rank's mirror of the controller's outer optimizer (overlapped windows);
- :mod:`.trainer`: :func:`open_window_trainer`, the window loop with its round overlapped;
- :mod:`.blocking`: the same client and trainer for synchronous code (trio in a helper thread);
- :mod:`.checkpoint`: :func:`restore_module`, a checkpoint copied into a torch module.

Nothing here imports torch at module level except through the tensor bridge
(:mod:`flodl_trio.client.tensors`), which the trainer uses.
"""
