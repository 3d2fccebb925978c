"""all-gather + GEMM (Flux): each device multiplies the row block it holds while the next one arrives."""
