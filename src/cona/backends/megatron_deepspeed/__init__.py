"""The Megatron-DeepSpeed backend: CONA's chains run through a user's Megatron-DeepSpeed checkout.

- :mod:`.environment`: where the checkout, its Python and the import shim are, and what the checkout's code
does
  (its fused-QKV layout decides whether a tensor-parallel change can be resharded).
- :mod:`.commands`: the ``deepspeed`` launcher command, ``pretrain_gpt.py`` arguments and ``ds_config`` of a
stage.
- :mod:`.log_parse`: Megatron's stdout lines -> CONA's ``metrics.jsonl`` records.
- :mod:`.universal`: ``ds_to_universal`` between stages and the repair of its known defects.
- :mod:`.stage`: runs one stage (and the evaluation-only launches of switch verification).
- :mod:`.verify`: switch verification (the loss of the same samples under the old and the new layout).
- :mod:`.run`: ``cona train --backend megatron-deepspeed`` in fixed and chain modes.
"""
