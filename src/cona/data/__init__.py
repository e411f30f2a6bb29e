"""Data: the Megatron mmap indexed dataset (``indexed``), the GPT-2 BPE tokenizer (``tokenizer``),
jsonl -> indexed dataset (``preprocess``), the GPT sample index and sampler (``gpt_dataset``) and the
demo data obtained at set-up (``demo``)."""
