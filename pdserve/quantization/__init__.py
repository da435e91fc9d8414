"""Quantized checkpoints as their makers publish them: each format (``base.WeightFormat``) reads
its ``quantization_config``, swaps the quantized layers' parameters for the checkpoint's own
packed tensors before the weights are loaded (no dequantized copy is ever held), shards their
scales along whole blocks, and gives each layer the matmul that reads them. ``registry`` picks
the format from ``quant_method`` and refuses the ones not built, naming the field and value."""
