"""Files that run inside a Megatron-DeepSpeed checkout's processes, in its interpreter (torch only, CONA not
installed there): the launcher runs ``cona_pretrain_gpt.py``, whose folder is then first on ``sys.path``, so
its siblings import as top-level modules. CONA itself never imports them (a package only so that they ship
with CONA)."""
