"""MoE dispatch + grouped GEMM (Comet layer 0): tiles arrive from peers into per-expert buffers and each
tile's GEMM starts once its rows are present."""
