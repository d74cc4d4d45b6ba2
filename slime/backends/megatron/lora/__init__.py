"""LoRA on megatron-core's tensor-parallel linears: the adapters (``layers``), which layers get them
(``targets``) and the adapter as HF PEFT writes it, out and in (``peft_io``)."""
