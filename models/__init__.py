"""Bagel models: the diffusion experts a cell trains and the tools around them.

- `dit`, `unet`, `router`: architectures with named presets and closed-form parameter counts;
- `flow`: the pure rectified-flow core (objective, t-sampling, ranges, samplers, conversions);
- `data`: sources, split, k-means cluster manifest, deterministic `shard`;
- `experts`: `cell_task(spec, cell_id)`, what one cell trains, and closed-form cell sizing;
- `compose`: the composed sampler over a grid of cells (routing rules, fallbacks, CFG);
- `train`, `evaluate`, `checkpoint`: a local training loop, offline metrics, safetensors files.
"""
