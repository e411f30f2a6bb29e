"""Reshardable checkpoints: torch.distributed.checkpoint (DCP) shards plus small JSON files.

A checkpoint directory ``<layout>/global_step<N>/`` holds the DCP shards and ``.metadata`` of ``{"model":
model state, "optim": flattened per-parameter AdamW state}``, and ``trainer_state.json``, ``config.json``,
``strategy.json``, ``manifest.json`` and (when the saver measured one) ``probe.json``, the loss of a fixed
probe batch that the next load compares against (:mod:`cona.engine.switch_check`). DCP stores every tensor
with its global shape and the offsets of each shard, so any layout (dp, tp, pp, zero, 1 process) can load what
any other saved.

The modules, one concern each:

- :mod:`.save`: the collective save, its crash-safe publication and ``latest``;
- :mod:`.periodic`: saves every ``save_interval`` iterations or minutes inside a stage, in the background;
- :mod:`.load`: loading under any layout, verifying the files first; a model's tensors alone (export);
- :mod:`.info`: finding a checkpoint (``latest`` markers, step folders) and reading its JSON files;
- :mod:`.paths`: where a run's checkpoints live (``<workdir>/checkpoints/<run_name>/<layout>``);
- :mod:`.manifest`: ``manifest.json``, the SHA-256 of every file, checked by every load, export, inspection;
- :mod:`.files`: is a checkpoint directory complete (its files alone, no torch import at the start);
- :mod:`.dcp`: DCP reads and writes with nothing unpickled beyond plain data, and one-line failures;
- :mod:`.state`: the state dictionaries a checkpoint holds and the process-group helpers.

This package's ``__init__`` imports nothing: the runner imports :mod:`.files`, :mod:`.info` and
:mod:`.paths` without torch (importing ``torch.distributed.checkpoint`` takes seconds).
"""
