"""``python -m flodl_trio.demo``: a whole local cluster training a small model.

- :mod:`.main`: the command line (and ``--worker``, how the demo starts its own ranks);
- :mod:`.cluster`: the daemons and ranks, started by the testing toolkit's process
  harness, and the training followed window by window (the kill, the restart);
- :mod:`.worker`: one rank's process, training with Local SGD;
- :mod:`.model`: the model and each rank's data;
- :mod:`.report`: the summary table and the plot.
"""
