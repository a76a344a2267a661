"""Qwen3-Omni's components: MoE text decoders, MRoPE, the code predictor, projections, encoders."""
